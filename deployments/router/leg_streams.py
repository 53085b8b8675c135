"""What the router does to an engine leg's stream of outputs: bound it by the request's
deadline, collect it, drop the tokens the client already has."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import AsyncGenerator
from contextlib import aclosing

from deployments.errors import DeadlineExceeded
from deployments.router.response_stream import PreparedRequest
from engine.outputs import EngineCoreOutput


async def bounded(
    chunks: AsyncGenerator[EngineCoreOutput, None], prepared: PreparedRequest
) -> AsyncGenerator[EngineCoreOutput, None]:
    """`chunks` until the request's deadline; closing it aborts the engine request."""
    iterator = aiter(chunks)
    try:
        while True:
            remaining = prepared.deadline - time.monotonic()
            try:
                # asyncio.timeout, not wait_for: 3.11's wait_for can swallow a cancel that
                # lands as the chunk arrives (an abort would then go unnoticed).
                async with asyncio.timeout(max(remaining, 0.0)):
                    chunk = await anext(iterator)
            except StopAsyncIteration:
                return
            except TimeoutError:
                raise DeadlineExceeded(
                    f"request {prepared.request_id} ran past its deadline "
                    f"({prepared.deadline - prepared.started:.1f} s)"
                ) from None
            yield chunk
    finally:
        close = getattr(iterator, "aclose", None)
        if close is not None:
            await close()


async def collect(
    stream: AsyncGenerator[EngineCoreOutput, None], into: list[EngineCoreOutput]
) -> None:
    async with aclosing(stream):
        async for chunk in stream:
            into.append(chunk)


def drop_repeat(chunk: EngineCoreOutput, pending: list[int]) -> EngineCoreOutput:
    """Drop from the decode stream the tokens the prefill leg sent (`pending`, consumed)."""
    if not pending:
        return chunk
    dropped = min(len(pending), len(chunk.new_token_ids))
    if chunk.new_token_ids[:dropped] != pending[:dropped]:
        # Forced tokens cannot differ; if they do, the text would silently fork: refuse.
        # An internal invariant broke (INTERNAL for the client): not a leg to retry.
        raise RuntimeError(
            f"decode engine returned {chunk.new_token_ids[:dropped]} where the prefill "
            f"engine had sent {pending[:dropped]}"
        )
    del pending[:dropped]
    logprobs = chunk.new_logprobs[dropped:] if chunk.new_logprobs else chunk.new_logprobs
    return dataclasses.replace(
        chunk, new_token_ids=chunk.new_token_ids[dropped:], new_logprobs=logprobs
    )
