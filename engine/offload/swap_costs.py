"""Swap or recompute, decided per preemption from what this engine measured.

A preempted request's KV can go down to the tier and come back (swap), or be dropped and
computed again when it resumes (recompute). Swapping costs its blocks' copies: those the tier
lacks, out, and all of them back. Recomputing costs its computed tokens through the model.
Both are measured as the engine runs — seconds per block copy from the tier worker's reports,
seconds per token from steps that compute many tokens (prefill-like: a decode step's time per
token would make recomputing look dearer than it is) — as moving averages. Until both are
known, swapping is taken: a copy moves a block at memory speed, which a forward pass over
its tokens does not reach on any device this engine runs on.
"""

from __future__ import annotations

# A step that computes fewer tokens says little about prefill speed.
_MIN_STEP_TOKENS = 32
_WEIGHT = 0.2  # of each new measurement in the moving average


class SwapCosts:
    def __init__(self) -> None:
        self.copy_s: float | None = None  # per block copied, either way
        self.token_s: float | None = None  # per token computed

    def note_copies(self, num_copies: int, seconds: float) -> None:
        if num_copies > 0:
            self.copy_s = _average(self.copy_s, seconds / num_copies)

    def note_step(self, num_tokens: int, seconds: float) -> None:
        if num_tokens >= _MIN_STEP_TOKENS:
            self.token_s = _average(self.token_s, seconds / num_tokens)

    def swap_pays(self, blocks_out: int, blocks_back: int, tokens: int) -> bool:
        """Whether copying `blocks_out` down and `blocks_back` up is cheaper than computing
        `tokens` again."""
        if self.copy_s is None or self.token_s is None:
            return True
        return (blocks_out + blocks_back) * self.copy_s < tokens * self.token_s


def _average(old: float | None, new: float) -> float:
    return new if old is None else (1 - _WEIGHT) * old + _WEIGHT * new
