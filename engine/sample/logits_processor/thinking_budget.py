"""thinking_token_budget: force the reasoning-end token once a request has thought enough."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.request import SamplingParams
from engine.sample.logits_processor.interface import (
    BatchUpdate,
    LogitsProcessor,
    LogitsProcessorConfig,
)
from engine.sample.logits_processor.state import process_dict_updates


@dataclass
class _ThinkingState:
    """One request's progress through its reasoning section.

    Advanced incrementally: each step reads only the output tokens appended since the last one
    (`num_scanned`), so the cost per step does not grow with the output length.
    """

    budget: int
    output_token_ids: list[int]  # the request's live output list
    thinking: bool = False
    num_thinking_tokens: int = 0
    num_scanned: int = 0
    finished: bool = False

    @property
    def must_end(self) -> bool:
        return self.thinking and self.num_thinking_tokens >= self.budget

    def advance(self, start_id: int, end_id: int) -> None:
        output = self.output_token_ids
        for token_id in output[self.num_scanned :]:
            if not self.thinking:
                if token_id == start_id:
                    self.thinking = True
                    self.num_thinking_tokens = 0
            elif token_id == end_id:
                # One reasoning section per request: after it ends the budget is spent.
                self.finished = True
                break
            else:
                self.num_thinking_tokens += 1
        self.num_scanned = len(output)


def _last_index(token_ids: list[int], token_id: int) -> int:
    for i in range(len(token_ids) - 1, -1, -1):
        if token_ids[i] == token_id:
            return i
    return -1


class ThinkingBudgetLogitsProcessor(LogitsProcessor):
    """After reasoning-start plus `thinking_token_budget` tokens, force reasoning-end.

    Inert unless the config names both reasoning tokens. A prompt that ends inside a reasoning
    section (a chat template that opens it) counts the prompt tokens after the start token.
    """

    def __init__(self, config: LogitsProcessorConfig, device: torch.device) -> None:
        super().__init__(config, device)
        self._start_id = config.reasoning_start_token_id
        self._end_id = config.reasoning_end_token_id
        self._states: dict[int, _ThinkingState] = {}
        self._forced: list[int] = []
        self._forced_rows = torch.zeros(0, dtype=torch.long, device=device)

    @property
    def enabled(self) -> bool:
        return self._start_id is not None and self._end_id is not None

    def is_argmax_invariant(self) -> bool:
        return False

    def validate_params(self, params: SamplingParams) -> None:
        if params.thinking_token_budget is not None and not self.enabled:
            raise ValueError(
                "thinking_token_budget needs a model with reasoning start and end tokens; "
                "this model declares none"
            )

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        if self._start_id is None or self._end_id is None:
            return
        process_dict_updates(self._states, batch_update, self._new_state)
        for index in list(self._states):
            state = self._states[index]
            state.advance(self._start_id, self._end_id)
            if state.finished:
                del self._states[index]
        forced = sorted(i for i, s in self._states.items() if s.must_end)
        if forced != self._forced:
            self._forced = forced
            self._forced_rows = torch.tensor(forced, dtype=torch.long, device=self.device)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        if not self._forced or self._end_id is None:
            return logits
        # Every other token impossible, the end token a plain finite logit: greedy and random
        # sampling both pick it, and softmax stays well defined.
        logits.index_fill_(0, self._forced_rows, float("-inf"))
        logits[self._forced_rows, self._end_id] = 0.0
        return logits

    def _new_state(
        self, params: SamplingParams, prompt: list[int], output: list[int]
    ) -> _ThinkingState | None:
        budget = params.thinking_token_budget
        if budget is None or self._start_id is None or self._end_id is None:
            return None
        state = _ThinkingState(budget=budget, output_token_ids=output)
        last_start = _last_index(prompt, self._start_id)
        if last_start > _last_index(prompt, self._end_id):
            state.thinking = True
            state.num_thinking_tokens = len(prompt) - last_start - 1
        # Outputs already present (a resumed request, or a decode engine receiving the
        # prefill engine's first token) are read on the next advance().
        return state
