"""Structured outputs as a logits processor: each constrained row keeps an xgrammar matcher.

Every step the matcher first accepts the tokens the row sampled since the last step (read from
the live output list), then writes the row's allowed-token bitmask, which masks the logits.
A row that starts with output tokens already (a resumed request, or a disaggregated decode
leg whose first token came from the prefill engine) replays them first: the grammar state is
a function of the output so far, so both legs constrain alike. When the grammar is complete
only stop tokens are allowed, and the request ends on one.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch

from engine.request import SamplingParams
from engine.sample.logits_processor.interface import (
    BatchUpdate,
    LogitsProcessor,
    LogitsProcessorConfig,
)
from engine.sample.logits_processor.state import process_dict_updates
from engine.sample.structured import StructuredOutputs

logger = logging.getLogger(__name__)


@dataclass
class _Row:
    params: SamplingParams
    output: list[int]  # the request's live output list
    matcher: Any
    consumed: int = 0  # output tokens the matcher has accepted
    broken: bool = False  # a token outside the grammar was forced: stop constraining


class StructuredOutputLogitsProcessor(LogitsProcessor):
    def __init__(self, config: LogitsProcessorConfig, device: torch.device) -> None:
        super().__init__(config, device)
        self._outputs = StructuredOutputs(config.tokenizer, config.vocab_size, _stop_ids(config))
        self._rows: dict[int, _Row] = {}
        self._bitmask: torch.Tensor | None = None

    def is_argmax_invariant(self) -> bool:
        return False

    def validate_params(self, params: SamplingParams) -> None:
        if params.structured_outputs is None:
            return
        if not self._outputs.available:
            raise ValueError("structured outputs need a model with a tokenizer and an eos token")
        self._outputs.matcher(params.structured_outputs)  # compiles now, cached for the step

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        process_dict_updates(self._rows, batch_update, self._new_row)
        for row in self._rows.values():
            self._catch_up(row)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        live = [(i, r) for i, r in self._rows.items() if not r.broken]
        live = [(i, r) for i, r in live if not r.matcher.is_terminated() and i < logits.shape[0]]
        if not live:
            return logits  # xgrammar is imported only once a request asks for a grammar
        import xgrammar as xgr

        bitmask = self._bitmask_for(logits.shape[0])
        for index, row in live:
            row.matcher.fill_next_token_bitmask(bitmask, index)
        indices = [index for index, _ in live]
        xgr.apply_token_bitmask_inplace(
            logits, bitmask.to(logits.device), vocab_size=self.config.vocab_size, indices=indices
        )
        return logits

    def _new_row(
        self, params: SamplingParams, _prompt: list[int], output: list[int]
    ) -> _Row | None:
        if params.structured_outputs is None:
            return None
        return _Row(params, output, self._outputs.matcher(params.structured_outputs))

    def _catch_up(self, row: _Row) -> None:
        if len(row.output) < row.consumed:  # output rolled back: replay from the start
            assert row.params.structured_outputs is not None
            row.matcher = self._outputs.matcher(row.params.structured_outputs)
            row.consumed, row.broken = 0, False
        while row.consumed < len(row.output) and not row.broken:
            token = row.output[row.consumed]
            row.consumed += 1
            if row.matcher.is_terminated():
                continue  # tokens after the end (ignore_eos): nothing left to constrain
            if not row.matcher.accept_token(token):
                # A forced token the grammar does not allow (the legs of one request constrain
                # alike, so this is a caller's forced prefix): the rest is unconstrained.
                logger.warning(
                    "token %d is outside the grammar: output no longer constrained", token
                )
                row.broken = True

    def _bitmask_for(self, num_rows: int) -> torch.Tensor:
        import xgrammar as xgr

        if self._bitmask is None or self._bitmask.shape[0] < num_rows:
            size = max(num_rows, self.config.max_num_seqs)
            self._bitmask = xgr.allocate_token_bitmask(size, self.config.vocab_size)
        return self._bitmask


def _stop_ids(config: LogitsProcessorConfig) -> list[int]:
    """Every end-of-sequence id (Llama 3 has two): what a complete grammar allows."""
    ids = [config.eos_token_id] if config.eos_token_id is not None else []
    if config.tokenizer is not None:
        ids += [t for t in config.tokenizer.eos_token_ids if t < config.vocab_size]
    return list(dict.fromkeys(ids))
