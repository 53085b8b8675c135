"""Two-process KV transfer harness: what `pdserve bench kv` and the transport tests share.

A "prefill" child process fills a [num_blocks, block_bytes] cache with a pattern derived from
each block id and makes it readable over a transport (`serve_prefill_cache`); a reader - the
bench's decode child, or the test process itself - connects (`connect`), reads, and checks the
blocks byte for byte (`holds_blocks`). The parent relays what a handshake would carry
(`PeerInfo`) and keeps time limits (`expect`, `wait_for`, `reap`), so a stuck transport fails
instead of hanging.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import torch

from connector.transport import KVTransport
from engine.worker.host_memory import zeros_on_huge_pages

REMOTE_ENGINE_ID = "bench-prefill"
_SECRET = "kv-bench"
_COMPAT_HASH = "kv-bench"
_VERIFY_CHUNK_BYTES = 32 << 20  # pattern checks and fills work in chunks of this size


@dataclass(frozen=True)
class CacheSpec:
    """One side of a transfer: which transport, under which agent name, over which cache."""

    transport: str
    agent_name: str
    num_blocks: int
    block_bytes: int
    timeout_s: float


# -- block contents ---------------------------------------------------------------------------


def block_pattern(block_ids: torch.Tensor, block_bytes: int) -> torch.Tensor:
    """[len(block_ids), block_bytes] uint8 whose int64 word w of block b is ((b + 1) << 32) + w.

    Distinct per block and per offset, never all zero: a misplaced or missing block shows.
    """
    words = torch.arange(block_bytes // 8, dtype=torch.int64)
    values = ((block_ids.to(torch.int64) + 1) << 32).unsqueeze(1) + words
    return values.view(torch.uint8)


def _chunks(num_blocks: int, block_bytes: int) -> Iterator[tuple[int, int]]:
    step = max(1, _VERIFY_CHUNK_BYTES // block_bytes)
    for start in range(0, num_blocks, step):
        yield start, min(num_blocks, start + step)


def fill_cache(cache: torch.Tensor) -> None:
    """Block b of `cache` [num_blocks, block_bytes] uint8 <- block_pattern(b)."""
    for start, end in _chunks(cache.shape[0], cache.shape[1]):
        cache[start:end] = block_pattern(torch.arange(start, end), cache.shape[1])


def holds_blocks(cache: torch.Tensor, local_ids: list[int], remote_ids: list[int]) -> bool:
    """Whether local block local_ids[i] holds the pattern of remote block remote_ids[i], all i."""
    local, remote = torch.tensor(local_ids), torch.tensor(remote_ids)
    for start, end in _chunks(len(local_ids), cache.shape[1]):
        expected = block_pattern(remote[start:end], cache.shape[1])
        if not torch.equal(cache[local[start:end]], expected):
            return False
    return True


# -- transports -------------------------------------------------------------------------------


@dataclass(frozen=True)
class PeerInfo:
    """What the prefill process tells the decode process: the Handshake's part of the story."""

    transport_metadata: bytes
    side_channel_port: int = 0  # grpc: where ReadBlocks is served
    lease_id: str = "bench"  # grpc: the lease over every block


def _serve(spec: CacheSpec, cache: torch.Tensor) -> tuple[PeerInfo, Callable[[], None]]:
    """Make `cache` readable over `spec.transport`: (what a reader needs, how to stop)."""
    if spec.transport == "nixl":
        from connector.nixl_transport import NixlTransport

        transport = NixlTransport(spec.agent_name)
        transport.register(cache)
        return PeerInfo(transport.local_metadata()), transport.close
    from connector.side_channel import SideChannelServer
    from engine.config import KVTransferConfig

    config = KVTransferConfig(connector="grpc", secret=_SECRET)
    server = SideChannelServer(config, REMOTE_ENGINE_ID, _COMPAT_HASH, cache, b"", "grpc")
    port = server.start()
    lease = server.leases.add("bench", range(spec.num_blocks), lease_seconds=spec.timeout_s)
    return PeerInfo(b"", port, lease.lease_id), server.stop


def connect(
    spec: CacheSpec, cache: torch.Tensor, peer: PeerInfo
) -> tuple[KVTransport, Callable[[], None]]:
    """A transport over `cache` that can read from the prefill process: (it, how to close)."""
    if spec.transport == "nixl":
        from connector.nixl_transport import NixlTransport

        nixl = NixlTransport(spec.agent_name)
        nixl.register(cache)
        nixl.add_remote(REMOTE_ENGINE_ID, peer.transport_metadata)
        return nixl, nixl.close
    from connector.grpc_transport import GrpcTransport
    from connector.side_channel_client import SideChannelClient

    grpc = GrpcTransport()
    grpc.register(cache)
    client = SideChannelClient("127.0.0.1", peer.side_channel_port, _SECRET)
    client.handshake(spec.agent_name, _COMPAT_HASH, "grpc")
    grpc.set_remote_client(REMOTE_ENGINE_ID, client)
    grpc.add_remote(REMOTE_ENGINE_ID, peer.transport_metadata)

    def close() -> None:
        grpc.close()
        client.close()

    return grpc, close


def wait_for(transport: KVTransport, transfer_id: str, timeout_s: float) -> str | None:
    """Poll until `transfer_id` ends: None when done, the reason when it failed."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        results = transport.poll()
        if transfer_id in results.done:
            return None
        if transfer_id in results.failed:
            return results.failed[transfer_id]
        time.sleep(50e-6)  # leaves the GIL to transports that move bytes on their own threads
    transport.cancel(transfer_id)
    raise TimeoutError(f"read {transfer_id} did not finish within {timeout_s:g} s")


# -- the processes ---------------------------------------------------------------------------


def send_error(conn: Connection) -> None:
    with contextlib.suppress(OSError):
        conn.send(("error", traceback.format_exc()))


def serve_prefill_cache(conn: Connection, spec: CacheSpec) -> None:
    """Child process: a filled, registered cache. Sends ("ready", PeerInfo), serves reads until
    it receives anything (or `spec.timeout_s` passes with nothing received), then exits."""
    try:
        cache = zeros_on_huge_pages((spec.num_blocks, spec.block_bytes), torch.uint8)
        fill_cache(cache)
        peer, stop = _serve(spec, cache)
        conn.send(("ready", peer))
        conn.poll(spec.timeout_s)
        stop()
    except Exception:
        send_error(conn)


def expect(conn: Connection, kind: str, timeout_s: float, who: str) -> Any:
    """The payload of the next message from a child, which must be of `kind`."""
    if not conn.poll(timeout_s):
        raise TimeoutError(f"{who}: no {kind!r} within {timeout_s:g} s")
    try:
        got, payload = conn.recv()
    except EOFError:
        raise RuntimeError(f"{who} exited before sending {kind!r}") from None
    if got == "error":
        raise RuntimeError(f"{who} failed:\n{payload}")
    if got != kind:
        raise RuntimeError(f"{who} sent {got!r}, expected {kind!r}")
    return payload


def reap(process: mp.process.BaseProcess, timeout_s: float = 10.0) -> None:
    """Join a child; kill it if it does not exit in time."""
    if process.pid is None:
        return  # never started
    process.join(timeout_s)
    if process.is_alive():
        process.kill()
        process.join(timeout_s)
