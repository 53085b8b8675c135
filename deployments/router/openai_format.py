"""OpenAI response bodies and server-sent events from the router's ResponseChunks."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import AsyncGenerator, Callable
from contextlib import aclosing
from typing import Any

from deployments.errors import public_message, status_of
from deployments.protocol import ResponseChunk
from engine.outputs import TokenLogprobs

logger = logging.getLogger(__name__)

TokenText = Callable[[int], str]


class ResponseFormat:
    """One endpoint's response shapes: whole bodies and stream chunks."""

    object_name = ""
    id_prefix = ""  # OpenAI's response ids: "cmpl-…", "chatcmpl-…"

    def __init__(self, model: str, token_text: TokenText) -> None:
        self.model = model
        self.token_text = token_text
        self.created = int(time.time())

    def envelope(self, chunk: ResponseChunk, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "id": chunk.request_id,
            "object": self.object_name,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }

    def delta_choice(self, chunk: ResponseChunk, first: bool) -> dict[str, Any]:
        raise NotImplementedError

    def whole(self, chunks: list[ResponseChunk], with_token_ids: bool) -> dict[str, Any]:
        raise NotImplementedError


class CompletionFormat(ResponseFormat):
    object_name = "text_completion"
    id_prefix = "cmpl-"

    def delta_choice(self, chunk: ResponseChunk, first: bool) -> dict[str, Any]:
        return {
            "index": 0,
            "text": chunk.text,
            "logprobs": self._logprobs(chunk.logprobs),
            "finish_reason": chunk.finish_reason,
        }

    def whole(self, chunks: list[ResponseChunk], with_token_ids: bool) -> dict[str, Any]:
        last = chunks[-1]
        choice: dict[str, Any] = {
            "index": 0,
            "text": "".join(c.text for c in chunks),
            "logprobs": self._logprobs(_all_logprobs(chunks)),
            "finish_reason": last.finish_reason,
        }
        if with_token_ids:
            choice["prompt_token_ids"] = chunks[0].prompt_token_ids
            choice["token_ids"] = [t for c in chunks for t in c.token_ids]
        body = self.envelope(chunks[0], [choice])
        body["usage"] = usage(last)
        return body

    def _logprobs(self, entries: list[TokenLogprobs] | None) -> dict[str, Any] | None:
        """The legacy completions shape: parallel lists, top-n as {token text: logprob}."""
        if entries is None:
            return None
        text = self.token_text
        return {
            "tokens": [text(ids[0]) for ids, _, _ in entries],
            "token_logprobs": [values[0] for _, values, _ in entries],
            "top_logprobs": [
                {text(t): v for t, v in zip(ids[1:], values[1:], strict=True)}
                for ids, values, _ in entries
            ],
        }


class ChatFormat(ResponseFormat):
    object_name = "chat.completion.chunk"
    id_prefix = "chatcmpl-"

    def delta_choice(self, chunk: ResponseChunk, first: bool) -> dict[str, Any]:
        delta: dict[str, Any] = {"content": chunk.text}
        if first:
            delta["role"] = "assistant"
        choice: dict[str, Any] = {"index": 0, "delta": delta}
        choice["logprobs"] = self._logprobs(chunk.logprobs)
        choice["finish_reason"] = chunk.finish_reason
        return choice

    def whole(self, chunks: list[ResponseChunk], with_token_ids: bool) -> dict[str, Any]:
        last = chunks[-1]
        message = {"role": "assistant", "content": "".join(c.text for c in chunks)}
        choice: dict[str, Any] = {
            "index": 0,
            "message": message,
            "logprobs": self._logprobs(_all_logprobs(chunks)),
            "finish_reason": last.finish_reason,
        }
        if with_token_ids:
            choice["token_ids"] = [t for c in chunks for t in c.token_ids]
        body = self.envelope(chunks[0], [choice])
        body["object"] = "chat.completion"
        body["usage"] = usage(last)
        return body

    def _logprobs(self, entries: list[TokenLogprobs] | None) -> dict[str, Any] | None:
        if entries is None:
            return None
        return {"content": [self._token(ids, values) for ids, values, _ in entries]}

    def _token(self, ids: list[int], values: list[float]) -> dict[str, Any]:
        entry = self._one(ids[0], values[0])
        entry["top_logprobs"] = [self._one(t, v) for t, v in zip(ids[1:], values[1:], strict=True)]
        return entry

    def _one(self, token_id: int, logprob: float) -> dict[str, Any]:
        text = self.token_text(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}


def _all_logprobs(chunks: list[ResponseChunk]) -> list[TokenLogprobs] | None:
    if all(c.logprobs is None for c in chunks):
        return None
    return [entry for c in chunks for entry in c.logprobs or ()]


async def sse_events(
    first: ResponseChunk,
    rest: AsyncGenerator[ResponseChunk, None],
    fmt: ResponseFormat,
    include_usage: bool,
) -> AsyncGenerator[str, None]:
    """Server-sent events; a client that disconnects cancels this, which aborts the request."""
    async with aclosing(rest):
        chunk = first
        try:
            is_first = True
            while True:
                yield _event(fmt.envelope(chunk, [fmt.delta_choice(chunk, is_first)]))
                is_first = False
                if chunk.finish_reason is not None:
                    break
                chunk = await anext(rest)
        except Exception as exc:  # headers are sent: say it in the stream, then end it
            kind = status_of(exc).http_type
            logger.warning("stream ended with an error", exc_info=True)
            yield _event({"error": {"message": public_message(exc), "type": kind}})
        else:
            if include_usage:
                usage_event = fmt.envelope(chunk, [])
                usage_event["usage"] = usage(chunk)
                yield _event(usage_event)
    yield "data: [DONE]\n\n"


def _event(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload)}\n\n"


def usage(chunk: ResponseChunk) -> dict[str, Any]:
    counts = chunk.usage
    if counts is None:
        return {}
    shown: dict[str, Any] = {
        "prompt_tokens": counts.prompt_tokens,
        "completion_tokens": counts.completion_tokens,
        "total_tokens": counts.prompt_tokens + counts.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": counts.cached_tokens},
    }
    if counts.pinned_ttl_s or counts.pin_refused:  # what came of the turn's KV pin
        shown["kv_pin"] = {"ttl_s": counts.pinned_ttl_s, "refused": counts.pin_refused}
    return shown
