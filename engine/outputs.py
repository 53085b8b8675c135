"""What callers get back: RequestOutput with one CompletionOutput (vLLM's shapes)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from engine.core.sched_output import TokenLogprobs
from engine.request import RequestTiming


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
