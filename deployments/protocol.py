"""What travels through the app, and the gRPC (pdserve.v1) forms of the client side.

Client <-> router: a `GenerateInput` is a validated client request before tokenization (every
edge - gRPC, OpenAI HTTP, the CLI - builds one and gets `ValueError` with a message for bad
input); `ResponseChunk`s go back. Router <-> engine replica: an `EngineRequest` (token ids)
goes out, `engine.outputs.EngineCoreOutput`s (token ids) come back.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from engine.outputs import TokenLogprobs
from engine.pin_request import PinRequest
from engine.request import SamplingParams, StructuredOutputsParams
from protos.pdserve.v1 import generate_pb2 as pb

# Routes a request can take through the router (GenerateResponse.route).
ROUTE_DISAGGREGATED = "disaggregated"  # prefill replica, KV transfer, decode replica
ROUTE_DECODE_ONLY = "decode_only"  # short prompt: the decode replica computes it
ROUTE_FALLBACK = "fallback"  # the prefill leg failed: the decode replica computed it
ROUTE_COLOCATED = "colocated"  # one engine does both
ROUTE_CACHED = "decode_cached"  # the decode replica held all but a short tail: it computed it


@dataclass(frozen=True)
class RequestLimits:
    """Bounds on a request's size, checked before any work whose cost grows with it (each an
    AppConfig field of the same name). Refused, never cut: the message names the limit."""

    max_body_bytes: int = 16 << 20  # HTTP bodies (413)
    max_prompt_chars: int = 1_000_000  # text prompt, or a conversation's contents together
    max_stop_strings: int = 64
    max_stop_chars: int = 1024  # each stop string
    max_request_id_chars: int = 256

    def __post_init__(self) -> None:
        for name, value in vars(self).items():
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")

    def check_prompt_chars(self, num_chars: int) -> None:
        if num_chars > self.max_prompt_chars:
            raise ValueError(
                f"prompt has {num_chars} characters; the limit is {self.max_prompt_chars} "
                "(max_prompt_chars)"
            )

    def check_chat_chars(self, messages: Sequence[Mapping[str, Any]]) -> None:
        """A conversation counts its contents together."""
        self.check_prompt_chars(chat_chars(messages))

    def check(self, request: GenerateInput) -> None:
        """ValueError for a request over a limit (the prompt as given: text, or chat turns)."""
        prompt = request.prompt
        if isinstance(prompt, str):
            self.check_prompt_chars(len(prompt))
        elif isinstance(prompt, ChatPrompt):
            self.check_chat_chars(prompt.messages)
        stops = request.params.stop
        if len(stops) > self.max_stop_strings:
            raise ValueError(
                f"{len(stops)} stop strings; the limit is {self.max_stop_strings} "
                "(max_stop_strings)"
            )
        longest = max((len(s) for s in stops), default=0)
        if longest > self.max_stop_chars:
            raise ValueError(
                f"a stop string has {longest} characters; the limit is {self.max_stop_chars} "
                "(max_stop_chars)"
            )
        if len(request.request_id) > self.max_request_id_chars:
            raise ValueError(
                f"request id has {len(request.request_id)} characters; the limit is "
                f"{self.max_request_id_chars} (max_request_id_chars)"
            )


def chat_chars(messages: Sequence[Mapping[str, Any]]) -> int:
    """A conversation's size: its messages' contents together."""
    return sum(len(str(m.get("content") or "")) for m in messages)


@dataclass
class ChatPrompt:
    """A conversation the router renders with the model's chat template."""

    messages: list[dict[str, str]]


@dataclass
class GenerateInput:
    prompt: str | list[int] | ChatPrompt
    params: SamplingParams
    request_id: str = ""
    priority: int = 0
    cache_salt: str | None = None
    timeout_s: float | None = None  # None: the router's default deadline
    pin: PinRequest | None = None  # keep the turn's KV for its session's next turn
    # A chat that set no max_tokens may answer with as many tokens as the context leaves after
    # the prompt (OpenAI's chat completions); the router sets them once it has tokenized.
    fill_context: bool = False


@dataclass
class EngineRequest:
    """One leg of a request, as an engine replica gets it: token ids, no stop strings."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    priority: int = 0
    cache_salt: str | None = None
    kv_transfer_params: dict[str, Any] | None = None
    trace_context: dict[str, str] | None = None  # W3C carrier: the router's span
    # The replica the router chose by its cache (cache-aware disaggregation): the leg's
    # request router sends the request there alone.
    replica_hint: str = ""
    # Tokens the request already generated on an engine that failed (request migration):
    # the engine computes them with the prompt and goes on after them.
    output_token_ids: list[int] = field(default_factory=list)
    pin: PinRequest | None = None  # the decode (or colocated) leg's: keep its KV after it
    # The cluster index's holdings for this prompt (kv_scoring.Holding by replica), from the
    # Router's survey: the leg's request router ranks by them without a second index call.
    # Advice for the Router's own process: never sent to an engine (__getstate__).
    routing_holdings: Mapping[str, Any] | None = None

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "routing_holdings": None}


@dataclass(frozen=True)
class ReplicaProbe:
    """A call meant for one engine replica (a health probe): the request routers send it to
    `replica_hint` alone."""

    replica_hint: str


@dataclass
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    pinned_ttl_s: float = 0.0  # the engine pinned the KV this long for the session's next turn
    pin_refused: bool = False  # a pin was asked or predicted, over the engine's budget


@dataclass
class ResponseChunk:
    request_id: str
    token_ids: list[int]
    text: str
    finish_reason: str | None = None
    logprobs: list[TokenLogprobs] | None = None
    prompt_token_ids: list[int] | None = None  # first chunk only
    usage: Usage | None = None
    ttft_s: float = 0.0
    e2e_s: float = 0.0
    route: str = ""
    migrations: int = 0  # last chunk only: times the generating leg moved to another engine


# Optional proto fields copied as they are when set (the names match SamplingParams).
_OPTIONAL_FIELDS = (
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "logprobs",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "skip_special_tokens",
)


def sampling_params_from_proto(message: pb.SamplingParams) -> SamplingParams:
    kwargs: dict[str, Any] = {
        name: getattr(message, name) for name in _OPTIONAL_FIELDS if message.HasField(name)
    }
    kwargs.update(
        stop=list(message.stop),
        stop_token_ids=list(message.stop_token_ids),
        ignore_eos=message.ignore_eos,
        min_tokens=message.min_tokens,
        include_stop_str_in_output=message.include_stop_str_in_output,
    )
    if message.logit_bias:
        kwargs["logit_bias"] = dict(message.logit_bias)
    if message.HasField("structured_outputs"):
        kwargs["structured_outputs"] = _structured_from_proto(message.structured_outputs)
    return SamplingParams(**kwargs)


def _structured_from_proto(message: pb.StructuredOutputs) -> StructuredOutputsParams:
    kind = message.WhichOneof("kind")
    if kind is None:
        raise ValueError("structured_outputs is set but names no kind (json_schema, regex, ...)")
    if kind == "json_schema":
        return StructuredOutputsParams(json=message.json_schema)
    if kind == "json_object":
        return StructuredOutputsParams(json_object=message.json_object)
    if kind == "choice":
        return StructuredOutputsParams(choice=tuple(message.choice.choices))
    return StructuredOutputsParams(**{kind: getattr(message, kind)})


def input_from_proto(request: pb.GenerateRequest) -> GenerateInput:
    """Validate a GenerateRequest (ValueError says what is wrong)."""
    which = request.WhichOneof("prompt")
    if which is None:
        raise ValueError("the request has no prompt: set `text`, `token_ids` or `chat`")
    prompt: str | list[int] | ChatPrompt
    if which == "text":
        prompt = request.text
    elif which == "chat":
        messages = [{"role": m.role, "content": m.content} for m in request.chat.messages]
        prompt = ChatPrompt(messages)
    else:
        prompt = list(request.token_ids.ids)
    if request.timeout_s < 0 or not math.isfinite(request.timeout_s):
        raise ValueError(f"timeout_s must be >= 0, got {request.timeout_s}")
    pin = None
    if request.HasField("pin"):
        ttl = request.pin.ttl_s
        pin = PinRequest(request.pin.session, ttl or None, request.pin.after_tool)
    return GenerateInput(
        prompt=prompt,
        params=sampling_params_from_proto(request.sampling_params),
        request_id=request.request_id,
        priority=request.priority,
        cache_salt=request.cache_salt or None,
        timeout_s=request.timeout_s or None,
        pin=pin,
        fill_context=which == "chat" and not request.sampling_params.HasField("max_tokens"),
    )


def chunk_to_proto(chunk: ResponseChunk) -> pb.GenerateResponse:
    response = pb.GenerateResponse(
        request_id=chunk.request_id,
        token_ids=chunk.token_ids,
        text=chunk.text,
        finish_reason=chunk.finish_reason or "",
        route=chunk.route,
        migrations=chunk.migrations,
    )
    if chunk.prompt_token_ids is not None:
        response.prompt_token_ids.extend(chunk.prompt_token_ids)
    if chunk.usage is not None:
        response.usage.CopyFrom(
            pb.Usage(
                prompt_tokens=chunk.usage.prompt_tokens,
                completion_tokens=chunk.usage.completion_tokens,
                cached_tokens=chunk.usage.cached_tokens,
                pinned_ttl_s=chunk.usage.pinned_ttl_s,
                pin_refused=chunk.usage.pin_refused,
            )
        )
    response.timing.CopyFrom(pb.Timing(ttft_s=chunk.ttft_s, e2e_s=chunk.e2e_s))
    for token_ids, logprobs, rank in chunk.logprobs or ():
        response.logprobs.append(
            pb.TokenLogprobs(token_ids=token_ids, logprobs=logprobs, sampled_rank=rank)
        )
    return response
