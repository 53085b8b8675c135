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
`metadata`, `store: false` (nothing is stored), and `response_format.json_schema`'s `name`,
`description` and `strict` (the schema is always enforced). A message's `name` goes to the chat
template. `prompt_cache_key` names an agent's session and `cache_control` (on a message or a
content part) asks for the turn's KV to be kept for its next turn (openai_pins.py); the usage
says what came of it (`kv_pin`).
Structured outputs: `response_format` (`text`, `json_object`, `json_schema`) and vLLM's
`guided_json`, `guided_regex`, `guided_choice`, `guided_grammar` (xgrammar EBNF).
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import AsyncGenerator, Awaitable, Callable
from contextlib import aclosing
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from deployments.cluster.health import NOT_SERVING, SERVING, HealthReport
from deployments.credentials import ApiKeys, without_credentials
from deployments.errors import RetryLater, Unauthenticated, public_message, status_of
from deployments.protocol import GenerateInput, ResponseChunk, chat_chars
from deployments.router.openai_format import (
    ChatFormat,
    CompletionFormat,
    ResponseFormat,
    sse_events,
)
from deployments.router.openai_pins import kv_pin
from deployments.router.openai_requests import ChatCompletionRequest, CompletionRequest
from deployments.router.openai_tools import template_kwargs
from deployments.router.orchestrator import Orchestrator
from deployments.router.prompt_checks import context_max_tokens

logger = logging.getLogger(__name__)

_SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def build_openai_app(
    orchestrator: Callable[[], Orchestrator],
    model_name: str,
    max_model_len: int,
    health_report: Callable[[bool], Awaitable[HealthReport]] | None = None,
    api_keys: ApiKeys | None = None,
) -> FastAPI:
    """The FastAPI app. `orchestrator` is looked up per request (the router owns it);
    `health_report` surveys the engines (without one, /health says only that the router
    runs; its argument: whether the caller may see the figures, surveyed now, else the status
    of a survey shared for a second); with `api_keys`, every route but /health needs one, and
    /health tells a caller without one the status alone (deployments/credentials.py)."""
    app = FastAPI(title="pdserve", docs_url=None, redoc_url=None)
    api_keys = api_keys or ApiKeys()
    edge = _Edge(orchestrator, api_keys)
    # The last added runs first: nothing else runs for a caller without a key.
    app.middleware("http")(edge.limit_body)
    app.middleware("http")(edge.authenticate)
    app.exception_handler(StarletteHTTPException)(edge.http_error)
    app.exception_handler(RequestValidationError)(edge.invalid)
    routes = _Routes(orchestrator, model_name, max_model_len, health_report, api_keys)
    app.get("/v1/models")(routes.models)
    app.get("/health", response_model=None)(routes.health)
    app.post("/v1/completions", response_model=None)(routes.completions)
    app.post("/v1/chat/completions", response_model=None)(routes.chat)
    return app


class _Edge:
    """What runs before a route: the API key, the body's size, FastAPI's own refusals in
    OpenAI's error shape. Each refusal is one `router.request` span."""

    def __init__(self, orchestrator: Callable[[], Orchestrator], keys: ApiKeys) -> None:
        self._orchestrator = orchestrator
        self._keys = keys

    def _rejected(self, request: Request, message: str, outcome: str = "invalid") -> None:
        telemetry = self._orchestrator().telemetry
        telemetry.rejected(without_credentials(request.headers), message, outcome)

    async def authenticate(self, request: Request, call_next: Callable[[Request], Any]) -> Any:
        # The route's own path: an app under a route prefix sees the prefix in root_path.
        path = request.scope["path"].removeprefix(request.scope.get("root_path", ""))
        authorization = request.headers.get("authorization")
        refusal = None if path == "/health" else self._keys.refusal(authorization)
        if refusal is None:
            return await call_next(request)
        self._rejected(request, refusal, "unauthenticated")
        response = error_response(Unauthenticated(refusal), code="invalid_api_key")
        response.headers["WWW-Authenticate"] = "Bearer"
        return response

    async def limit_body(self, request: Request, call_next: Callable[[Request], Any]) -> Any:
        # Refused from the header, before the body is read or parsed (413, as OpenAI's shape).
        limit = self._orchestrator().config.limits.max_body_bytes
        length = request.headers.get("content-length", "")
        if length.isdigit() and int(length) > limit:
            message = f"request body is {length} bytes; the limit is {limit} (max_body_bytes)"
            self._rejected(request, message)
            return _error(413, message)
        return await call_next(request)

    async def http_error(self, request: Request, exc: StarletteHTTPException) -> JSONResponse:
        # FastAPI's own refusals (a body that is not UTF-8 or nests too deep to parse, an
        # unknown route, a wrong method) in OpenAI's error shape, not FastAPI's {"detail": ...}.
        if exc.status_code < 500:
            self._rejected(request, str(exc.detail))
            return _error(exc.status_code, str(exc.detail))
        return _error(exc.status_code, str(exc.detail), "server_error")

    async def invalid(self, request: Request, exc: RequestValidationError) -> JSONResponse:
        message = _validation_message(exc)
        self._rejected(request, message)
        return _error(400, message)


class _Routes:
    """/v1/models, /health, /v1/completions, /v1/chat/completions."""

    def __init__(
        self,
        orchestrator: Callable[[], Orchestrator],
        model_name: str,
        max_model_len: int,
        health_report: Callable[[bool], Awaitable[HealthReport]] | None,
        api_keys: ApiKeys,
    ) -> None:
        self._orchestrator = orchestrator
        self._model_name = model_name
        self._max_model_len = max_model_len
        self._health_report = health_report
        self._keys = api_keys

    async def models(self) -> dict[str, Any]:
        card = {
            "id": self._model_name,
            "object": "model",
            "created": 0,
            "owned_by": "pdserve",
            "max_model_len": self._max_model_len,
        }
        return {"object": "list", "data": [card]}

    async def health(self, request: Request) -> Any:
        """200 while some engine can answer requests, 503 when none can: what a readiness
        probe or a load balancer reads. Every replica's state in the body for a caller with
        a valid key (or where the app has none); the status alone for anyone else."""
        if self._health_report is None:
            return {"status": SERVING}
        detailed = self._keys.refusal(request.headers.get("authorization")) is None
        report = await self._health_report(detailed)  # anonymous: the last second's, shared
        code = 503 if report.status == NOT_SERVING else 200
        body: dict[str, Any] = {"status": report.status}
        if detailed:
            body["engines"] = report.engines
        return JSONResponse(body, status_code=code)

    async def completions(self, body: CompletionRequest, request: Request) -> Any:
        fmt = CompletionFormat(self._model_name, self._token_text)
        return await self._serve(body, request, _completion_input, fmt)

    async def chat(self, body: ChatCompletionRequest, request: Request) -> Any:
        fmt = ChatFormat(self._model_name, self._token_text)
        return await self._serve(body, request, _chat_input, fmt)

    def _token_text(self, token_id: int) -> str:
        tokenizer = self._orchestrator().tokenizer
        return tokenizer.decode([token_id], skip_special_tokens=False) if tokenizer else ""

    async def _serve(
        self,
        body: Any,
        request: Request,
        to_input: Callable[..., GenerateInput],
        fmt: ResponseFormat,
    ) -> Any:
        flow = self._orchestrator()
        carrier = without_credentials(request.headers)
        try:
            if body.model is not None and body.model != self._model_name:
                wanted = self._model_name
                raise ValueError(f"model {body.model!r} is not served here; use {wanted!r}")
            # A chat is rendered and tokenized here: off the event loop when it is long.
            cost = chat_chars([{"content": m.content} for m in getattr(body, "messages", ())])
            gen_input = await flow.text_work.run(cost, to_input, body, flow)
        except ValueError as exc:
            flow.telemetry.rejected(carrier, str(exc))  # refused before the flow saw it
            return error_response(exc)
        # vLLM's ids: the endpoint's prefix and the client's X-Request-Id (or a random one).
        base_id = request.headers.get("x-request-id") or uuid.uuid4().hex
        gen_input.request_id = fmt.id_prefix + base_id
        try:
            return await _respond(flow, flow.generate(gen_input, carrier), body, fmt)
        except Exception as exc:
            if status_of(exc).internal:
                logger.exception("request failed")
            return error_response(exc)


async def _respond(
    flow: Orchestrator, chunks: AsyncGenerator[ResponseChunk, None], body: Any, fmt: ResponseFormat
) -> Any:
    """The response: server-sent events, or one JSON object. Bad input fails at the first
    chunk, before any byte is sent."""
    first = await anext(chunks)
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        events = sse_events(first, chunks, fmt, include_usage)
        return StreamingResponse(events, media_type="text/event-stream", headers=_SSE_HEADERS)
    async with aclosing(chunks):
        collected = [first] + [chunk async for chunk in chunks]
    # Assembling and serializing a whole response (thousands of tokens' logprobs, say) is work
    # in proportion to it: in a worker thread when it is large.
    entries = sum(
        len(c.token_ids) + sum(len(ids) for ids, _, _ in c.logprobs or ()) for c in collected
    )
    return await flow.text_work.run(
        entries, lambda: JSONResponse(fmt.whole(collected, body.return_token_ids))
    )


def _completion_input(body: CompletionRequest, flow: Orchestrator) -> GenerateInput:
    prompt: Any = body.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        if len(prompt) != 1:
            raise ValueError(f"one prompt per request, got {len(prompt)}")
        prompt = prompt[0]
    params = body.sampling_params(body.max_tokens, body.logprobs)
    pin = kv_pin(body.prompt_cache_key, ())
    return GenerateInput(prompt, params, "", body.priority, body.cache_salt, body.timeout_s, pin)


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
        max_tokens = context_max_tokens(flow.model.max_model_len, len(token_ids))
    params = body.sampling_params(max_tokens, logprobs)
    pin = body.kv_pin(messages)
    return GenerateInput(token_ids, params, "", body.priority, body.cache_salt, body.timeout_s, pin)


def error_response(exc: BaseException, code: str | None = None) -> JSONResponse:
    """An error in OpenAI's shape, with the status of `exc` (deployments/errors.py); an
    Overloaded or Unavailable one says when to retry in Retry-After."""
    status = status_of(exc)
    response = _error(status.http_status, public_message(exc), status.http_type, code)
    if isinstance(exc, RetryLater):
        response.headers["Retry-After"] = str(exc.retry_after)
    return response


def _error(
    status: int, message: str, kind: str = "invalid_request_error", code: str | int | None = None
) -> JSONResponse:
    body = {"object": "error", "message": message, "type": kind, "code": code or status}
    return JSONResponse({"error": body}, status_code=status)


def _validation_message(exc: RequestValidationError) -> str:
    parts = []
    for error in exc.errors():
        where = ".".join(str(p) for p in error.get("loc", ()) if p != "body")
        parts.append(f"{where}: {error.get('msg')}" if where else str(error.get("msg")))
    return "invalid request: " + "; ".join(parts)
