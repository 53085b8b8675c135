"""The logits-processor contract and the per-step batch changes processors track.

The model runner keeps a persistent batch: a request keeps its row while it runs, and rows are
added, removed and moved between steps. Processors keep per-row state keyed by row index; each
step they receive a `BatchUpdate` describing how rows changed, then `apply` to the logits.
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from engine.request import SamplingParams


class MoveDirectionality(enum.Enum):
    """How a row moved inside the persistent batch."""

    # a -> b: row b takes a's request, row a is left empty (b's old request is gone).
    UNIDIRECTIONAL = enum.auto()
    # a <-> b: the two rows exchange their requests.
    SWAP = enum.auto()


RemovedRequest = int
# (row index, params, prompt_token_ids, output_token_ids). output_token_ids is the request's own
# growing list, not a copy: processors read it every step to see newly sampled tokens.
AddedRequest = tuple[int, SamplingParams, list[int], list[int]]
MovedRequest = tuple[int, int, MoveDirectionality]


@dataclass(frozen=True)
class BatchUpdate:
    """Row changes since the last step. Apply in this order: removed, added, moved."""

    batch_size: int
    removed: Sequence[RemovedRequest]
    added: Sequence[AddedRequest]
    moved: Sequence[MovedRequest]


@dataclass(frozen=True)
class LogitsProcessorConfig:
    """What processors know of the model and the engine."""

    vocab_size: int
    max_num_seqs: int
    eos_token_id: int | None = None
    reasoning_start_token_id: int | None = None
    reasoning_end_token_id: int | None = None
    # The model's tokenizer (engine.tokenizer.Tokenizer), for processors that read text or the
    # vocabulary (structured outputs); None for a model served by token ids only.
    tokenizer: Any = field(default=None, compare=False)

    def __post_init__(self) -> None:
        for name in ("vocab_size", "max_num_seqs"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        for name in ("eos_token_id", "reasoning_start_token_id", "reasoning_end_token_id"):
            token_id = getattr(self, name)
            if token_id is None:
                continue
            if isinstance(token_id, bool) or not isinstance(token_id, int):
                raise ValueError(f"{name} must be an integer or None, got {token_id!r}")
            if not 0 <= token_id < self.vocab_size:
                raise ValueError(
                    f"{name}={token_id} is outside the vocabulary [0, {self.vocab_size})"
                )


class LogitsProcessor(ABC):
    """A batch-level transformation of logits with per-row state.

    `update_state` is called once per step, before `apply`, even when the batch did not change
    (`None`): processors that follow the live output lists refresh themselves there.
    """

    def __init__(self, config: LogitsProcessorConfig, device: torch.device) -> None:
        self.config = config
        self.device = device

    def validate_params(self, params: SamplingParams) -> None:
        """Raise ValueError when this processor cannot serve `params` (default: accept)."""
        return None

    @abstractmethod
    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """Transform `logits` [batch, vocab] float32 (in place allowed); return the result."""

    @abstractmethod
    def is_argmax_invariant(self) -> bool:
        """True when `apply` never changes a row's argmax (it may then be skipped for greedy)."""

    @abstractmethod
    def update_state(self, batch_update: BatchUpdate | None) -> None:
        """Follow the row changes of this step (`None`: no row changed)."""


class BatchUpdateBuilder:
    """Collects one step's row changes; `get_and_reset` freezes them into a `BatchUpdate`."""

    def __init__(self) -> None:
        self._removed: list[RemovedRequest] = []
        self._added: list[AddedRequest] = []
        self._moved: list[MovedRequest] = []

    def removed_append(self, index: int) -> None:
        self._removed.append(_check_index("removed", index))

    def added_append(self, entry: AddedRequest) -> None:
        _check_index("added", entry[0])
        self._added.append(entry)

    def moved_append(self, entry: MovedRequest) -> None:
        _check_index("moved", entry[0])
        _check_index("moved", entry[1])
        if not isinstance(entry[2], MoveDirectionality):
            raise ValueError(f"moved entry needs a MoveDirectionality, got {entry[2]!r}")
        self._moved.append(entry)

    def pop_removed(self) -> int | None:
        """Take back the lowest removed row (to put a new request there), or None."""
        if not self._removed:
            return None
        lowest = min(self._removed)
        self._removed.remove(lowest)
        return lowest

    def get_and_reset(self, batch_size: int) -> BatchUpdate | None:
        """This step's changes (None when nothing changed); the builder starts empty again."""
        if not (self._removed or self._added or self._moved):
            return None
        update = BatchUpdate(
            batch_size=batch_size,
            removed=tuple(sorted(self._removed)),
            added=tuple(self._added),
            moved=tuple(self._moved),
        )
        self._removed, self._added, self._moved = [], [], []
        return update


def _check_index(what: str, index: object) -> int:
    if isinstance(index, bool) or not isinstance(index, int) or index < 0:
        raise ValueError(f"{what} row index must be an integer >= 0, got {index!r}")
    return index
