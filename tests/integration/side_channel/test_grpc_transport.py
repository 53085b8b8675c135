"""GrpcTransport, the decode side's reader over the side channel: runs of blocks land exactly
where asked, injected and real failures are reported as such, a cancelled read ends at once,
and a peer killed or frozen mid-read fails the read fast (UNAVAILABLE) or at its deadline."""

from __future__ import annotations

import os
import signal
import time

import pytest

from connector.grpc_transport import GrpcTransport
from connector.transport import BlockRead
from tests.integration.side_channel.shared import (
    ENGINE_ID,
    SHAPE,
    GatedServer,
    ServerProcess,
    block,
    finish,
    make_cache,
    transport_for,
)
from tests.waiting import wait_until

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]


def test_grpc_transport_reads_runs_exactly(server: ServerProcess) -> None:
    remote, local = [3, 4, 5, 10, 11, 20], [7, 8, 9, 2, 3, 30]
    lease_id = server.lease("req-transport", remote)
    transport = transport_for(server.port, shape=(40, *SHAPE[1:]))
    transport.start_read(BlockRead("t-1", ENGINE_ID, local, remote, lease_id))
    assert finish(transport, "t-1") is None
    cache, expected = transport._caches[0], make_cache()
    assert cache is not None
    for loc, rem in zip(local, remote, strict=True):
        assert bytes(cache[loc].numpy()) == block(expected, rem)
    untouched = [b for b in range(40) if b not in local]
    assert not cache[untouched].any()
    transport.close()


def test_grpc_transport_injected_failure(server: ServerProcess) -> None:
    lease_id = server.lease("req-inject", [1, 2, 3, 4])
    transport = transport_for(server.port)
    transport.inject_failure(2)
    transport.start_read(BlockRead("t-inject", ENGINE_ID, [5, 6, 7, 8], [1, 2, 3, 4], lease_id))
    assert finish(transport, "t-inject") == "injected failure after 2 blocks"
    transport.start_read(BlockRead("t-again", ENGINE_ID, [5, 6, 7, 8], [1, 2, 3, 4], lease_id))
    assert finish(transport, "t-again") is None  # the injection was for one read only
    transport.close()


def test_grpc_transport_failures_reported(server: ServerProcess) -> None:
    lease_id = server.lease("req-fail", [1, 2])
    transport = transport_for(server.port)
    transport.start_read(BlockRead("t-unknown", "prefill-9", [1], [1], lease_id))
    assert "no side-channel client" in (finish(transport, "t-unknown") or "")
    transport.start_read(BlockRead("t-denied", ENGINE_ID, [1, 2], [2, 3], lease_id))
    assert "PERMISSION_DENIED" in (finish(transport, "t-denied") or "")
    small = transport_for(server.port, shape=(8, 1, 2, 4, 2, 16))  # 512-byte blocks
    small.start_read(BlockRead("t-size", ENGINE_ID, [1], [1], lease_id))
    assert "block size mismatch" in (finish(small, "t-size") or "")
    transport.close()
    small.close()


def test_grpc_transport_cancel(gated_server: tuple[GatedServer, int]) -> None:
    server, port = gated_server
    blocks = list(range(10))
    lease = server.leases.add("req-cancel", blocks, 30.0)
    transport = transport_for(port)
    transport.start_read(BlockRead("t-cancel", ENGINE_ID, blocks, blocks, lease.lease_id))
    cache = transport._caches[0]
    assert cache is not None
    # The stream is under way: the first block is in, the next waits at the gate.
    assert wait_until(lambda: bool(cache[0].any()), 5.0)
    transport.cancel("t-cancel")
    started = time.monotonic()
    assert finish(transport, "t-cancel", 2.0) == "cancelled"
    assert time.monotonic() - started < 1.0
    # Once the server's stream has stopped (its held chunk goes to a cancelled call), a
    # release lets the engine free the blocks.
    server.gate.set()
    server.leases.release(lease.lease_id)
    assert wait_until(lambda: "req-cancel" in server.leases.take_finished(), 2.0)
    transport.close()


def test_server_killed_mid_read_fails_fast() -> None:
    proc = ServerProcess(hold_after=1)
    try:
        transport = _read_held_at_the_gate(proc, "kill", read_timeout_s=5.0)
        proc.proc.kill()
        started = time.monotonic()
        reason = finish(transport, "t-kill", 10.0)
        assert reason is not None and "UNAVAILABLE" in reason, reason
        assert time.monotonic() - started < 3.0
        transport.close()
    finally:
        proc.stop()


def test_frozen_server_read_ends_at_its_deadline() -> None:
    """A peer that keeps its socket open but never answers: the deadline ends the read."""
    proc = ServerProcess(hold_after=1)
    try:
        transport = _read_held_at_the_gate(proc, "frozen", read_timeout_s=1.0)
        pid = proc.proc.pid
        assert pid is not None
        os.kill(pid, signal.SIGSTOP)
        try:
            reason = finish(transport, "t-frozen", 5.0)
        finally:
            os.kill(pid, signal.SIGCONT)
        assert reason is not None and "DEADLINE_EXCEEDED" in reason, reason
        transport.close()
    finally:
        proc.stop()


def _read_held_at_the_gate(proc: ServerProcess, name: str, read_timeout_s: float) -> GrpcTransport:
    """Read "t-<name>", 30 blocks from `proc` (a server that holds all but the first at its
    gate), once the first has landed."""
    blocks = list(range(30))
    lease_id = proc.lease(f"req-{name}", blocks)
    transport = transport_for(proc.port, read_timeout_s=read_timeout_s)
    transport.start_read(BlockRead(f"t-{name}", ENGINE_ID, blocks, blocks, lease_id))
    cache = transport._caches[0]
    assert cache is not None
    assert wait_until(lambda: bool(cache[0].any()), 10.0)  # the rest held at the gate
    return transport
