"""Built-in processors: min_tokens, logit_bias (change the argmax) and min_p (does not)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from engine.request import SamplingParams
from engine.sample.logits_processor.interface import (
    BatchUpdate,
    LogitsProcessor,
    LogitsProcessorConfig,
)
from engine.sample.logits_processor.state import process_dict_updates


def _long_tensor(values: Sequence[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.long, device=device)


class MinTokensLogitsProcessor(LogitsProcessor):
    """Forbid stop tokens (eos unless ignore_eos, and stop_token_ids) before min_tokens."""

    def __init__(self, config: LogitsProcessorConfig, device: torch.device) -> None:
        super().__init__(config, device)
        # row -> (min_tokens, live output list, token ids to forbid)
        self._rows: dict[int, tuple[int, list[int], tuple[int, ...]]] = {}
        self._mask_index = (_long_tensor([], device), _long_tensor([], device))
        self._neg_inf = torch.tensor(float("-inf"), dtype=torch.float32, device=device)

    def is_argmax_invariant(self) -> bool:
        return False

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        changed = process_dict_updates(self._rows, batch_update, self._new_state)
        # The output lists are live: a row is released as soon as it has enough tokens.
        satisfied = [i for i, (n, out, _) in self._rows.items() if len(out) >= n]
        for index in satisfied:
            del self._rows[index]
        if changed or satisfied:
            self._rebuild_index()

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        if self._rows:
            logits.index_put_(self._mask_index, self._neg_inf)
        return logits

    def _new_state(
        self, params: SamplingParams, _prompt: list[int], output: list[int]
    ) -> tuple[int, list[int], tuple[int, ...]] | None:
        if params.min_tokens <= len(output):
            return None
        stop_ids = set(params.stop_token_ids)
        if self.config.eos_token_id is not None and not params.ignore_eos:
            stop_ids.add(self.config.eos_token_id)
        # Ids past the vocabulary can never be sampled: nothing to forbid there.
        stop_ids = {t for t in stop_ids if t < self.config.vocab_size}
        if not stop_ids:
            return None
        return params.min_tokens, output, tuple(sorted(stop_ids))

    def _rebuild_index(self) -> None:
        rows: list[int] = []
        cols: list[int] = []
        for index, (_, _, stop_ids) in self._rows.items():
            rows.extend([index] * len(stop_ids))
            cols.extend(stop_ids)
        self._mask_index = (_long_tensor(rows, self.device), _long_tensor(cols, self.device))


class LogitBiasLogitsProcessor(LogitsProcessor):
    """Add `logit_bias[token]` to that token's logit, per request."""

    def __init__(self, config: LogitsProcessorConfig, device: torch.device) -> None:
        super().__init__(config, device)
        self._biases: dict[int, Mapping[int, float]] = {}
        self._index = (_long_tensor([], device), _long_tensor([], device))
        self._values = torch.zeros(0, dtype=torch.float32, device=device)

    def is_argmax_invariant(self) -> bool:
        return False

    def validate_params(self, params: SamplingParams) -> None:
        vocab_size = self.config.vocab_size
        for token_id in params.logit_bias or {}:
            if token_id >= vocab_size:
                raise ValueError(
                    f"logit_bias token id {token_id} is out of range for vocab size {vocab_size}"
                )

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        if batch_update is not None:
            # Check every new request before touching any state: a rejected step must not
            # leave the rows half updated.
            for _, params, _, _ in batch_update.added:
                self.validate_params(params)
        if process_dict_updates(self._biases, batch_update, self._new_state):
            self._rebuild()

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        if self._biases:
            logits.index_put_(self._index, self._values, accumulate=True)
        return logits

    @staticmethod
    def _new_state(
        params: SamplingParams, _prompt: list[int], _output: list[int]
    ) -> Mapping[int, float] | None:
        return dict(params.logit_bias) if params.logit_bias else None

    def _rebuild(self) -> None:
        rows: list[int] = []
        cols: list[int] = []
        values: list[float] = []
        for index, bias in self._biases.items():
            rows.extend([index] * len(bias))
            cols.extend(bias.keys())
            values.extend(bias.values())
        self._index = (_long_tensor(rows, self.device), _long_tensor(cols, self.device))
        self._values = torch.tensor(values, dtype=torch.float32, device=self.device)


class ForcedOutputLogitsProcessor(LogitsProcessor):
    """Make output token i be `forced_output_token_ids[i]`: every other logit of the row is -inf
    (the draw still happens, so later draws keep their counter positions)."""

    def __init__(self, config: LogitsProcessorConfig, device: torch.device) -> None:
        super().__init__(config, device)
        self._rows: dict[int, tuple[tuple[int, ...], list[int]]] = {}  # forced, live output

    def is_argmax_invariant(self) -> bool:
        return False

    def validate_params(self, params: SamplingParams) -> None:
        bad = [t for t in params.forced_output_token_ids if t >= self.config.vocab_size]
        if bad:
            raise ValueError(
                f"forced_output_token_ids {bad} are out of range for vocab size "
                f"{self.config.vocab_size}"
            )

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        process_dict_updates(self._rows, batch_update, self._new_state)
        done = [i for i, (forced, out) in self._rows.items() if len(out) >= len(forced)]
        for index in done:
            del self._rows[index]

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        if not self._rows:
            return logits
        rows = _long_tensor(list(self._rows), self.device)
        tokens = _long_tensor([f[len(out)] for f, out in self._rows.values()], self.device)
        logits[rows] = float("-inf")
        logits[rows, tokens] = 0.0  # finite even if an earlier processor masked it
        return logits

    @staticmethod
    def _new_state(
        params: SamplingParams, _prompt: list[int], output: list[int]
    ) -> tuple[tuple[int, ...], list[int]] | None:
        forced = tuple(params.forced_output_token_ids)
        return (forced, output) if len(output) < len(forced) else None


class MinPLogitsProcessor(LogitsProcessor):
    """Drop tokens whose probability is below `min_p` times the row's top probability.

    Argmax-invariant (the top token always survives), so the sampler applies it after
    temperature and only on the random path.
    """

    def __init__(self, config: LogitsProcessorConfig, device: torch.device) -> None:
        super().__init__(config, device)
        self._min_p: dict[int, float] = {}
        self._rows = _long_tensor([], device)
        self._values = torch.zeros((0, 1), dtype=torch.float32, device=device)

    def is_argmax_invariant(self) -> bool:
        return True

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        if process_dict_updates(self._min_p, batch_update, self._new_state):
            rows = sorted(self._min_p)
            self._rows = _long_tensor(rows, self.device)
            values = [[self._min_p[i]] for i in rows]
            self._values = torch.tensor(values, dtype=torch.float32, device=self.device)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        if not self._min_p:
            return logits
        # Only the rows that use min_p pay for a softmax.
        rows = logits.index_select(0, self._rows)
        probs = torch.softmax(rows, dim=-1)
        threshold = probs.amax(dim=-1, keepdim=True) * self._values
        rows.masked_fill_(probs < threshold, float("-inf"))
        logits.index_copy_(0, self._rows, rows)
        return logits

    @staticmethod
    def _new_state(params: SamplingParams, _prompt: list[int], _output: list[int]) -> float | None:
        return params.min_p if params.min_p > 0.0 else None
