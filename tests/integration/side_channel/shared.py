"""What the side-channel tests share: a small CPU cache filled with a seeded pattern, servers
over it (in this process, or in one of their own driven through a pipe), decode-side
transports.

Time and pace are the test's: a server's leases run on a clock the test advances
(ManualClock), and a server can hold each read after its first chunks until the test opens
its gate (GatedServer) — a test acts while a stream is in flight, or once a lease is past its
expiry, without sleeping.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from multiprocessing.connection import Connection
from typing import Any

import grpc
import pytest
import torch

from connector.grpc_transport import GrpcTransport
from connector.leases import LeaseTable
from connector.metadata import compatibility_hash
from connector.side_channel import CHUNK_BYTES, SideChannelServer, block_bytes_view
from connector.side_channel_client import SideChannelClient, SideChannelError
from engine.config import KVTransferConfig
from tests.integration.processes import peer_context
from tests.waiting import wait_until

SECRET = "s3cret"
ENGINE_ID = "prefill-0"
# [num_blocks, num_layers, K/V, block_size, num_kv_heads, head_dim] float16: 1 KiB blocks.
SHAPE = (32, 2, 2, 4, 2, 16)
BLOCK_BYTES = 1024
COMPAT_HASH = compatibility_hash(
    model="tiny", dtype=torch.float16, num_layers=2, num_kv_heads=2, head_dim=16, block_size=4
)
GATE_TIMEOUT_S = 30.0  # a held read goes on by itself after this (a test that failed)


def make_cache(shape: tuple[int, ...] = SHAPE, seed: int = 1234) -> torch.Tensor:
    """Seeded random bytes: the same cache in every process, every block different."""
    gen = torch.Generator().manual_seed(seed)
    numel = torch.Size(shape).numel()
    data = torch.randint(0, 256, (numel * 2,), dtype=torch.uint8, generator=gen)
    return data.view(torch.float16).view(shape)


def block(cache: torch.Tensor, block_id: int) -> bytes:
    return block_bytes_view(cache)[block_id].numpy().tobytes()


class ManualClock:
    """A lease table's clock that moves only when the test advances it."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


class GatedServer(SideChannelServer):
    """A server on a ManualClock, with block generations the test sets, whose reads, with
    `hold_after` set, send that many chunks and then wait for `gate` (set by the test)
    before each further one."""

    def __init__(self, *args: Any, hold_after: int | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.clock = ManualClock()
        # Block generations the test moves (an engine's BlockPool.generation_of stands here).
        self.generations: dict[int, int] = {}
        self.leases = LeaseTable(clock=self.clock, generation_of=self._generation)
        self.hold_after = hold_after
        self.gate = threading.Event()

    def _generation(self, block_id: int) -> int:
        return self.generations.get(block_id, 0)

    def block_chunks(
        self, block_ids: list[int], shard: int = 0
    ) -> Iterator[tuple[int, int, memoryview]]:
        for sent, item in enumerate(super().block_chunks(block_ids, shard)):
            if self.hold_after is not None and sent >= self.hold_after:
                self.gate.wait(GATE_TIMEOUT_S)
            yield item

    def stop(self, grace_s: float = 1.0) -> None:
        self.gate.set()  # no read stays held in a stopped server
        super().stop(grace_s)


def make_server(hold_after: int | None = None, chunk_bytes: int = CHUNK_BYTES) -> GatedServer:
    config = KVTransferConfig(connector="grpc", secret=SECRET)
    return GatedServer(
        config,
        ENGINE_ID,
        COMPAT_HASH,
        make_cache(),
        b"meta",
        "grpc",
        chunk_bytes=chunk_bytes,
        hold_after=hold_after,
    )


def _serve(conn: Connection, hold_after: int | None) -> None:
    """Child process: serve, and answer the parent's commands until told to stop."""
    server = make_server(hold_after)
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
        elif command == "advance":
            server.clock.advance(*args)
            conn.send(server.clock.now)
        else:
            break
    server.stop(0)


class ServerProcess:
    """A GatedServer in a process of its own (a peer that can be killed or frozen)."""

    def __init__(self, hold_after: int | None = None) -> None:
        ctx = peer_context()
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_serve, args=(child, hold_after), daemon=True)
        self.proc.start()
        child.close()
        self.port: int = self._recv(timeout_s=60)

    def lease(self, request_id: str, block_ids: list[int], lease_seconds: float = 30.0) -> str:
        return str(self._call("lease", request_id, block_ids, lease_seconds))

    def take_finished(self) -> set[str]:
        return set(self._call("take_finished"))

    def advance(self, seconds: float) -> None:
        """Move the server's lease clock on."""
        self._call("advance", seconds)

    def client(self, secret: str = SECRET) -> SideChannelClient:
        return SideChannelClient("127.0.0.1", self.port, secret, timeout_s=5.0)

    def stop(self) -> None:
        if self.proc.is_alive():
            # A server the test killed can still look alive until it is reaped: its end of
            # the pipe is gone, and so is the need to ask it to stop.
            with contextlib.suppress(BrokenPipeError, ConnectionResetError):
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


def refused(code: grpc.StatusCode, call: Callable[[], Any]) -> str:
    with pytest.raises(SideChannelError) as info:
        call()
    assert info.value.code == code, str(info.value)
    return str(info.value)


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

    if not wait_until(ended_now, timeout_s, period_s=0.01):
        raise TimeoutError(f"read {transfer_id} did not end in {timeout_s} s")
    return ended[transfer_id]
