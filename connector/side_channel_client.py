"""The client of an engine's KVTransfer side channel (the server: connector/side_channel.py):
handshake, leases, block reads, prefix loans; every call with a deadline, every refusal a
`SideChannelError` with its gRPC status."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import grpc

from connector.block_data import BlockChunk, decode_block_data
from connector.side_channel import (
    CHANNEL_OPTIONS,
    SECRET_METADATA_KEY,
    SERVICE,
    client_channel,
    grpc_host,
)
from engine.block_checksums import to_hex
from engine.config import SideChannelTLS
from protos.pdserve.v1 import kv_transfer_pb2 as pb
from protos.pdserve.v1 import kv_transfer_pb2_grpc as pb_grpc

# A peer that vanishes without closing its socket (host down) is noticed by keepalive pings
# within ~15 s, even inside a long deadline; the server accepts pings that often.
_CLIENT_OPTIONS = [*CHANNEL_OPTIONS, ("grpc.keepalive_time_ms", 10_000)]
_CLIENT_OPTIONS += [("grpc.keepalive_timeout_ms", 5_000)]


class SideChannelError(Exception):
    """A refused or failed side-channel call."""

    def __init__(self, code: grpc.StatusCode, message: str, target: str = "") -> None:
        self.code = code
        self.message = message
        where = f"side channel {target}" if target else "side channel"
        super().__init__(f"{where}: {code.name}: {message}")

    @property
    def lease_gone(self) -> bool:
        """The remote answered that it no longer holds the lease's blocks as lent (expired,
        released, cancelled, rewritten); any other failure: it could not answer."""
        return self.code in _LEASE_GONE


_LEASE_GONE = (
    grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.PERMISSION_DENIED,
)


@dataclass(frozen=True)
class HandshakeReply:
    engine_id: str
    compatibility_hash: str
    transport: str
    transport_metadata: bytes
    num_blocks: int
    block_bytes: int
    # Each shard's KV heads, (first, count), for an engine of several (else empty).
    shard_heads: tuple[tuple[int, int], ...] = ()


@dataclass(frozen=True)
class LendReply:
    """LendPrefix's answer; `block_ids` empty when nothing was lent."""

    engine_id: str
    request_id: str
    block_ids: list[int]
    lease_id: str
    lease_seconds: float
    block_checksums: list[str]  # one per block, as lent (engine/block_checksums.py)


class BlockStream:
    """A ReadBlocks call: iterate validated chunks; `cancel()` may be called from any thread."""

    def __init__(self, call: Any, block_ids: list[int], target: str) -> None:
        self._call = call
        self._block_ids = block_ids
        self._target = target

    def cancel(self) -> None:
        self._call.cancel()

    def __iter__(self) -> Iterator[BlockChunk]:
        ids, i, expected_offset = self._block_ids, 0, 0
        try:
            for msg in self._call:
                chunk = self._decode(msg)
                end = chunk.offset + len(chunk.data)
                if (
                    i >= len(ids)
                    or (chunk.block_id, chunk.offset) != (ids[i], expected_offset)
                    or not chunk.data
                    or end > chunk.block_bytes
                ):
                    want = f"block {ids[i]} at offset {expected_offset}" if i < len(ids) else "end"
                    raise self._error(
                        grpc.StatusCode.DATA_LOSS,
                        f"expected {want}, got {len(chunk.data)} bytes of block "
                        f"{chunk.block_id} at offset {chunk.offset}",
                    )
                yield chunk
                i, expected_offset = (i + 1, 0) if chunk.last else (i, end)
        except grpc.RpcError as exc:
            raise self._error(exc.code(), exc.details() or "") from None
        finally:
            self._call.cancel()  # no-op once the call has ended
        if i < len(ids):
            raise self._error(
                grpc.StatusCode.DATA_LOSS, f"stream ended after {i} of {len(ids)} blocks"
            )

    def _decode(self, message: bytes) -> BlockChunk:
        try:
            return decode_block_data(message)
        except ValueError as exc:
            raise self._error(grpc.StatusCode.DATA_LOSS, str(exc)) from None

    def _error(self, code: grpc.StatusCode, message: str) -> SideChannelError:
        return SideChannelError(code, message, self._target)


class SideChannelClient:
    """Calls one engine's side channel. Thread-safe; every call has a deadline."""

    def __init__(
        self,
        host: str,
        port: int,
        secret: str,
        timeout_s: float = 10.0,
        tls: SideChannelTLS | None = None,
    ) -> None:
        self.target = f"{grpc_host(host)}:{port}"
        self.timeout_s = timeout_s
        self.remote: HandshakeReply | None = None  # set by handshake()
        self._metadata = ((SECRET_METADATA_KEY, secret),)
        self._channel = client_channel(self.target, tls, _CLIENT_OPTIONS)
        self._stub = pb_grpc.KVTransferStub(self._channel)
        # Serialized BlockData, parsed by BlockStream without copying the data.
        self._read_blocks = self._channel.unary_stream(
            f"/{SERVICE}/ReadBlocks", request_serializer=pb.ReadBlocksRequest.SerializeToString
        )

    def handshake(
        self,
        engine_id: str,
        compat_hash: str,
        transport: str,
        expected_engine_id: str = "",
        timeout_s: float | None = None,
    ) -> HandshakeReply:
        request = pb.HandshakeRequest(
            engine_id=engine_id,
            compatibility_hash=compat_hash,
            transport=transport,
            expected_engine_id=expected_engine_id,
        )
        r = self._unary(self._stub.Handshake, request, timeout_s)
        self.remote = HandshakeReply(
            r.engine_id,
            r.compatibility_hash,
            r.transport,
            r.transport_metadata,
            r.num_blocks,
            r.block_bytes,
            tuple(zip(r.shard_heads[::2], r.shard_heads[1::2], strict=True)),
        )
        return self.remote

    def renew_lease(self, lease_id: str, timeout_s: float | None = None) -> float:
        """Seconds until the renewed lease expires."""
        request = pb.LeaseRequest(lease_id=lease_id)
        return float(self._unary(self._stub.RenewLease, request, timeout_s).expires_in_seconds)

    def release(self, lease_id: str, timeout_s: float | None = None) -> bool:
        """True when this call ended a live lease (False: already ended or unknown)."""
        request = pb.LeaseRequest(lease_id=lease_id)
        return bool(self._unary(self._stub.Release, request, timeout_s).released)

    def lend_prefix(self, block_hashes: list[bytes]) -> LendReply:
        """Borrow the engine's cached blocks for the leading run of `block_hashes`."""
        r = self._unary(self._stub.LendPrefix, pb.LendPrefixRequest(block_hashes=block_hashes))
        return LendReply(
            r.engine_id,
            r.request_id,
            [int(b) for b in r.block_ids],
            r.lease_id,
            float(r.expires_in_seconds),
            [to_hex(c) for c in r.block_checksums],
        )

    def open_read(
        self, lease_id: str, block_ids: list[int], timeout_s: float | None = None, shard: int = 0
    ) -> BlockStream:
        """Start ReadBlocks (of the engine's `shard`); the deadline (default timeout_s) covers
        the whole stream."""
        request = pb.ReadBlocksRequest(lease_id=lease_id, block_ids=block_ids, shard=shard)
        call = self._read_blocks(
            request, metadata=self._metadata, timeout=timeout_s or self.timeout_s
        )
        return BlockStream(call, list(block_ids), self.target)

    def read_blocks(
        self, lease_id: str, block_ids: list[int], timeout_s: float | None = None
    ) -> Iterator[tuple[int, bytes]]:
        """(block_id, whole block bytes) in request order."""
        parts: list[memoryview] = []
        for chunk in self.open_read(lease_id, block_ids, timeout_s):
            parts.append(chunk.data)
            if chunk.last:
                yield chunk.block_id, b"".join(parts)
                parts = []

    def close(self) -> None:
        self._channel.close()

    def _unary(self, method: Any, request: Any, timeout_s: float | None = None) -> Any:
        try:
            return method(request, metadata=self._metadata, timeout=timeout_s or self.timeout_s)
        except grpc.RpcError as exc:
            raise SideChannelError(exc.code(), exc.details() or "", self.target) from None
