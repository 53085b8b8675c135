"""OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions, /v1/models) over the router.

Served through Ray Serve's HTTP proxy by the Router's FastAPI ingress. Bad input (malformed
JSON, wrong types, out-of-range sampling values, an unknown model, a prompt too long) is an HTTP
400 with an OpenAI-style error body; a request past its deadline is a 504.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable
from contextlib import aclosing
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from deployments.errors import DeadlineExceeded, EngineFailure, public_message
from deployments.openai_format import ChatFormat, CompletionFormat, ResponseFormat, sse_events
from deployments.orchestrator import Orchestrator
from deployments.protocol import GenerateInput
from engine.request import SamplingParams

logger = logging.getLogger(__name__)

_SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


class _StreamOptions(BaseModel):
    include_usage: bool = False


class _SamplingFields(BaseModel):
    """Fields shared by both endpoints (OpenAI's, plus vLLM's extensions)."""

    model_config = ConfigDict(extra="ignore")

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

    def sampling_params(self, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
        if self.n != 1:
            raise ValueError(f"n must be 1 (one completion per request), got {self.n}")
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
        )


class CompletionRequest(_SamplingFields):
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = None
    echo: bool = False


class _ContentPart(BaseModel):
    type: str
    text: str = ""


class ChatMessage(BaseModel):
    role: str
    content: str | list[_ContentPart]

    def as_template_message(self) -> dict[str, str]:
        if isinstance(self.content, str):
            return {"role": self.role, "content": self.content}
        kinds = {part.type for part in self.content} - {"text"}
        if kinds:
            raise ValueError(f"only text content is supported, got {sorted(kinds)}")
        return {"role": self.role, "content": "".join(part.text for part in self.content)}


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None


def build_openai_app(
    orchestrator: Callable[[], Orchestrator], model_name: str, max_model_len: int
) -> FastAPI:
    """The FastAPI app. `orchestrator` is looked up per request (the router owns it)."""
    app = FastAPI(title="pdserve", docs_url=None, redoc_url=None)

    def token_text(token_id: int) -> str:
        tokenizer = orchestrator().tokenizer
        return tokenizer.decode([token_id], skip_special_tokens=False) if tokenizer else ""

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
            gen_input = to_input(body, flow)
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
            return fmt.whole(collected, body.return_token_ids)
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
    if body.echo:
        raise ValueError("echo is not supported")
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
    text = flow.tokenizer.apply_chat_template([m.as_template_message() for m in body.messages])
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
