"""Every output type of an engine, in the order a token meets them.

EngineCoreOutput: what one step added to one request (token ids, logprobs, how it ended). It is
what the engine core returns, what `AsyncEngine.generate_tokens` streams, and what an engine
replica sends the router: token ids only, never text.

RequestOutput / CompletionOutput (vLLM's shapes): the same request with its text, built by
the OutputProcessor (engine/output_processor.py) wherever the caller wants text - `LLM.generate`,
`AsyncEngine.generate`, and the router, which detokenizes once for both legs of a request.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from engine.request import FinishReason, RequestTiming

if TYPE_CHECKING:
    from engine.stats import EngineStats

# Per sampled token: (token ids: the sampled one then the top-n, their logprobs, the rank of
# the sampled token).
TokenLogprobs = tuple[list[int], list[float], int]


@dataclass(slots=True)
class EngineCoreOutput:
    """Per-request result of one step: new tokens, and how it ended if it did."""

    request_id: str
    new_token_ids: list[int]
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    kv_transfer_params: dict[str, Any] | None = None
    num_cached_tokens: int = 0
    error: str | None = None
    new_logprobs: list[TokenLogprobs] | None = None
    timing: RequestTiming | None = None  # on the last output only

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class EngineCoreOutputs:
    """What one step of an engine gives back: each request's output, and the engine's
    statistics as the step left it (engine/stats.py)."""

    outputs: list[EngineCoreOutput]
    stats: EngineStats


def merge_outputs(earlier: EngineCoreOutput, later: EngineCoreOutput) -> EngineCoreOutput:
    """One output for two consecutive ones of a request: tokens (and logprobs) together,
    the later one's ending."""
    merged = dataclasses.replace(later, new_token_ids=earlier.new_token_ids + later.new_token_ids)
    if earlier.new_logprobs or later.new_logprobs:
        merged.new_logprobs = (earlier.new_logprobs or []) + (later.new_logprobs or [])
    return merged


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: int | str | None = None
    logprobs: list[TokenLogprobs] | None = None
    # What this update added (streaming).
    delta_text: str = ""
    new_token_ids: list[int] = field(default_factory=list)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def new_logprobs(self) -> list[TokenLogprobs] | None:
        """The logprobs of `new_token_ids` (one entry per token), when logprobs were asked."""
        if self.logprobs is None:
            return None
        return self.logprobs[len(self.logprobs) - len(self.new_token_ids) :]


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    kv_transfer_params: dict[str, Any] | None = None
    num_cached_tokens: int = 0
    error: str | None = None
    timing: RequestTiming | None = None  # the engine's timestamps, on the last output
