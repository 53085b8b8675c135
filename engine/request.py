"""What the scheduler knows of a request: inputs, sampling parameters, progress, status."""

from __future__ import annotations

import enum
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from engine.stop_strings import check_stop_strings

if TYPE_CHECKING:
    from engine.pin_request import PinRequest


class RequestStatus(enum.IntEnum):
    """Lifecycle of a request. Every status after PREEMPTED is a finished one."""

    WAITING = enum.auto()
    WAITING_FOR_REMOTE_KVS = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH_CAPPED = enum.auto()
    FINISHED_ABORTED = enum.auto()
    FINISHED_IGNORED = enum.auto()
    FINISHED_ERROR = enum.auto()

    @property
    def is_finished(self) -> bool:
        return self > RequestStatus.PREEMPTED


class FinishReason(enum.StrEnum):
    """Why a request ended, in the words of the OpenAI API."""

    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"
    ERROR = "error"


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: FinishReason.STOP,
    RequestStatus.FINISHED_LENGTH_CAPPED: FinishReason.LENGTH,
    RequestStatus.FINISHED_ABORTED: FinishReason.ABORT,
    RequestStatus.FINISHED_IGNORED: FinishReason.LENGTH,
    RequestStatus.FINISHED_ERROR: FinishReason.ERROR,
}


def finish_reason_of(status: RequestStatus) -> FinishReason | None:
    return _FINISH_REASONS.get(status)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    """A real, finite number (NaN passes every `<` check as False, so reject it here)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    return math.isfinite(value)


@dataclass(frozen=True)
class StructuredOutputsParams:
    """Constrain the output to a language: exactly one of a JSON schema, any JSON object, a
    regular expression, one of several strings, or a grammar (xgrammar's EBNF). vLLM's shape;
    `grammar` is what the OpenAI API's `response_format` and `guided_*` fields become."""

    json: str | None = None  # a JSON schema, as JSON text
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.choice, str):  # tuple("ab") would be the choices "a" and "b"
            raise ValueError("structured outputs' choice must be a list of strings, not a string")
        if self.choice is not None:
            object.__setattr__(self, "choice", tuple(self.choice))
        kinds = [k for k in ("json", "regex", "choice", "grammar") if getattr(self, k) is not None]
        kinds += ["json_object"] if self.json_object else []
        if len(kinds) != 1:
            raise ValueError(
                "structured outputs take exactly one of json, json_object, regex, choice, "
                f"grammar; got {kinds or 'none'}"
            )
        for name in ("json", "regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"structured outputs' {name} must be a non-empty string")
        if self.choice is not None and (
            not self.choice or not all(isinstance(c, str) and c for c in self.choice)
        ):
            raise ValueError("structured outputs' choice must be a list of non-empty strings")
        # The grammar is built here (without a tokenizer, a few ms): a bad schema, regex or
        # grammar is refused when the request is made, not when an engine first samples it.
        from engine.sample.structured import check_grammar

        check_grammar(self)

    @property
    def kind(self) -> str:
        """Which constraint this is (json, json_object, regex, choice or grammar)."""
        if self.json_object:
            return "json_object"
        return next(k for k in ("json", "regex", "choice", "grammar") if getattr(self, k))


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens and when to stop. Validated on construction (ValueError)."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None
    stop_token_ids: Sequence[int] = ()
    ignore_eos: bool = False
    min_tokens: int = 0
    stop: Sequence[str] = ()
    include_stop_str_in_output: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: Mapping[int, float] | None = None
    logprobs: int | None = None
    skip_special_tokens: bool = True
    # Tokens allowed between the model's reasoning-start and reasoning-end tokens; past it the
    # reasoning-end token is forced (needs a model that declares both tokens).
    thinking_token_budget: int | None = None
    # Free-form arguments for custom logits processors.
    extra_args: Mapping[str, Any] = field(default_factory=dict)
    # The first output tokens, fixed in advance (sampling still draws, so the RNG positions of
    # what follows are unchanged). A disaggregated decode continues the token that the prefill
    # engine already sent to the client, even if its own logits would pick another.
    forced_output_token_ids: Sequence[int] = ()
    # Output constrained to a JSON schema, regex, choice or grammar (a logits processor).
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        self._check_lengths()
        self._check_probability_knobs()
        self._check_penalties()
        # Normalise sequences so a params object is hashable-ish and never aliased.
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "forced_output_token_ids", tuple(self.forced_output_token_ids))

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    def _check_lengths(self) -> None:
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not _is_int(self.min_tokens) or not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(
                f"min_tokens must be an integer in [0, max_tokens={self.max_tokens}], "
                f"got {self.min_tokens!r}"
            )
        if self.seed is not None and not _is_int(self.seed):
            raise ValueError(f"seed must be an integer or None, got {self.seed!r}")
        for token_id in self.stop_token_ids:
            if not _is_int(token_id) or token_id < 0:
                raise ValueError(f"stop_token_ids must be non-negative integers, got {token_id!r}")
        check_stop_strings(self.stop)
        forced = self.forced_output_token_ids
        if len(forced) > self.max_tokens or any(not _is_int(t) or t < 0 for t in forced):
            raise ValueError(
                "forced_output_token_ids must be at most max_tokens token ids >= 0, "
                f"got {list(forced)!r}"
            )
        if self.logprobs is not None and (not _is_int(self.logprobs) or self.logprobs < 0):
            raise ValueError(f"logprobs must be an integer >= 0 or None, got {self.logprobs!r}")
        budget = self.thinking_token_budget
        if budget is not None and (not _is_int(budget) or budget < 0):
            raise ValueError(f"thinking_token_budget must be an integer >= 0, got {budget!r}")
        structured = self.structured_outputs
        if structured is not None and not isinstance(structured, StructuredOutputsParams):
            raise ValueError("structured_outputs must be a StructuredOutputsParams")
        if structured is not None and self.min_tokens > 0:
            # A grammar that completes early allows only eos, which min_tokens forbids: the row
            # would have no token left. Refused rather than bent either way.
            raise ValueError(
                "min_tokens does not combine with structured outputs (the grammar decides "
                "where the output ends)"
            )

    def _check_probability_knobs(self) -> None:
        if not _is_number(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature!r}")
        if not _is_number(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not _is_int(self.top_k) or self.top_k == 0 or self.top_k < -1:
            raise ValueError(
                f"top_k must be -1 (disabled) or a positive integer, got {self.top_k!r}"
            )
        if not _is_number(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p!r}")

    def _check_penalties(self) -> None:
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_number(value) or not -2.0 <= value <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {value!r}")
        if not _is_number(self.repetition_penalty) or self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty!r}")
        for token_id, bias in (self.logit_bias or {}).items():
            if not _is_int(token_id) or token_id < 0:
                raise ValueError(f"logit_bias keys must be token ids >= 0, got {token_id!r}")
            if not _is_number(bias) or not -100.0 <= bias <= 100.0:
                raise ValueError(f"logit_bias values must be in [-100, 100], got {bias!r}")


BlockHasher = Callable[["Request"], None]

# Token ids are packed as int32 for hashing and on the wire; every vocabulary fits.
MAX_TOKEN_ID = 2**31


@dataclass(slots=True)
class RequestTiming:
    """Wall-clock moments (time.time()) of a request's life in one engine. Traces are built
    from them after the fact, so they stay exact though the engine loop runs in its own thread.
    """

    arrival: float
    first_scheduled: float | None = None
    first_token: float | None = None
    finished: float | None = None
    kv_load_start: float | None = None
    kv_load_end: float | None = None
    kv_load_blocks: int = 0
    # Runs of blocks consecutive on both sides: what NIXL posts as descriptors (gRPC streams
    # the same blocks one message each). Fewer means larger, cheaper transfers.
    kv_load_descriptors: int = 0
    kv_load_outcome: str | None = None  # "ok", "recovered" (recomputed) or "failed"
    kv_load_problem: str | None = None  # why not "ok" (KVConnectorBase.take_load_problems)
    kv_load_tier: str | None = None  # loaded from this engine's own KV tier ("cpu", "disk")
    # The whole prompt's KV came with its first token, taken as sampled (nothing recomputed).
    kv_load_adopted_first_token: bool = False
    pin_ttl_s: float | None = None  # its KV was pinned this long for its session's next turn
    pin_refused: bool = False  # a pin was asked or predicted, and over the engine's budget


class Request:
    """One generation request as the scheduler sees it.

    `num_computed_tokens` counts positions whose KV is written (or scheduled to be written this
    step); `num_tokens` counts prompt + output tokens. The scheduler's only goal is to make the
    former catch up with the latter.
    """

    __slots__ = (
        "_block_hasher",
        "_hash_block_size",
        "_next_hash_at",
        "all_token_ids",
        "arrival_time",
        "block_hashes",
        "cache_salt",
        "eos_token_id",
        "error",
        "kv_transfer_params",
        "max_num_tokens",
        "max_tokens",
        "num_cached_tokens",
        "num_computed_tokens",
        "num_external_computed_tokens",
        "num_output_placeholders",
        "num_preemptions",
        "num_prompt_tokens",
        "output_token_ids",
        "pin",
        "priority",
        "prompt_token_ids",
        "request_id",
        "sampling_params",
        "spec_token_ids",
        "status",
        "stop_reason",
        "stop_token_set",
        "timing",
    )

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        sampling_params: SamplingParams,
        eos_token_id: int | None = None,
        arrival_time: float | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
        kv_transfer_params: dict[str, Any] | None = None,
        output_token_ids: Sequence[int] = (),
        pin: PinRequest | None = None,
    ) -> None:
        """`output_token_ids`: tokens this request already produced on another engine (one
        that failed mid-request): computed here with the prompt, never sent again, and the
        request goes on after them exactly as it would have there (sampling positions,
        penalties, min/max tokens count them). `pin`: keep its KV after it finishes, for its
        session's next turn (engine/core/pins.py)."""
        _check_request_inputs(request_id, prompt_token_ids, sampling_params, priority, cache_salt)
        _check_resumed_outputs(request_id, output_token_ids, sampling_params)
        self.request_id = request_id
        self.prompt_token_ids: list[int] = list(prompt_token_ids)
        self.num_prompt_tokens = len(self.prompt_token_ids)
        self.sampling_params = sampling_params
        self.max_tokens = sampling_params.max_tokens
        self.eos_token_id = eos_token_id
        # For the per-token stop check (engine/core/stop.py): the tokens that may stop it
        # (min_tokens and ignore_eos are looked at only for these), and its length once
        # max_tokens outputs exist.
        ids = sampling_params.stop_token_ids
        self.stop_token_set = frozenset(ids if eos_token_id is None else (*ids, eos_token_id))
        self.max_num_tokens = self.num_prompt_tokens + self.max_tokens
        self.arrival_time = time.time() if arrival_time is None else float(arrival_time)
        self.priority = priority
        self.cache_salt = cache_salt
        self.kv_transfer_params = kv_transfer_params
        self.pin = pin
        # Plain attributes, not properties: the scheduler reads them on every step of every
        # request. Only append_output_token_ids changes them.
        self.all_token_ids: list[int] = [*self.prompt_token_ids, *output_token_ids]
        self.output_token_ids: list[int] = list(output_token_ids)
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0
        self.num_external_computed_tokens = 0
        self.num_cached_tokens: int | None = None  # prefix hits at first scheduling
        self.num_preemptions = 0
        self.timing = RequestTiming(self.arrival_time)
        self.stop_reason: int | str | None = None
        self.error: str | None = None
        # Drafts for the tokens after all_token_ids (speculative decoding), verified next step.
        self.spec_token_ids: list[int] = []
        # Async scheduling: samples of steps scheduled but not yet back (each step that reaches
        # the end of the known tokens owes one). The next schedule() counts them as tokens.
        self.num_output_placeholders = 0
        self.block_hashes: list[bytes] = []
        self._block_hasher: BlockHasher | None = None
        self._hash_block_size = 0
        self._next_hash_at = 0  # num_tokens at which the next block becomes full

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status > RequestStatus.PREEMPTED

    def set_block_hasher(self, hasher: BlockHasher, block_size: int) -> None:
        """Install the hasher that keeps `block_hashes` in step with the tokens."""
        self._block_hasher = hasher
        self._hash_block_size = block_size
        hasher(self)
        self._next_hash_at = (len(self.block_hashes) + 1) * block_size

    def append_output_token_ids(self, token_id: int) -> int:
        """Append one output token; returns num_tokens."""
        tokens = self.all_token_ids
        tokens.append(token_id)
        self.output_token_ids.append(token_id)
        num_tokens = len(tokens)
        # Hash only when a block fills up: a plain comparison on the decode hot path.
        if num_tokens >= self._next_hash_at and self._block_hasher is not None:
            self._block_hasher(self)
            self._next_hash_at = (len(self.block_hashes) + 1) * self._hash_block_size
        return num_tokens

    def sort_key(self) -> tuple[int, float]:
        """Priority order: lower `priority` first, then earlier arrival."""
        return (self.priority, self.arrival_time)

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, status={self.status.name}, "
            f"computed={self.num_computed_tokens}/{self.num_tokens})"
        )


def _check_resumed_outputs(
    request_id: str, output_token_ids: Sequence[int], params: SamplingParams
) -> None:
    if not output_token_ids:
        return
    if any(not _is_int(t) or not 0 <= t < MAX_TOKEN_ID for t in output_token_ids):
        raise ValueError(f"request {request_id!r}: output token ids must be integers in [0, 2**31)")
    if len(output_token_ids) >= params.max_tokens:
        raise ValueError(
            f"request {request_id!r}: {len(output_token_ids)} output tokens already reach "
            f"max_tokens={params.max_tokens}; nothing is left to generate"
        )


def _check_request_inputs(
    request_id: object,
    prompt_token_ids: Sequence[int],
    sampling_params: object,
    priority: object,
    cache_salt: object,
) -> None:
    if not isinstance(request_id, str) or not request_id:
        raise ValueError(f"request_id must be a non-empty string, got {request_id!r}")
    if len(prompt_token_ids) == 0:
        raise ValueError(f"request {request_id!r}: the prompt is empty")
    for token_id in prompt_token_ids:
        if not _is_int(token_id) or not 0 <= token_id < MAX_TOKEN_ID:
            raise ValueError(
                f"request {request_id!r}: prompt token ids must be integers in "
                f"[0, 2**31), got {token_id!r}"
            )
    if not isinstance(sampling_params, SamplingParams):
        raise ValueError(
            f"request {request_id!r}: sampling_params must be SamplingParams, "
            f"got {type(sampling_params).__name__}"
        )
    if not _is_int(priority):
        raise ValueError(f"request {request_id!r}: priority must be an integer, got {priority!r}")
    if cache_salt is not None and (not isinstance(cache_salt, str) or not cache_salt):
        raise ValueError(f"request {request_id!r}: cache_salt must be a non-empty string")
