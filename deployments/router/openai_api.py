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

import logging
import uuid
from collections.abc import Awaitable, Callable
from contextlib import aclosing
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from deployments.cluster.health import NOT_SERVING, SERVING, HealthReport
from deployments.credentials import ApiKeys, without_credentials
from deployments.errors import DeadlineExceeded, EngineFailure, Overloaded, public_message
from deployments.protocol import GenerateInput, chat_chars
from deployments.router.openai_format import (
    ChatFormat,
    CompletionFormat,
    ResponseFormat,
    sse_events,
)
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
    health_report: Callable[[], Awaitable[HealthReport]] | None = None,
    api_keys: ApiKeys | None = None,
) -> FastAPI:
    """The FastAPI app. `orchestrator` is looked up per request (the router owns it);
    `health_report` surveys the engines (without one, /health says only that the router
    runs); with `api_keys`, every route but /health needs one (deployments/credentials.py)."""
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
            orchestrator().telemetry.rejected(without_credentials(request.headers), message)
            return _error(413, message)
        return await call_next(request)

    keys = api_keys or ApiKeys()

    @app.middleware("http")
    async def _authenticate(request: Request, call_next: Callable[[Request], Any]) -> Any:
        # Outermost (added last): nothing else runs for a caller without a key.
        # The route's own path: an app under a route prefix sees the prefix in root_path.
        path = request.scope["path"].removeprefix(request.scope.get("root_path", ""))
        refusal = None if path == "/health" else keys.refusal(request.headers.get("authorization"))
        if refusal is None:
            return await call_next(request)
        orchestrator().telemetry.rejected(
            without_credentials(request.headers), refusal, "unauthenticated"
        )
        response = _error(401, refusal, code="invalid_api_key")
        response.headers["WWW-Authenticate"] = "Bearer"
        return response

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        # FastAPI's own refusals (a body that is not UTF-8 or nests too deep to parse, an
        # unknown route, a wrong method) in OpenAI's error shape, not FastAPI's {"detail": ...}.
        if exc.status_code < 500:
            orchestrator().telemetry.rejected(without_credentials(request.headers), str(exc.detail))
            return _error(exc.status_code, str(exc.detail))
        return _error(exc.status_code, str(exc.detail), "server_error")

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        message = _validation_message(exc)
        orchestrator().telemetry.rejected(without_credentials(request.headers), message)
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

    @app.get("/health", response_model=None)
    async def health() -> Any:
        """200 while some engine can answer requests (every replica's state in the body),
        503 when none can: what a readiness probe or a load balancer reads."""
        if health_report is None:
            return {"status": SERVING}
        report = await health_report()
        code = 503 if report.status == NOT_SERVING else 200
        body = {"status": report.status, "engines": report.engines}
        return JSONResponse(body, status_code=code)

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
        carrier = without_credentials(request.headers)
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
        except Overloaded as exc:  # at an admission bound: retry later
            response = _error(429, public_message(exc), "rate_limit_error")
            response.headers["Retry-After"] = str(exc.retry_after)
            return response
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
        max_tokens = context_max_tokens(flow.model.max_model_len, len(token_ids))
    params = body.sampling_params(max_tokens, logprobs)
    return GenerateInput(token_ids, params, "", body.priority, body.cache_salt, body.timeout_s)


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
