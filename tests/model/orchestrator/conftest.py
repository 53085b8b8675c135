"""Two engines for every module of this package (building them costs seconds; a test that
needs a fresh cache builds its own), joined by the gRPC KV transport, and the offline LLM as
the oracle. No Ray: the engines run in this process."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from deployments.replica.engine_server import EngineServer
from engine.llm import LLM
from tests.model.orchestrator.shared import ENGINE_ARGS, KV


@pytest.fixture(scope="package")
def servers() -> Iterator[tuple[EngineServer, EngineServer]]:
    # Both engines schedule asynchronously; the offline oracle does not.
    prefill = EngineServer("tiny", {**ENGINE_ARGS, "async_scheduling": True}, KV)
    decode = EngineServer("tiny", {**ENGINE_ARGS, "async_scheduling": True}, KV)
    yield prefill, decode
    for server in (prefill, decode):
        server.__del__()


@pytest.fixture(scope="package")
def offline() -> Iterator[LLM]:
    llm = LLM("tiny", **ENGINE_ARGS)
    yield llm
    llm.close()
