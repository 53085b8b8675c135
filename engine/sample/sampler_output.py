"""What the sampler returns."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.outputs import TokenLogprobs


@dataclass
class LogprobsOutput:
    """Log-probabilities of the raw (unprocessed) logits.

    Column 0 is the sampled token, columns 1..n the top-n tokens, best first. Every row has
    n = the batch's largest `logprobs`; rows that asked for fewer use a prefix.
    """

    token_ids: torch.Tensor  # [B, n+1] int64
    logprobs: torch.Tensor  # [B, n+1] float32
    ranks: torch.Tensor  # [B] int64: 1 + number of tokens strictly more likely than the sample

    def rows(self, wanted: list[int]) -> list[TokenLogprobs]:
        """Per row: the sampled token then the row's own top-n, `wanted[row]` of them (the
        batch computed the largest n any row asked for)."""
        ids, values, ranks = self.token_ids.tolist(), self.logprobs.tolist(), self.ranks.tolist()
        return [
            (i[: n + 1], v[: n + 1], r)
            for n, i, v, r in zip(wanted, ids, values, ranks, strict=True)
        ]


@dataclass
class SamplerOutput:
    sampled_token_ids: torch.Tensor  # [B] int64
    logprobs: LogprobsOutput | None
