"""What the router does to an engine leg's stream of outputs: bound it by the request's
deadline, collect it, drop the tokens the client already has, give up a prefill leg that
does not answer in time."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import AsyncGenerator
from contextlib import aclosing
from typing import Any

from deployments.cluster.replica_set import ReplicaWatch
from deployments.errors import DeadlineExceeded
from deployments.router.response_stream import PreparedRequest
from engine.outputs import EngineCoreOutput

logger = logging.getLogger(__name__)


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


async def answered_in_time(
    leg: asyncio.Future[Any],
    prepared: PreparedRequest,
    timeout_s: float,
    replicas: ReplicaWatch | None,
) -> bool:
    """Whether a prefill leg ended (its errors raised) before `timeout_s`, the request's
    deadline, or the end of the last prefill replica `replicas` watches; False, logged, when
    it was given up."""
    timeout = min(timeout_s, prepared.deadline - time.monotonic())
    gone = asyncio.ensure_future(replicas.gone()) if replicas else None
    try:
        waiting = {leg} if gone is None else {leg, gone}
        done, _ = await asyncio.wait(waiting, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
    finally:
        if gone is not None:
            gone.cancel()
    if leg not in done:
        why = "no prefill replica is running" if gone in done else f"no answer in {timeout:.1f} s"
        logger.warning("prefill leg of %s given up (%s); decode-only", prepared.request_id, why)
        return False
    leg.result()
    return True
