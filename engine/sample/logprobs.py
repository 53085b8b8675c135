"""Logprobs of the sampled token and of the top-n tokens."""

from __future__ import annotations

import torch

from engine.sample.sampler_output import LogprobsOutput


def gather_logprobs(
    raw_logprobs: torch.Tensor, sampled: torch.Tensor, num_logprobs: int
) -> LogprobsOutput:
    """Sampled token first, then the `num_logprobs` best (capped at the vocabulary size)."""
    sampled_logprob = raw_logprobs.gather(1, sampled.unsqueeze(1))
    ranks = (raw_logprobs > sampled_logprob).sum(dim=-1) + 1
    num_top = min(num_logprobs, raw_logprobs.shape[1])
    top_logprobs, top_ids = torch.topk(raw_logprobs, num_top, dim=-1)
    return LogprobsOutput(
        token_ids=torch.cat([sampled.unsqueeze(1), top_ids], dim=1),
        logprobs=torch.cat([sampled_logprob, top_logprobs], dim=1),
        ranks=ranks,
    )
