"""GrpcTransport: block pull over the side channel's ReadBlocks, for when NIXL is unavailable.

How it learns its peers: the connector handshakes with a remote engine through a
`SideChannelClient`, then calls `set_remote_client(engine_id, client)` (and `add_remote`, which
this transport does not need: a gRPC engine's metadata is empty). The client stays the
connector's — it also renews and releases leases with it, and closes it.

Each read runs one ReadBlocks stream on a small thread pool and writes every chunk into
`kv_cache[local_block_id]` as it arrives. Any failure (side-channel error, size mismatch, a
short stream, cancel) is reported by `poll` as failed; the caller treats every local block of
that read as invalid.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np
import torch

from connector.block_data import BlockChunk
from connector.side_channel import block_bytes_view
from connector.side_channel_client import BlockStream, SideChannelClient, SideChannelError
from connector.transport import BlockRead, KVTransport, TransferResults, as_shards, destination

logger = logging.getLogger(__name__)

CANCELLED = "cancelled"


@dataclass
class _Read:
    read: BlockRead
    fail_after_blocks: int | None  # fault injection
    cancelled: threading.Event = field(default_factory=threading.Event)
    stream: BlockStream | None = None
    fenced: bool = False  # the remote refused it: it no longer holds the blocks as lent


class GrpcTransport(KVTransport):
    name = "grpc"

    def __init__(
        self,
        max_concurrent_reads: int = 4,
        read_timeout_s: float = 30.0,
        min_bytes_per_s: float = 100e6,
    ) -> None:
        """A read's deadline is read_timeout_s + its bytes / min_bytes_per_s: big reads get
        the time they need; a stalled or vanished peer still ends the read."""
        self.read_timeout_s = read_timeout_s
        self.min_bytes_per_s = min_bytes_per_s
        self._executor = ThreadPoolExecutor(max_concurrent_reads, thread_name_prefix="kv-grpc")
        self._caches: list[torch.Tensor] = []  # per shard, [num_blocks, block_bytes] uint8
        self._clients: dict[str, SideChannelClient] = {}
        self._reads: dict[str, _Read] = {}
        self._results = TransferResults()
        self._fail_next_after: int | None = None
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ KVTransport

    def register(self, kv_cache: torch.Tensor | Sequence[torch.Tensor]) -> None:
        self._caches = [block_bytes_view(shard) for shard in as_shards(kv_cache)]

    def local_metadata(self) -> bytes:
        return b""  # readers find us through the side channel's host/port

    def add_remote(self, engine_id: str, metadata: bytes) -> None:
        """Nothing to do: reads need the engine's client, given by `set_remote_client`."""

    def set_remote_client(self, engine_id: str, client: SideChannelClient) -> None:
        with self._lock:
            self._clients[engine_id] = client

    def forget_remote(self, engine_id: str) -> None:
        """Drop a peer that is gone (restarted under a new engine id)."""
        with self._lock:
            self._clients.pop(engine_id, None)

    def start_read(self, read: BlockRead) -> None:
        if not self._caches:
            raise RuntimeError("GrpcTransport.register() first")
        with self._lock:
            if read.transfer_id in self._reads:
                raise ValueError(f"read {read.transfer_id!r} is already in flight")
            state = _Read(read, self._fail_next_after)
            self._fail_next_after = None
            self._reads[read.transfer_id] = state
        self._executor.submit(self._run, state)

    def poll(self) -> TransferResults:
        with self._lock:
            results, self._results = self._results, TransferResults()
        return results

    def cancel(self, transfer_id: str) -> None:
        with self._lock:
            state = self._reads.get(transfer_id)
            if state is None:
                return
            state.cancelled.set()
            stream = state.stream
        if stream is not None:
            stream.cancel()  # wakes a thread blocked waiting for the next message

    def close(self) -> None:
        with self._lock:
            transfer_ids = list(self._reads)
        for transfer_id in transfer_ids:
            self.cancel(transfer_id)
        self._executor.shutdown(wait=True)

    # ------------------------------------------------------------------ testing

    def inject_failure(self, after: int) -> None:
        """The next read started fails once `after` of its blocks have been written."""
        if after < 0:
            raise ValueError(f"after must be >= 0, got {after}")
        with self._lock:
            self._fail_next_after = after

    # ------------------------------------------------------------------ the read thread

    def _run(self, state: _Read) -> None:
        try:
            reason = self._copy(state)
        except Exception as exc:  # any failure is the read's, never the thread's
            logger.exception("KV read %s", state.read.transfer_id)
            reason = f"{type(exc).__name__}: {exc}"
        with self._lock:
            del self._reads[state.read.transfer_id]
            if state.cancelled.is_set():
                reason = CANCELLED
            if reason is None:
                self._results.done.add(state.read.transfer_id)
            else:  # one lock: a poll sees a fenced read's failure and its fence together
                self._results.failed[state.read.transfer_id] = reason
                if state.fenced and reason != CANCELLED:
                    self._results.fenced.add(state.read.transfer_id)

    def _copy(self, state: _Read) -> str | None:
        """Returns None on success, else why the read failed."""
        read = state.read
        cache = block_bytes_view(destination(read, self._caches))
        problem = self._check(read, cache)
        if problem:
            return problem
        client = self._clients.get(read.remote_engine_id)
        if client is None:
            return f"no side-channel client for engine {read.remote_engine_id!r} (handshake first)"
        num_bytes = len(read.remote_block_ids) * cache.shape[1]
        timeout_s = self.read_timeout_s + num_bytes / self.min_bytes_per_s
        stream = client.open_read(
            read.lease_id, read.remote_block_ids, timeout_s, shard=read.remote_shard
        )
        with self._lock:
            state.stream = stream
        if state.cancelled.is_set():
            stream.cancel()
            return CANCELLED
        try:
            return self._write_stream(state, stream, cache)
        except SideChannelError as exc:
            if state.cancelled.is_set():
                return CANCELLED
            state.fenced = exc.lease_gone
            return str(exc)

    def _write_stream(self, state: _Read, stream: BlockStream, cache: torch.Tensor) -> str | None:
        local_ids, fail_after = state.read.local_block_ids, state.fail_after_blocks
        num_written = 0
        try:
            for chunk in stream:
                if state.cancelled.is_set():
                    return CANCELLED
                if chunk.offset == 0 and fail_after is not None and num_written >= fail_after:
                    return f"injected failure after {num_written} blocks"
                if chunk.block_bytes != cache.shape[1]:
                    return (
                        f"block size mismatch: remote block {chunk.block_id} has "
                        f"{chunk.block_bytes} bytes, local blocks {cache.shape[1]}"
                    )
                _write_chunk(cache, local_ids[num_written], chunk)
                if chunk.last:
                    num_written += 1
        finally:
            stream.cancel()  # ends the call when we stop early; a no-op once it has ended
        if fail_after is not None:
            return f"injected failure after {num_written} blocks"
        if num_written != len(local_ids):  # BlockStream checks this too
            return f"missing blocks: got {num_written} of {len(local_ids)}"
        return None

    @staticmethod
    def _check(read: BlockRead, cache: torch.Tensor) -> str | None:
        if len(read.local_block_ids) != len(read.remote_block_ids):
            return (
                f"{len(read.local_block_ids)} local blocks for "
                f"{len(read.remote_block_ids)} remote blocks"
            )
        outside = [b for b in read.local_block_ids if not 0 <= b < cache.shape[0]]
        if outside:
            return f"local block ids {outside[:8]} outside [0, {cache.shape[0]})"
        return None


def _write_chunk(cache: torch.Tensor, local_block_id: int, chunk: BlockChunk) -> None:
    dst = cache[local_block_id, chunk.offset : chunk.offset + len(chunk.data)]
    src = np.frombuffer(chunk.data, dtype=np.uint8)
    if dst.device.type == "cpu":
        dst.numpy()[:] = src  # one copy, straight into the cache's storage
    else:
        host = torch.empty(len(src), dtype=torch.uint8)
        host.numpy()[:] = src
        dst.copy_(host)  # synchronous: the block is in place when the read is reported done
