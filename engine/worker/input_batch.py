"""The persistent batch: running requests keep their row between steps.

Rows are refilled in place: a finished request's row goes to the next new request, and holes
are closed by moving the last rows down. Each change is reported to the logits processors
through a BatchUpdate, so their per-row state follows the requests.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from engine.core.kv_cache_utils import cdiv
from engine.request import SamplingParams
from engine.sample.logits_processor.interface import BatchUpdateBuilder, MoveDirectionality
from engine.worker.block_table import BlockTable


@dataclass
class CachedRequestState:
    """What the worker keeps of a request between steps."""

    req_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    sampling_params: SamplingParams
    num_computed_tokens: int

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)


class InputBatch:
    def __init__(self, max_num_reqs: int, max_model_len: int, block_size: int) -> None:
        self.max_num_reqs = max_num_reqs
        # +1: the last sampled token of a full-length request sits at index max_model_len.
        self.token_ids = np.zeros((max_num_reqs, max_model_len + 1), dtype=np.int64)
        self.num_tokens = np.zeros(max_num_reqs, dtype=np.int64)
        self.num_computed_tokens = np.zeros(max_num_reqs, dtype=np.int64)
        self.block_table = BlockTable(max_num_reqs, cdiv(max_model_len, block_size), block_size)
        self.req_ids: list[str | None] = []  # row -> request id; None marks a hole
        self.req_id_to_index: dict[str, int] = {}
        self.states: list[CachedRequestState | None] = []
        self.batch_update_builder = BatchUpdateBuilder()

    @property
    def num_reqs(self) -> int:
        return len(self.req_id_to_index)

    def add_request(self, state: CachedRequestState, block_ids: list[int]) -> int:
        row = self.batch_update_builder.pop_removed()
        if row is None:
            if len(self.req_ids) >= self.max_num_reqs:
                raise RuntimeError(f"persistent batch is full ({self.max_num_reqs} rows)")
            row = len(self.req_ids)
            self.req_ids.append(None)
            self.states.append(None)
        self.req_ids[row] = state.req_id
        self.states[row] = state
        self.req_id_to_index[state.req_id] = row
        tokens = state.prompt_token_ids + state.output_token_ids
        self.token_ids[row, : len(tokens)] = tokens
        self.num_tokens[row] = len(tokens)
        self.num_computed_tokens[row] = state.num_computed_tokens
        self.block_table.set_row(row, block_ids)
        self.batch_update_builder.added_append(
            (row, state.sampling_params, state.prompt_token_ids, state.output_token_ids)
        )
        return row

    def remove_request(self, req_id: str) -> None:
        row = self.req_id_to_index.pop(req_id, None)
        if row is None:
            return
        self.req_ids[row] = None
        self.states[row] = None
        self.batch_update_builder.removed_append(row)

    def condense(self) -> None:
        """Close holes by moving the last live rows into them: rows [0, num_reqs) are live."""
        holes = sorted(i for i, r in enumerate(self.req_ids) if r is None)
        last = len(self.req_ids) - 1
        for hole in holes:
            while last > hole and self.req_ids[last] is None:
                last -= 1
            if last <= hole:
                break
            self._move(last, hole)
            last -= 1
        del self.req_ids[self.num_reqs :]
        del self.states[self.num_reqs :]

    def append_token(self, row: int, token_id: int) -> None:
        state = self.states[row]
        assert state is not None
        state.output_token_ids.append(token_id)
        self.token_ids[row, self.num_tokens[row]] = token_id
        self.num_tokens[row] += 1

    def truncate_outputs(self, row: int, num_output_tokens: int) -> None:
        """Forget outputs the scheduler dropped (they were sampled over bad KV)."""
        state = self.states[row]
        assert state is not None
        del state.output_token_ids[num_output_tokens:]
        self.num_tokens[row] = state.num_tokens

    def place_drafts(self, drafts: dict[str, list[int]]) -> None:
        """Drafts go after each request's last token, where the step's inputs are read from
        (its token count stays: they are not tokens yet)."""
        for req_id, tokens in drafts.items():
            row = self.req_id_to_index[req_id]
            start = int(self.num_tokens[row])
            self.token_ids[row, start : start + len(tokens)] = tokens

    def _move(self, src: int, dst: int) -> None:
        req_id = self.req_ids[src]
        assert req_id is not None
        self.req_ids[dst], self.req_ids[src] = req_id, None
        self.states[dst], self.states[src] = self.states[src], None
        self.req_id_to_index[req_id] = dst
        n = int(self.num_tokens[src])
        self.token_ids[dst, :n] = self.token_ids[src, :n]
        self.num_tokens[dst] = n
        self.num_computed_tokens[dst] = self.num_computed_tokens[src]
        self.block_table.move_row(src, dst)
        self.batch_update_builder.moved_append((src, dst, MoveDirectionality.UNIDIRECTIONAL))
