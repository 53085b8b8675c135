"""Verifying drafts in the model runner: which logits to compute, which tokens to keep.

A request with k drafts is scheduled 1 + k tokens: its last real token, then the drafts. The
logits at all 1 + k positions are computed; the first goes through the sampler like any
request's, the other k are sampled the same way (temperature, top-k/top-p, the exponential
race with the request's seed at that output position; drafts are only proposed where nothing
else shapes the logits: engine/spec_decode/ngram.py). Draft j is accepted while it equals the
token sampled at the position before it; the emitted tokens are the samples up to and
including the first mismatch, or all k + 1.

Why this preserves the target distribution: every emitted token is an ordinary sample from
the model's distribution given the tokens before it (a draft is only kept when it equals what
was sampled there, so the context of the next sample is the true one). For a draft that is a
single token (n-gram drafts are), accepting it with probability p(draft) and otherwise taking
a sample conditioned on differing from it is exactly the rejection sampler of speculative
decoding. With a seed, the samples are keyed by (seed, output position) as in plain decoding,
so seeded output is draw for draw the same with and without speculation.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass
class DraftVerification:
    logits_indices: torch.Tensor  # [N] flattened-input positions whose logits are computed
    first: np.ndarray  # [R] per scheduled request: its first row among those N
    num_drafts: np.ndarray  # [R] drafts of each scheduled request (0: none)
    drafts: list[list[int]]  # [R]

    @classmethod
    def build(
        cls,
        req_ids: list[str],
        num_scheduled: np.ndarray,
        drafts_by_req: dict[str, list[int]],
        device: torch.device,
    ) -> DraftVerification:
        """`req_ids` / `num_scheduled`: the step's requests in input order."""
        drafts = [drafts_by_req.get(req_id, []) for req_id in req_ids]
        num_drafts = np.array([len(d) for d in drafts], dtype=np.int64)
        ends = np.cumsum(num_scheduled)
        counts = num_drafts + 1
        first = np.cumsum(counts) - counts
        # Positions ends-1-k .. ends-1 of each request, one after the other.
        positions = np.repeat(ends - 1 - num_drafts, counts) + _offsets(counts)
        return cls(torch.from_numpy(positions).to(device), first, num_drafts, drafts)

    def sampler_rows(self) -> torch.Tensor:
        """Rows of the computed logits that the sampler sees: one per request."""
        return torch.from_numpy(self.first).to(self.logits_indices.device)

    def draft_rows(self) -> tuple[np.ndarray, np.ndarray]:
        """(rows of the computed logits at draft positions, j of each: 1..k), in order."""
        counts = self.num_drafts
        j = 1 + _offsets(counts)
        return np.repeat(self.first, counts) + j, j

    def accepted(self, i: int, sampled: int, predictions: list[int]) -> list[int]:
        """The tokens request i emits: `sampled` (its first position's token), then for each
        draft that matched the sample before it, the sample at that draft (`predictions`:
        per computed-logits row)."""
        out = [sampled]
        first = int(self.first[i])
        for j, draft in enumerate(self.drafts[i], start=1):
            if draft != out[-1]:
                break
            out.append(predictions[first + j])
        return out


def _offsets(counts: np.ndarray) -> np.ndarray:
    """0..c-1 for each count c, concatenated: [2, 0, 3] -> [0, 1, 0, 1, 2]."""
    return np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts, counts)
