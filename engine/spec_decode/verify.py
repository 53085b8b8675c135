"""Verifying drafts in the model runner: which logits to compute, which tokens to keep.

A request with k drafts is scheduled 1 + k tokens: its last real token, then the drafts. The
logits at all 1 + k positions are computed; the first goes through the sampler like any
request's (so the emitted token is exactly what plain decoding would emit), the other k are
argmaxes (drafts are only proposed for plain-greedy requests: engine/spec_decode/ngram.py).
Draft j is accepted while it equals the token predicted at its position; the emitted tokens
are the predictions up to and including the first mismatch (the correction), or all k + 1.
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
        offsets = np.arange(int(counts.sum())) - np.repeat(first, counts)
        positions = np.repeat(ends - 1 - num_drafts, counts) + offsets
        return cls(torch.from_numpy(positions).to(device), first, num_drafts, drafts)

    def sampler_rows(self) -> torch.Tensor:
        """Rows of the computed logits that the sampler sees: one per request."""
        return torch.from_numpy(self.first).to(self.logits_indices.device)

    def accepted(self, i: int, sampled: int, predictions: list[int]) -> list[int]:
        """The tokens request i emits: `sampled` (its first position's token), then for each
        draft that matched the prediction before it, the prediction at that draft."""
        out = [sampled]
        first = int(self.first[i])
        for j, draft in enumerate(self.drafts[i], start=1):
            if draft != out[-1]:
                break
            out.append(predictions[first + j])
        return out
