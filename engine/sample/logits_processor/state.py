"""Keeping a `{row index: state}` dict in step with the persistent batch."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from engine.request import SamplingParams
from engine.sample.logits_processor.interface import BatchUpdate, MoveDirectionality

T = TypeVar("T")


def process_dict_updates(
    entries: dict[int, T],
    batch_update: BatchUpdate | None,
    new_state: Callable[[SamplingParams, list[int], list[int]], T | None],
) -> bool:
    """Apply removed, then added, then moved rows to `entries`; True when it changed.

    `new_state(params, prompt_token_ids, output_token_ids)` builds an added row's state, or
    returns None when the processor has nothing to do for that request.

    Removed first so a row that is freed and refilled in the same step ends with the new
    request's state; moved last because moves refer to rows as they are after the additions.
    """
    if batch_update is None:
        return False
    changed = False
    for index in batch_update.removed:
        changed |= entries.pop(index, None) is not None
    for index, params, prompt_token_ids, output_token_ids in batch_update.added:
        state = new_state(params, prompt_token_ids, output_token_ids)
        if state is not None:
            entries[index] = state
            changed = True
        else:
            # The row's previous occupant may have left state behind.
            changed |= entries.pop(index, None) is not None
    for a_index, b_index, direction in batch_update.moved:
        changed |= _move(entries, a_index, b_index, direction)
    return changed


def _move(entries: dict[int, T], a_index: int, b_index: int, direction: MoveDirectionality) -> bool:
    # Pop both before writing either, so a swap never reads a value it has just written.
    a_state = entries.pop(a_index, None)
    b_state = entries.pop(b_index, None)
    if a_state is not None:
        entries[b_index] = a_state
    if direction is MoveDirectionality.SWAP and b_state is not None:
        entries[a_index] = b_state
    return a_state is not None or b_state is not None
