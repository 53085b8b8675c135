"""OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions, /v1/models) over the router.

Served through Ray Serve's HTTP proxy by the Router's FastAPI ingress. Bad input (malformed
JSON, wrong types, out-of-range sampling values, an unknown model, a prompt too long) is an HTTP
400 with an OpenAI-style error body; a request past its deadline is a 504.

No field is silently ignored. A field is honoured, or refused with a 400 that names it: unknown
fields (in a message too), `tools` and the other function-calling fields (openai_tools.py: "not
supported by this model's chat template"), `n`/`best_of` other than 1, `echo`, `suffix`,
`top_logprobs` or `logprobs` above 20, `stream_options` without `stream`, `store: true`,
`modalities` other than text, `audio`, `prediction`, `reasoning_effort`, `web_search_options`, a
`service_tier` other than auto/default. Accepted as the metadata they are, with no effect on the
output: `user` and `safety_identifier` (end-user ids for the caller's own monitoring),
`metadata`, `store: false` (nothing is stored), `prompt_cache_key` (a cache-routing hint; the
prefix cache here needs none), and `response_format.json_schema`'s `name`, `description` and
`strict` (the schema is always enforced). A message's `name` goes to the chat template.
Structured outputs: `response_format` (`text`, `json_object`, `json_schema`) and vLLM's
`guided_json`, `guided_regex`, `guided_choice`, `guided_grammar` (xgrammar EBNF).
"""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import Callable
from contextlib import aclosing
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field
from starlette.exceptions import HTTPException as StarletteHTTPException

from deployments.errors import DeadlineExceeded, EngineFailure, public_message
from deployments.openai_format import ChatFormat, CompletionFormat, ResponseFormat, sse_events
from deployments.openai_tools import template_kwargs
from deployments.orchestrator import Orchestrator
from deployments.protocol import GenerateInput, chat_chars
from engine.request import SamplingParams, StructuredOutputsParams

logger = logging.getLogger(__name__)

_SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


class _StreamOptions(BaseModel):
    include_usage: bool = False


_MAX_LOGPROBS = 20  # OpenAI's cap on top_logprobs
_STRUCTURED_FIELDS = (
    "response_format",
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
)


class _SamplingFields(BaseModel):
    """Fields shared by both endpoints (OpenAI's, plus vLLM's extensions)."""

    model_config = ConfigDict(extra="forbid")  # an unknown field is a 400 that names it

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    n: int = 1
    stream: bool = False
    stream_options: _StreamOptions | None = None
    priority: int = 0
    cache_salt: str | None = None
    timeout_s: float | None = Field(default=None, gt=0)
    return_token_ids: bool = False
    # Structured outputs: OpenAI's response_format, or one of vLLM's guided_* fields.
    response_format: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: str | None = None
    # Accepted, no effect on the output (see the module docstring).
    user: str | None = None
    safety_identifier: str | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None
    prompt_cache_key: str | None = None
    # Refused unless harmless (see refuse_unsupported).
    service_tier: str | None = None

    def refuse_unsupported(self) -> None:
        """ValueError naming a field this server would otherwise have to ignore."""
        if self.n != 1:
            raise ValueError(f"n must be 1 (one completion per request), got {self.n}")
        if self.store:
            raise ValueError("store: true is not supported (nothing is stored)")
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options needs stream: true")
        if self.service_tier not in (None, "auto", "default"):
            raise ValueError(f"service_tier {self.service_tier!r} is not supported")
        if self.guided_decoding_backend not in (None, "auto", "xgrammar"):
            raise ValueError("guided_decoding_backend must be xgrammar (the only one here)")

    def structured_outputs(self) -> StructuredOutputsParams | None:
        given = {
            name: value for name in _STRUCTURED_FIELDS if (value := getattr(self, name)) is not None
        }
        fmt = given.get("response_format")
        if fmt is not None and fmt.get("type") == "text":
            del given["response_format"]  # plain text: no constraint
        if len(given) > 1:
            raise ValueError(f"give one structured output field, got {sorted(given)}")
        if not given:
            return None
        ((name, value),) = given.items()
        if name == "response_format":
            return _response_format(value)
        if name == "guided_json":
            return StructuredOutputsParams(json=_schema_text(value))
        if name == "guided_choice":
            return StructuredOutputsParams(choice=tuple(value))
        return StructuredOutputsParams(**{name.removeprefix("guided_"): value})

    def sampling_params(self, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
        self.refuse_unsupported()
        if logprobs is not None and logprobs > _MAX_LOGPROBS:
            raise ValueError(f"at most {_MAX_LOGPROBS} logprobs per token, got {logprobs}")
        kwargs: dict[str, Any] = {
            name: value
            for name in (
                "temperature",
                "top_p",
                "top_k",
                "min_p",
                "seed",
                "presence_penalty",
                "frequency_penalty",
                "repetition_penalty",
            )
            if (value := getattr(self, name)) is not None
        }
        if max_tokens is not None:
            kwargs["max_tokens"] = max_tokens
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or ())
        return SamplingParams(
            **kwargs,
            stop=stop,
            stop_token_ids=list(self.stop_token_ids or ()),
            ignore_eos=self.ignore_eos,
            min_tokens=self.min_tokens,
            logprobs=logprobs,
            logit_bias=_logit_bias(self.logit_bias),
            include_stop_str_in_output=self.include_stop_str_in_output,
            skip_special_tokens=self.skip_special_tokens,
            structured_outputs=self.structured_outputs(),
        )


class CompletionRequest(_SamplingFields):
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    def refuse_unsupported(self) -> None:
        super().refuse_unsupported()
        if self.echo:
            raise ValueError("echo is not supported")
        if self.suffix:
            raise ValueError("suffix is not supported (no fill-in-the-middle)")
        if self.best_of not in (None, 1):
            raise ValueError(f"best_of must be 1, got {self.best_of}")


class _ContentPart(BaseModel):
    type: str
    text: str = ""


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")

    role: str
    content: str | list[_ContentPart] | None = None  # None: an assistant turn of tool calls
    name: str | None = None
    # Function calling (openai_tools.py decides whether the template can take them).
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None

    def as_template_message(self) -> dict[str, Any]:
        message: dict[str, Any] = {"role": self.role, "content": self._text()}
        for name in ("name", "tool_calls", "tool_call_id"):
            if (value := getattr(self, name)) is not None:
                message[name] = value
        return message

    def tool_fields(self, index: int) -> list[str]:
        return [
            f"messages[{index}].{name}"
            for name in ("tool_calls", "tool_call_id")
            if getattr(self, name) is not None
        ]

    def _text(self) -> str:
        if self.content is None and self.tool_calls is None:
            raise ValueError(f"a {self.role} message needs content")
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        kinds = {part.type for part in self.content} - {"text"}
        if kinds:
            raise ValueError(f"only text content is supported, got {sorted(kinds)}")
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    # Function calling: see openai_tools.py (refused unless the chat template renders tools).
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    functions: list[dict[str, Any]] | None = None
    function_call: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    # Other modalities and features this server does not have: refused when set.
    modalities: list[str] | None = None
    audio: dict[str, Any] | None = None
    prediction: dict[str, Any] | None = None
    reasoning_effort: str | None = None
    web_search_options: dict[str, Any] | None = None

    def refuse_unsupported(self) -> None:
        super().refuse_unsupported()
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        if self.top_logprobs is not None and not 0 <= self.top_logprobs <= _MAX_LOGPROBS:
            raise ValueError(f"top_logprobs must be in [0, {_MAX_LOGPROBS}]")
        if self.modalities not in (None, ["text"]):
            raise ValueError(f"only text output is supported, got modalities={self.modalities}")
        for name in ("audio", "prediction", "reasoning_effort", "web_search_options"):
            if getattr(self, name) is not None:
                raise ValueError(f"{name} is not supported")


def build_openai_app(
    orchestrator: Callable[[], Orchestrator], model_name: str, max_model_len: int
) -> FastAPI:
    """The FastAPI app. `orchestrator` is looked up per request (the router owns it)."""
    app = FastAPI(title="pdserve", docs_url=None, redoc_url=None)

    def token_text(token_id: int) -> str:
        tokenizer = orchestrator().tokenizer
        return tokenizer.decode([token_id], skip_special_tokens=False) if tokenizer else ""

    @app.middleware("http")
    async def _limit_body(request: Request, call_next: Callable[[Request], Any]) -> Any:
        # Refused from the header, before the body is read or parsed (413, as OpenAI's shape).
        limit = orchestrator().config.limits.max_body_bytes
        length = request.headers.get("content-length", "")
        if length.isdigit() and int(length) > limit:
            message = f"request body is {length} bytes; the limit is {limit} (max_body_bytes)"
            orchestrator().telemetry.rejected(dict(request.headers), message)
            return _error(413, message)
        return await call_next(request)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        # FastAPI's own refusals (a body that is not UTF-8 or nests too deep to parse, an
        # unknown route, a wrong method) in OpenAI's error shape, not FastAPI's {"detail": ...}.
        if exc.status_code < 500:
            orchestrator().telemetry.rejected(dict(request.headers), str(exc.detail))
            return _error(exc.status_code, str(exc.detail))
        return _error(exc.status_code, str(exc.detail), "server_error")

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        message = _validation_message(exc)
        orchestrator().telemetry.rejected(dict(request.headers), message)
        return _error(400, message)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        card = {
            "id": model_name,
            "object": "model",
            "created": 0,
            "owned_by": "pdserve",
            "max_model_len": max_model_len,
        }
        return {"object": "list", "data": [card]}

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.post("/v1/completions", response_model=None)
    async def completions(body: CompletionRequest, request: Request) -> Any:
        return await _serve(
            body, request, _completion_input, CompletionFormat(model_name, token_text)
        )

    @app.post("/v1/chat/completions", response_model=None)
    async def chat(body: ChatCompletionRequest, request: Request) -> Any:
        return await _serve(body, request, _chat_input, ChatFormat(model_name, token_text))

    async def _serve(
        body: Any, request: Request, to_input: Callable[..., GenerateInput], fmt: ResponseFormat
    ) -> Any:
        flow = orchestrator()
        carrier = dict(request.headers)
        try:
            if body.model is not None and body.model != model_name:
                raise ValueError(f"model {body.model!r} is not served here; use {model_name!r}")
            # A chat is rendered and tokenized here: off the event loop when it is long.
            cost = chat_chars([{"content": m.content} for m in getattr(body, "messages", ())])
            gen_input = await flow.text_work.run(cost, to_input, body, flow)
        except ValueError as exc:
            flow.telemetry.rejected(carrier, str(exc))  # refused before the flow saw it
            return _error(400, public_message(exc))
        # vLLM's ids: the endpoint's prefix and the client's X-Request-Id (or a random one).
        base_id = request.headers.get("x-request-id") or uuid.uuid4().hex
        gen_input.request_id = fmt.id_prefix + base_id
        chunks = flow.generate(gen_input, carrier)
        try:
            first = await anext(chunks)  # bad input fails here, before any byte is sent
            if body.stream:
                include_usage = bool(body.stream_options and body.stream_options.include_usage)
                events = sse_events(first, chunks, fmt, include_usage)
                return StreamingResponse(
                    events, media_type="text/event-stream", headers=_SSE_HEADERS
                )
            async with aclosing(chunks):
                collected = [first] + [chunk async for chunk in chunks]
            # Assembling and serializing a whole response (thousands of tokens' logprobs, say)
            # is work in proportion to it: in a worker thread when it is large.
            entries = sum(
                len(c.token_ids) + sum(len(ids) for ids, _, _ in c.logprobs or ())
                for c in collected
            )
            return await flow.text_work.run(
                entries, lambda: JSONResponse(fmt.whole(collected, body.return_token_ids))
            )
        except ValueError as exc:
            return _error(400, public_message(exc))
        except DeadlineExceeded as exc:
            return _error(504, str(exc), "timeout")
        except EngineFailure as exc:  # a replica died or an engine failed mid-request
            return _error(503, public_message(exc), "server_error")
        except Exception as exc:
            logger.exception("request failed")
            return _error(500, public_message(exc), "server_error")

    return app


def _completion_input(body: CompletionRequest, flow: Orchestrator) -> GenerateInput:
    prompt: Any = body.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        if len(prompt) != 1:
            raise ValueError(f"one prompt per request, got {len(prompt)}")
        prompt = prompt[0]
    params = body.sampling_params(body.max_tokens, body.logprobs)
    return GenerateInput(prompt, params, "", body.priority, body.cache_salt, body.timeout_s)


def _chat_input(body: ChatCompletionRequest, flow: Orchestrator) -> GenerateInput:
    if flow.tokenizer is None:
        raise ValueError("this model has no tokenizer, so no chat template")
    if not body.messages:
        raise ValueError("messages is empty")
    message_fields = [name for i, m in enumerate(body.messages) for name in m.tool_fields(i)]
    tools = template_kwargs(body, message_fields, flow.tokenizer)
    messages = [m.as_template_message() for m in body.messages]
    # Before the template and the tokenizer: their cost grows with the text.
    flow.config.limits.check_chat_chars(messages)
    text = flow.tokenizer.apply_chat_template(messages, **tools)
    # The rendered template carries its own bos: tokenize without adding special tokens.
    token_ids = flow.tokenizer.encode(text, add_special_tokens=False)
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    # 0 is a value (refused as such), not "unset".
    max_tokens = (
        body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    )
    if max_tokens is None:  # as OpenAI: up to the context length (16 is the completions default)
        max_tokens = max(1, flow.model.max_model_len - len(token_ids))
    params = body.sampling_params(max_tokens, logprobs)
    return GenerateInput(token_ids, params, "", body.priority, body.cache_salt, body.timeout_s)


def _response_format(value: dict[str, Any]) -> StructuredOutputsParams:
    kind = value.get("type")
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True)
    if kind == "json_schema":
        spec = value.get("json_schema")
        if not isinstance(spec, dict) or "schema" not in spec:
            raise ValueError("response_format json_schema needs json_schema.schema")
        return StructuredOutputsParams(json=_schema_text(spec["schema"]))
    raise ValueError(f"response_format type must be text, json_object or json_schema, got {kind!r}")


def _schema_text(schema: dict[str, Any] | str) -> str:
    if isinstance(schema, str):
        return schema
    return json.dumps(schema)


def _logit_bias(bias: dict[str, float] | None) -> dict[int, float] | None:
    if not bias:
        return None
    try:
        return {int(token): value for token, value in bias.items()}
    except ValueError:
        raise ValueError("logit_bias keys must be token ids") from None


def _error(status: int, message: str, kind: str = "invalid_request_error") -> JSONResponse:
    body = {"object": "error", "message": message, "type": kind, "code": status}
    return JSONResponse({"error": body}, status_code=status)


def _validation_message(exc: RequestValidationError) -> str:
    parts = []
    for error in exc.errors():
        where = ".".join(str(p) for p in error.get("loc", ()) if p != "body")
        parts.append(f"{where}: {error.get('msg')}" if where else str(error.get("msg")))
    return "invalid request: " + "; ".join(parts)
