"""What the sampler returns."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class LogprobsOutput:
    """Log-probabilities of the raw (unprocessed) logits.

    Column 0 is the sampled token, columns 1..n the top-n tokens, best first. Every row has
    n = the batch's largest `logprobs`; rows that asked for fewer use a prefix.
    """

    token_ids: torch.Tensor  # [B, n+1] int64
    logprobs: torch.Tensor  # [B, n+1] float32
    ranks: torch.Tensor  # [B] int64: 1 + number of tokens strictly more likely than the sample


@dataclass
class SamplerOutput:
    sampled_token_ids: torch.Tensor  # [B] int64
    logprobs: LogprobsOutput | None
