"""One side-channel server process for every module of this package (the prefill
side, driven through a pipe), and in-process servers for tests that hold a read in flight."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from connector.side_channel_client import SideChannelClient
from tests.integration.side_channel.shared import GatedServer, ServerProcess, make_server


@pytest.fixture(scope="package")
def server() -> Iterator[ServerProcess]:
    proc = ServerProcess()
    yield proc
    proc.stop()


@pytest.fixture
def client(server: ServerProcess) -> Iterator[SideChannelClient]:
    c = server.client()
    yield c
    c.close()


@pytest.fixture
def gated_server() -> Iterator[tuple[GatedServer, int]]:
    """In-process: each read sends its first chunk, then waits for the test's gate."""
    s = make_server(hold_after=1)
    yield s, s.start()
    s.stop(0)
