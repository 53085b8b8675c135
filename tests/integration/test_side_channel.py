"""The KVTransfer side channel and GrpcTransport over real gRPC on loopback.

The prefill side (a SideChannelServer over a small CPU cache filled with a seeded pattern) runs
in a spawned process driven through a pipe; a few tests that need to slow the stream down use
an in-process server instead.

Why this file is long: the tests share that spawned server process (the module fixture), and a
module of their own would spawn another.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time
from collections.abc import Callable, Iterator
from multiprocessing.connection import Connection
from typing import Any

import grpc
import pytest
import torch

from connector.block_data import decode_block_data, encode_block_data
from connector.grpc_transport import GrpcTransport
from connector.leases import LeaseExpired, LeaseNotFound, LeaseTable
from connector.metadata import compatibility_hash
from connector.side_channel import CHUNK_BYTES, SideChannelServer, block_bytes_view
from connector.side_channel_client import SideChannelClient, SideChannelError
from connector.transport import BlockRead
from engine.config import KVTransferConfig
from protos.pdserve.v1 import kv_transfer_pb2 as pb

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]

SECRET = "s3cret"
ENGINE_ID = "prefill-0"
# [num_blocks, num_layers, K/V, block_size, num_kv_heads, head_dim] float16: 1 KiB blocks.
SHAPE = (32, 2, 2, 4, 2, 16)
BLOCK_BYTES = 1024
COMPAT_HASH = compatibility_hash(
    model="tiny", dtype=torch.float16, num_layers=2, num_kv_heads=2, head_dim=16, block_size=4
)


def make_cache(shape: tuple[int, ...] = SHAPE, seed: int = 1234) -> torch.Tensor:
    """Seeded random bytes: the same cache in every process, every block different."""
    gen = torch.Generator().manual_seed(seed)
    numel = torch.Size(shape).numel()
    data = torch.randint(0, 256, (numel * 2,), dtype=torch.uint8, generator=gen)
    return data.view(torch.float16).view(shape)


def block(cache: torch.Tensor, block_id: int) -> bytes:
    return block_bytes_view(cache)[block_id].numpy().tobytes()


class SlowServer(SideChannelServer):
    """Sleeps before each chunk, so a test can act while a stream is in flight."""

    delay_s = 0.0

    def block_chunks(self, block_ids: list[int]) -> Iterator[tuple[int, int, memoryview]]:
        for item in super().block_chunks(block_ids):
            time.sleep(self.delay_s)
            yield item


def make_server(delay_s: float = 0.0, chunk_bytes: int = CHUNK_BYTES) -> SideChannelServer:
    config = KVTransferConfig(connector="grpc", secret=SECRET)
    server = SlowServer(
        config, ENGINE_ID, COMPAT_HASH, make_cache(), b"meta", "grpc", chunk_bytes=chunk_bytes
    )
    server.delay_s = delay_s
    return server


def _serve(conn: Connection, delay_s: float) -> None:
    """Child process: serve, and answer the parent's lease commands until told to stop."""
    server = make_server(delay_s)
    conn.send(server.start())
    while True:
        try:
            command, *args = conn.recv()
        except EOFError:  # the parent is gone
            break
        if command == "lease":
            conn.send(server.leases.add(*args).lease_id)
        elif command == "take_finished":
            conn.send(server.leases.take_finished())
        else:
            break
    server.stop(0)


class ServerProcess:
    def __init__(self, delay_s: float = 0.0) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_serve, args=(child, delay_s), daemon=True)
        self.proc.start()
        child.close()
        self.port: int = self._recv(timeout_s=60)

    def lease(self, request_id: str, block_ids: list[int], lease_seconds: float = 30.0) -> str:
        return str(self._call("lease", request_id, block_ids, lease_seconds))

    def take_finished(self) -> set[str]:
        return set(self._call("take_finished"))

    def client(self, secret: str = SECRET) -> SideChannelClient:
        return SideChannelClient("127.0.0.1", self.port, secret, timeout_s=5.0)

    def stop(self) -> None:
        if self.proc.is_alive():
            self.conn.send(("stop",))
            self.proc.join(5)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(5)

    def _call(self, *command: Any) -> Any:
        self.conn.send(command)
        return self._recv(timeout_s=5)

    def _recv(self, timeout_s: float) -> Any:
        if not self.conn.poll(timeout_s):
            raise TimeoutError("side-channel server process did not answer")
        try:
            return self.conn.recv()
        except EOFError:
            self.proc.join(5)
            raise RuntimeError(f"server process exited ({self.proc.exitcode})") from None


@pytest.fixture(scope="module")
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
def slow_server() -> Iterator[tuple[SideChannelServer, int]]:
    """In-process, 0.1 s per block."""
    s = make_server(delay_s=0.1)
    yield s, s.start()
    s.stop(0)


def refused(code: grpc.StatusCode, call: Callable[[], Any]) -> str:
    with pytest.raises(SideChannelError) as info:
        call()
    assert info.value.code == code, str(info.value)
    return str(info.value)


def wait_for(predicate: Callable[[], Any], timeout_s: float = 10.0) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.01)
    raise TimeoutError("condition not met in time")


def transport_for(port: int, shape: tuple[int, ...] = SHAPE, **kwargs: Any) -> GrpcTransport:
    """A decode-side transport over a zeroed cache, handshaken with the server at `port`."""
    transport = GrpcTransport(**kwargs)
    transport.register(torch.zeros(shape, dtype=torch.float16))
    client = SideChannelClient("127.0.0.1", port, SECRET, timeout_s=5.0)
    reply = client.handshake("decode-0", COMPAT_HASH, transport.name, expected_engine_id=ENGINE_ID)
    transport.set_remote_client(reply.engine_id, client)
    transport.add_remote(reply.engine_id, reply.transport_metadata)
    return transport


def finish(transport: GrpcTransport, transfer_id: str, timeout_s: float = 10.0) -> str | None:
    """Poll until the read ends: None when done, else the failure reason."""
    ended: dict[str, str | None] = {}

    def ended_now() -> bool:
        results = transport.poll()
        ended.update({t: None for t in results.done})
        ended.update(results.failed)
        return transfer_id in ended

    wait_for(ended_now, timeout_s)
    return ended[transfer_id]


# ---------------------------------------------------------------------------------- handshake


def test_handshake(client: SideChannelClient) -> None:
    reply = client.handshake("decode-0", COMPAT_HASH, "grpc", expected_engine_id=ENGINE_ID)
    assert (reply.engine_id, reply.compatibility_hash) == (ENGINE_ID, COMPAT_HASH)
    assert (reply.num_blocks, reply.block_bytes) == (SHAPE[0], BLOCK_BYTES)
    assert reply.transport_metadata == b"meta" and reply.transport == "grpc"
    assert client.remote == reply


def test_handshake_refusals(client: SideChannelClient) -> None:
    other = compatibility_hash(
        model="tiny", dtype="bfloat16", num_layers=2, num_kv_heads=2, head_dim=16, block_size=4
    )
    message = refused(
        grpc.StatusCode.FAILED_PRECONDITION, lambda: client.handshake("d", other, "grpc")
    )
    assert other in message and COMPAT_HASH in message
    refused(grpc.StatusCode.FAILED_PRECONDITION, lambda: client.handshake("d", COMPAT_HASH, "nixl"))
    refused(
        grpc.StatusCode.NOT_FOUND,
        lambda: client.handshake("d", COMPAT_HASH, "grpc", expected_engine_id="prefill-9"),
    )


@pytest.mark.parametrize("secret", ["wrong", ""])
def test_wrong_secret_refused_on_every_rpc(server: ServerProcess, secret: str) -> None:
    lease_id = server.lease(f"req-secret-{secret}", [1, 2])
    bad = server.client(secret)
    calls: list[Callable[[], Any]] = [
        lambda: bad.handshake("d", COMPAT_HASH, "grpc"),
        lambda: bad.renew_lease(lease_id),
        lambda: bad.release(lease_id),
        lambda: list(bad.read_blocks(lease_id, [1])),
        lambda: bad.lend_prefix([b"h"]),
    ]
    for call in calls:
        assert "UNAUTHENTICATED" in refused(grpc.StatusCode.UNAUTHENTICATED, call)
    bad.close()
    good = server.client()
    assert good.release(lease_id)  # the refused Release did not end it
    good.close()


def test_an_engine_that_does_not_lend_refuses_loans(client: SideChannelClient) -> None:
    message = refused(grpc.StatusCode.FAILED_PRECONDITION, lambda: client.lend_prefix([b"h"]))
    assert "does not lend" in message


# ---------------------------------------------------------------------------------- reads


def test_read_blocks_returns_exact_bytes(server: ServerProcess, client: SideChannelClient) -> None:
    lease_id = server.lease("req-read", [3, 4, 5, 9, 20])
    expected = make_cache()
    got = list(client.read_blocks(lease_id, [9, 3, 4, 20]))
    assert [b for b, _ in got] == [9, 3, 4, 20]
    for block_id, data in got:
        assert data == block(expected, block_id)


def test_read_refusals(server: ServerProcess, client: SideChannelClient) -> None:
    lease_id = server.lease("req-refusals", [1, 2])
    message = refused(
        grpc.StatusCode.PERMISSION_DENIED, lambda: list(client.read_blocks(lease_id, [2, 3]))
    )
    assert "[3]" in message
    refused(grpc.StatusCode.OUT_OF_RANGE, lambda: list(client.read_blocks(lease_id, [1, 32])))
    refused(grpc.StatusCode.NOT_FOUND, lambda: list(client.read_blocks("no-such-lease", [1])))
    refused(grpc.StatusCode.INVALID_ARGUMENT, lambda: list(client.read_blocks(lease_id, [1, 1])))


def test_block_data_by_hand_is_protobuf_block_data() -> None:
    data = bytes(range(256)) * 3
    ours = encode_block_data(300, 1 << 33, memoryview(data), 1 << 40)
    assert pb.BlockData.FromString(ours) == pb.BlockData(
        block_id=300, offset=1 << 33, data=data, block_bytes=1 << 40
    )
    # proto3 leaves zeros out; an unknown field is skipped
    theirs = pb.BlockData(block_id=0, offset=0, data=b"xy", block_bytes=2).SerializeToString()
    chunk = decode_block_data(theirs + b"\x28\x05")
    assert (chunk.block_id, chunk.offset, bytes(chunk.data), chunk.block_bytes) == (0, 0, b"xy", 2)
    for malformed in (ours[:-1], ours[:4], b"\x08\xff", b"\x0f"):
        with pytest.raises(ValueError):
            decode_block_data(malformed)


def test_large_blocks_travel_in_chunks() -> None:
    server = make_server(chunk_bytes=300)  # 1024-byte blocks: chunks of 300, 300, 300, 124
    port = server.start()
    try:
        lease = server.leases.add("req-chunks", [5, 6, 7], 30.0)
        client = SideChannelClient("127.0.0.1", port, SECRET, timeout_s=5.0)
        got = dict(client.read_blocks(lease.lease_id, [7, 5]))
        assert got == {7: block(make_cache(), 7), 5: block(make_cache(), 5)}
        transport = transport_for(port)
        transport.start_read(BlockRead("t-chunks", ENGINE_ID, [1, 2], [5, 6], lease.lease_id))
        assert finish(transport, "t-chunks") is None
        local = transport._cache
        assert local is not None and bytes(local[1].numpy()) == block(make_cache(), 5)
        transport.close()
        client.close()
    finally:
        server.stop(0)


# ---------------------------------------------------------------------------------- leases


def test_renew_extends_the_lease(server: ServerProcess, client: SideChannelClient) -> None:
    lease_id = server.lease("req-renew", [1], lease_seconds=0.6)
    time.sleep(0.4)
    assert 0.4 < client.renew_lease(lease_id) <= 0.6
    time.sleep(0.4)  # past the original expiry, within the renewed one
    assert [b for b, _ in client.read_blocks(lease_id, [1])] == [1]
    assert "req-renew" not in server.take_finished()


def test_expired_lease_refuses_and_is_finished(
    server: ServerProcess, client: SideChannelClient
) -> None:
    lease_id = server.lease("req-expire", [1, 2], lease_seconds=0.3)
    time.sleep(0.45)
    message = refused(
        grpc.StatusCode.FAILED_PRECONDITION, lambda: list(client.read_blocks(lease_id, [1]))
    )
    assert "expired" in message
    refused(grpc.StatusCode.FAILED_PRECONDITION, lambda: client.renew_lease(lease_id))
    assert "req-expire" in server.take_finished()
    assert "req-expire" not in server.take_finished()
    # Remembered after it was taken: still "expired", not "unknown".
    refused(grpc.StatusCode.FAILED_PRECONDITION, lambda: client.renew_lease(lease_id))
    assert client.release(lease_id) is False


def test_release_is_finished_exactly_once(server: ServerProcess, client: SideChannelClient) -> None:
    lease_id = server.lease("req-release", [4, 5])
    assert client.release(lease_id) is True
    assert client.release(lease_id) is False  # idempotent
    assert "req-release" in server.take_finished()
    assert "req-release" not in server.take_finished()
    refused(grpc.StatusCode.NOT_FOUND, lambda: client.renew_lease(lease_id))
    refused(grpc.StatusCode.NOT_FOUND, lambda: list(client.read_blocks(lease_id, [4])))


def test_lease_expiring_mid_stream_ends_it_and_holds_blocks_until_stopped(
    slow_server: tuple[SideChannelServer, int],
) -> None:
    server, port = slow_server
    lease = server.leases.add("req-mid", list(range(10)), 0.35)
    client = SideChannelClient("127.0.0.1", port, SECRET, timeout_s=5.0)
    read: list[int] = []
    with pytest.raises(SideChannelError) as info:
        read.extend(b for b, _ in client.read_blocks(lease.lease_id, list(range(10))))
    assert info.value.code == grpc.StatusCode.FAILED_PRECONDITION and "expired" in str(info.value)
    assert 1 <= len(read) < 10
    assert wait_for(lambda: "req-mid" in server.leases.take_finished(), 2.0)
    client.close()


# ---------------------------------------------------------------------------------- transport


def test_grpc_transport_reads_runs_exactly(server: ServerProcess) -> None:
    remote, local = [3, 4, 5, 10, 11, 20], [7, 8, 9, 2, 3, 30]
    lease_id = server.lease("req-transport", remote)
    transport = transport_for(server.port, shape=(40, *SHAPE[1:]))
    transport.start_read(BlockRead("t-1", ENGINE_ID, local, remote, lease_id))
    assert finish(transport, "t-1") is None
    cache, expected = transport._cache, make_cache()
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


def test_grpc_transport_cancel(slow_server: tuple[SideChannelServer, int]) -> None:
    server, port = slow_server
    blocks = list(range(10))
    lease = server.leases.add("req-cancel", blocks, 30.0)
    transport = transport_for(port)
    transport.start_read(BlockRead("t-cancel", ENGINE_ID, blocks, blocks, lease.lease_id))
    cache = transport._cache
    assert cache is not None
    wait_for(lambda: bool(cache[0].any()), 5.0)  # the stream is under way
    transport.cancel("t-cancel")
    started = time.monotonic()
    assert finish(transport, "t-cancel", 2.0) == "cancelled"
    assert time.monotonic() - started < 1.0
    # The server's stream stopped, so a release lets the engine free the blocks.
    server.leases.release(lease.lease_id)
    assert wait_for(lambda: "req-cancel" in server.leases.take_finished(), 2.0)
    transport.close()


def test_server_killed_mid_read_fails_fast() -> None:
    proc = ServerProcess(delay_s=0.1)
    try:
        blocks = list(range(30))
        lease_id = proc.lease("req-kill", blocks)
        transport = transport_for(proc.port, read_timeout_s=5.0)
        transport.start_read(BlockRead("t-kill", ENGINE_ID, blocks, blocks, lease_id))
        cache = transport._cache
        assert cache is not None
        wait_for(lambda: bool(cache[0].any()), 10.0)
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
    proc = ServerProcess(delay_s=0.1)
    try:
        blocks = list(range(30))
        lease_id = proc.lease("req-frozen", blocks)
        transport = transport_for(proc.port, read_timeout_s=1.0)
        transport.start_read(BlockRead("t-frozen", ENGINE_ID, blocks, blocks, lease_id))
        cache = transport._cache
        assert cache is not None
        wait_for(lambda: bool(cache[0].any()), 10.0)
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


def test_lease_table_holds_blocks_while_read_and_reports_each_end_once() -> None:
    now = [0.0]
    table = LeaseTable(clock=lambda: now[0])
    reading = table.add("req-a", [1, 2], 1.0)
    cancelled = table.add("req-b", [3], 1.0)
    with pytest.raises(ValueError):
        table.add("req-a", [4], 1.0)  # one lease per request
    table.open_read(reading.lease_id, [2])
    assert table.cancel_request("req-b")
    now[0] = 1.5  # req-a expires while its blocks are being copied
    assert table.take_finished() == {"req-b"}
    assert table.num_active == 1
    table.close_read(reading.lease_id)
    assert table.take_finished() == {"req-a"}
    assert table.take_finished() == set() and table.num_active == 0
    with pytest.raises(LeaseExpired):
        table.renew(reading.lease_id)
    with pytest.raises(LeaseNotFound):
        table.renew(cancelled.lease_id)
