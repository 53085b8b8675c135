"""Helpers for tests that run the router's flow over in-process engines."""

from __future__ import annotations

import asyncio
from typing import Any

from deployments.protocol import GenerateInput, ResponseChunk
from deployments.replica.engine_server import EngineServer
from deployments.router.orchestrator import Orchestrator
from engine.request import SamplingParams
from tests.waiting import wait_until


def run(flow: Orchestrator, prompt: Any, **params: Any) -> list[ResponseChunk]:
    """The client chunks of one request; background releases awaited."""

    async def go() -> list[ResponseChunk]:
        request = GenerateInput(prompt, SamplingParams(**params))
        try:
            return [chunk async for chunk in flow.generate(request)]
        finally:
            await flow.wait_background()  # releases run in the background

    return asyncio.run(go())


def tokens(chunks: list[ResponseChunk]) -> list[int]:
    return [t for c in chunks for t in c.token_ids]


def idle(server: EngineServer, timeout_s: float = 10.0) -> bool:
    """Every KV block free and no request held for a reader, within `timeout_s`."""

    def now_idle() -> bool:
        stats = server.stats()
        return stats["num_free_blocks"] == stats["num_blocks"] and not stats["num_held_requests"]

    return wait_until(now_idle, timeout_s)
