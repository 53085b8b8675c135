"""The KVTransfer side channel (docs/ARCHITECTURE.md, "The KV flow"): handshake, leases, reads.

Every engine serves one. A finished prefill request's blocks stay held under a lease in the
`LeaseTable` until the reader releases it, the lease expires, or the request is cancelled; the
engine learns which requests' blocks it may free from `LeaseTable.take_finished()`.
`ReadBlocks` is the block pull of the gRPC transport (connector/grpc_transport.py).

Every call carries the shared secret as metadata `x-pdserve-secret`; with
`kv_transfer_config.tls` the channel is mutual TLS as well (a caller without a certificate the
shared CA signed does not get through the handshake). Refusals:
  wrong or missing secret                           UNAUTHENTICATED
  compatibility hash or transport mismatch          FAILED_PRECONDITION (both values shown)
  expected_engine_id is not this engine             NOT_FOUND
  unknown or released lease (renew, read)           NOT_FOUND
  expired lease (renew, read; also mid-stream)      FAILED_PRECONDITION "lease ... expired"
  a leased block freed or rewritten (renew, read)   FAILED_PRECONDITION "... rewritten ..."
  block id outside [0, num_blocks)                  OUT_OF_RANGE
  block id not under the lease                      PERMISSION_DENIED
  duplicate block ids                               INVALID_ARGUMENT
  LendPrefix on an engine that does not lend        FAILED_PRECONDITION
  LendPrefix without hashes                         INVALID_ARGUMENT
  LendPrefix on an engine whose loop has stopped    UNAVAILABLE
`Release` is idempotent: a released, expired or unknown lease is answered OK (released=False);
so is a lease with a block that was rewritten (a read that ended before is not to be used).
`LendPrefix` lends the blocks of a prompt's leading cached hashes under a new lease
(PDConnector.enable_prefix_lending); the reader then reads them like handed-off KV.

The client side is connector/side_channel_client.py; the hand-written BlockData framing both
ends share is connector/block_data.py.
"""

from __future__ import annotations

import hmac
import logging
from collections.abc import Callable, Iterator, Sequence
from concurrent import futures
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import grpc

from connector.block_data import encode_block_data
from connector.file_watch import FileWatch
from connector.leases import Lease, LeaseError, LeaseTable, no_generations
from connector.transport import as_shards
from engine.block_checksums import from_hex
from engine.config import KVTransferConfig, SideChannelTLS
from protos.pdserve.v1 import kv_transfer_pb2 as pb
from protos.pdserve.v1 import kv_transfer_pb2_grpc as pb_grpc

if TYPE_CHECKING:  # the client side (the router's lease calls) runs without torch
    import torch

logger = logging.getLogger(__name__)

SECRET_METADATA_KEY = "x-pdserve-secret"
SERVICE = "pdserve.v1.KVTransfer"
# Blocks larger than this travel as several BlockData messages; message limits leave headroom.
CHUNK_BYTES = 4 << 20
MAX_MESSAGE_BYTES = CHUNK_BYTES + (1 << 20)
# Device caches are staged to host memory a run of consecutive blocks at a time, up to this.
_STAGE_BYTES = 32 << 20

CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    # The largest HTTP/2 frame we accept (default 16 KiB): a 4 MiB chunk then travels in one
    # DATA frame instead of 256, which cut block reads' CPU per byte (bench kv: ~+15%).
    ("grpc.http2.max_frame_size", (1 << 24) - 1),
]
# How often a server looks at its certificate files on new connections (one stat each).
CERTIFICATE_CHECK_S = 1.0
# Clients ping (side_channel_client.py): the server must accept pings that often.
_SERVER_OPTIONS = [
    *CHANNEL_OPTIONS,
    ("grpc.http2.min_ping_interval_without_data_ms", 5_000),
    ("grpc.http2.max_ping_strikes", 0),
    # gRPC sets SO_REUSEPORT by default: a second server would silently share a fixed port.
    ("grpc.so_reuseport", 0),
]


def server_credentials(tls: SideChannelTLS) -> grpc.ServerCredentials:
    """Mutual TLS: the engine's certificate, and callers must show one the CA signed. The
    files are looked at again on new connections (at most once a second): a renewed
    certificate or CA (cert-manager rotating the mounted Secret) is served from then on,
    without a restart."""
    watch = CertificateWatch(tls)
    return grpc.dynamic_ssl_server_credentials(
        watch.configuration(), watch.fetch, require_client_authentication=True
    )


class CertificateWatch:
    """The server's certificate configuration, read again when one of its files changed
    (connector/file_watch.py); files that cannot be read keep the last good configuration."""

    def __init__(self, tls: SideChannelTLS, clock: Callable[[], float] | None = None) -> None:
        self._tls = tls
        self._watch = FileWatch(
            (tls.certfile, tls.keyfile, tls.ca_certs), CERTIFICATE_CHECK_S, clock
        )
        self._watch.accept(self._watch.stamp())  # what configuration() serves first

    def configuration(self) -> grpc.ServerCertificateConfiguration:
        cert, key, ca = self._tls.pem()
        return grpc.ssl_server_certificate_configuration([(key, cert)], root_certificates=ca)

    def fetch(self) -> grpc.ServerCertificateConfiguration | None:
        """gRPC's fetcher: a new configuration, or None to keep the current one."""
        stamp = self._watch.changed()
        if stamp is None:
            return None
        try:
            configuration = self.configuration()
        except ValueError as exc:  # mid-rotation, or gone: keep serving the last good one
            logger.warning("side channel TLS files unreadable, keeping the current ones: %s", exc)
            return None
        self._watch.accept(stamp)
        logger.info("side channel TLS certificate reloaded")
        return configuration


def client_channel(
    target: str, tls: SideChannelTLS | None, options: list[tuple[str, Any]]
) -> grpc.Channel:
    """A channel to an engine's side channel: plain, or mutual TLS checking `server_name`."""
    if tls is None:
        return grpc.insecure_channel(target, options=options)
    cert, key, ca = tls.pem()
    credentials = grpc.ssl_channel_credentials(ca, private_key=key, certificate_chain=cert)
    named = [*options, ("grpc.ssl_target_name_override", tls.server_name)]
    return grpc.secure_channel(target, credentials, options=named)


def block_bytes_view(kv_cache: torch.Tensor) -> torch.Tensor:
    """[num_blocks, block_bytes] uint8 view of a block-contiguous cache (same storage)."""
    if kv_cache.dim() < 1 or kv_cache.shape[0] == 0 or not kv_cache.is_contiguous():
        raise ValueError("kv_cache must be a contiguous [num_blocks, ...] tensor")
    flat = kv_cache.view(kv_cache.shape[0], -1)
    if flat.shape[1] == 0:
        raise ValueError("kv_cache blocks are empty")
    import torch

    return flat.view(torch.uint8)


# ----------------------------------------------------------------- BlockData, by hand
# ReadBlocks moves hundreds of MiB, and protobuf would copy each chunk once more on each side
# (into the message, out of it). So BlockData is written and read here in its own wire format
# (protobuf peers read and write the same bytes): the server copies the cache's bytes once,
# the client gets `data` as a view of the received message.


class SideChannelServer:
    """The KVTransfer service of one engine, on a grpc.server thread pool."""

    def __init__(
        self,
        config: KVTransferConfig,
        engine_id: str,
        compat_hash: str,
        kv_cache: torch.Tensor | Sequence[torch.Tensor],
        transport_metadata: bytes,
        transport_name: str,
        *,
        # Each shard's KV heads, (first, count), where the engine registered several.
        shard_heads: Sequence[tuple[int, int]] = (),
        # Each ReadBlocks stream holds a thread for its whole length (a reader runs up to 4):
        # room for several readers' streams and the short calls beside them (lease renewals
        # are reads' heartbeats, with a 0.75 s deadline — they must not queue behind streams).
        max_workers: int = 32,
        chunk_bytes: int = CHUNK_BYTES,
        generation_of: Callable[[int], int] = no_generations,
    ) -> None:
        if not 0 < chunk_bytes <= CHUNK_BYTES:
            raise ValueError(f"chunk_bytes must be in (0, {CHUNK_BYTES}], got {chunk_bytes}")
        if not config.secret:
            logger.warning("side channel of engine %s has no secret: anyone may call", engine_id)
        self.config = config
        self.engine_id = engine_id
        self.compat_hash = compat_hash
        self.caches = [block_bytes_view(shard) for shard in as_shards(kv_cache)]
        self.shard_heads = [head for pair in shard_heads for head in pair]
        self.num_blocks, self.block_bytes = self.caches[0].shape
        self.transport_metadata = transport_metadata
        self.transport_name = transport_name
        self.chunk_bytes = chunk_bytes
        # Leases fence reads on the engine's block generations (connector/leases.py).
        self.leases = LeaseTable(generation_of=generation_of)
        # Lends prefix-cache blocks ((block hashes, seconds to answer in) -> a loan, or None
        # when none are held); set by the engine that can (PDConnector.enable_prefix_lending).
        self.lender: Callable[[list[bytes], float], Loan | None] | None = None
        self._max_workers = max_workers
        self._server: Any = None

    def start(self) -> int:
        """Bind to side_channel_host:side_channel_port (0 = a free port); returns the port."""
        if self._server is not None:
            raise RuntimeError("side channel already started")
        server = grpc.server(
            futures.ThreadPoolExecutor(self._max_workers, thread_name_prefix="side-channel"),
            options=_SERVER_OPTIONS,
        )
        _add_servicer(_KVTransferServicer(self), server)
        address = f"{grpc_host(self.config.side_channel_host)}:{self.config.side_channel_port}"
        try:
            if self.config.tls is None:
                port = server.add_insecure_port(address)
            else:
                port = server.add_secure_port(address, server_credentials(self.config.tls))
        except RuntimeError as exc:
            raise OSError(f"side channel cannot bind {address}: {exc}") from exc
        if port == 0:
            raise OSError(f"side channel cannot bind {address}")
        server.start()
        self._server = server
        logger.info("side channel of engine %s listening on %s", self.engine_id, port)
        return int(port)

    def stop(self, grace_s: float = 1.0) -> None:
        if self._server is not None:
            self._server.stop(grace_s).wait()
            self._server = None

    def block_chunks(
        self, block_ids: list[int], shard: int = 0
    ) -> Iterator[tuple[int, int, memoryview]]:
        """(block_id, offset, bytes) in request order; device caches staged per run of blocks.
        The bytes are views of the cache (or of its staged host copy), not copies."""
        cache = self.caches[shard]
        block_bytes = cache.shape[1]
        per_stage = max(1, _STAGE_BYTES // block_bytes)
        i = 0
        while i < len(block_ids):
            n = 1
            while i + n < len(block_ids) and n < per_stage and block_ids[i + n] == block_ids[i] + n:
                n += 1
            staged = cache[block_ids[i] : block_ids[i] + n]
            host = staged if staged.device.type == "cpu" else staged.cpu()
            flat = host.numpy().data.cast("B")  # the run's bytes, no copy
            for k in range(n):
                for offset in range(0, block_bytes, self.chunk_bytes):
                    start = k * block_bytes + offset
                    end = min(start + self.chunk_bytes, (k + 1) * block_bytes)
                    yield block_ids[i + k], offset, flat[start:end]
            i += n


def _add_servicer(servicer: _KVTransferServicer, server: grpc.Server) -> None:
    """As pb_grpc.add_KVTransferServicer_to_server, but ReadBlocks yields serialized BlockData."""
    handlers = {
        "Handshake": grpc.unary_unary_rpc_method_handler(
            servicer.Handshake,
            request_deserializer=pb.HandshakeRequest.FromString,
            response_serializer=pb.HandshakeResponse.SerializeToString,
        ),
        "RenewLease": grpc.unary_unary_rpc_method_handler(
            servicer.RenewLease,
            request_deserializer=pb.LeaseRequest.FromString,
            response_serializer=pb.LeaseResponse.SerializeToString,
        ),
        "Release": grpc.unary_unary_rpc_method_handler(
            servicer.Release,
            request_deserializer=pb.LeaseRequest.FromString,
            response_serializer=pb.ReleaseResponse.SerializeToString,
        ),
        "ReadBlocks": grpc.unary_stream_rpc_method_handler(
            servicer.ReadBlocks, request_deserializer=pb.ReadBlocksRequest.FromString
        ),
        "LendPrefix": grpc.unary_unary_rpc_method_handler(
            servicer.LendPrefix,
            request_deserializer=pb.LendPrefixRequest.FromString,
            response_serializer=pb.LendPrefixResponse.SerializeToString,
        ),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
    server.add_registered_method_handlers(SERVICE, handlers)


def grpc_host(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


class _KVTransferServicer(pb_grpc.KVTransferServicer):
    def __init__(self, server: SideChannelServer) -> None:
        self.s = server
        self._secret = server.config.secret.encode()

    def _authorize(self, context: grpc.ServicerContext) -> None:
        given = dict(context.invocation_metadata()).get(SECRET_METADATA_KEY, "")
        if not hmac.compare_digest(str(given).encode(), self._secret):
            context.abort(grpc.StatusCode.UNAUTHENTICATED, f"bad or missing {SECRET_METADATA_KEY}")

    def Handshake(self, request: Any, context: grpc.ServicerContext) -> Any:
        self._authorize(context)
        s = self.s
        if request.expected_engine_id and request.expected_engine_id != s.engine_id:
            context.abort(
                grpc.StatusCode.NOT_FOUND,
                f"unknown engine {request.expected_engine_id!r}: this is engine {s.engine_id!r}",
            )
        if request.compatibility_hash != s.compat_hash:
            context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"compatibility hash mismatch: engine {request.engine_id!r} has "
                f"{request.compatibility_hash!r}, engine {s.engine_id!r} has {s.compat_hash!r}",
            )
        # ReadBlocks is always served, so a "grpc" reader works against any engine.
        if request.transport not in ("", "grpc", s.transport_name):
            context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"transport mismatch: engine {request.engine_id!r} uses {request.transport!r}, "
                f"engine {s.engine_id!r} uses {s.transport_name!r}",
            )
        return pb.HandshakeResponse(
            engine_id=s.engine_id,
            compatibility_hash=s.compat_hash,
            transport_metadata=s.transport_metadata,
            num_blocks=s.num_blocks,
            block_bytes=s.block_bytes,
            transport=s.transport_name,
            shard_heads=s.shard_heads,
        )

    def RenewLease(self, request: Any, context: grpc.ServicerContext) -> Any:
        self._authorize(context)
        try:
            lease = self.s.leases.renew(request.lease_id)
        except LeaseError as exc:
            context.abort(exc.code, str(exc))
        return pb.LeaseResponse(lease_id=lease.lease_id, expires_in_seconds=lease.lease_seconds)

    def Release(self, request: Any, context: grpc.ServicerContext) -> Any:
        self._authorize(context)
        return pb.ReleaseResponse(released=self.s.leases.release(request.lease_id))

    def ReadBlocks(self, request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
        self._authorize(context)
        block_ids = [int(b) for b in request.block_ids]
        outside = [b for b in block_ids if b >= self.s.num_blocks]
        if outside:
            context.abort(
                grpc.StatusCode.OUT_OF_RANGE,
                f"block ids {outside[:8]} outside [0, {self.s.num_blocks})",
            )
        if len(set(block_ids)) != len(block_ids):
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "duplicate block ids")
        if request.shard >= len(self.s.caches):
            context.abort(
                grpc.StatusCode.OUT_OF_RANGE,
                f"shard {request.shard} outside [0, {len(self.s.caches)})",
            )
        return self._stream(request.lease_id, block_ids, request.shard, context)

    def LendPrefix(self, request: Any, context: grpc.ServicerContext) -> Any:
        self._authorize(context)
        lender = self.s.lender
        if lender is None:
            context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"engine {self.s.engine_id!r} does not lend prefix blocks",
            )
            return None  # abort raised
        if not request.block_hashes:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "no block hashes")
        try:
            remaining = context.time_remaining()
            loan = lender(list(request.block_hashes), remaining if remaining else 5.0)
        except Exception as exc:  # the engine stopped: the caller recomputes instead
            logger.warning("lending a prefix failed: %r", exc)
            context.abort(grpc.StatusCode.UNAVAILABLE, "the engine cannot lend now")
            return None  # abort raised
        if loan is None:
            return pb.LendPrefixResponse(engine_id=self.s.engine_id)
        return pb.LendPrefixResponse(
            engine_id=self.s.engine_id,
            request_id=loan.lease.request_id,
            block_ids=loan.block_ids,
            lease_id=loan.lease.lease_id,
            expires_in_seconds=loan.lease.lease_seconds,
            block_checksums=[from_hex(c) for c in loan.checksums],
        )

    def _stream(
        self, lease_id: str, block_ids: list[int], shard: int, context: grpc.ServicerContext
    ) -> Iterator[Any]:
        # The lease is held from the first message on: the engine cannot free these blocks
        # (take_finished skips them) until this generator has stopped.
        leases = self.s.leases
        try:
            leases.open_read(lease_id, block_ids)
        except LeaseError as exc:
            context.abort(exc.code, str(exc))
        try:
            block_bytes = self.s.caches[shard].shape[1]
            for block_id, offset, data in self.s.block_chunks(block_ids, shard):
                message = encode_block_data(block_id, offset, data, block_bytes)
                # After the copy: the bytes sent are the block's as lent only if the lease
                # still holds it and it was not freed or rewritten meanwhile.
                leases.check_live(lease_id, (block_id,))
                yield message
        except LeaseError as exc:
            context.abort(exc.code, str(exc))
        finally:
            leases.close_read(lease_id)


@dataclass(frozen=True)
class Loan:
    """Prefix blocks an engine lends: the leading blocks it holds, in prompt order, under a
    lease of their own (the engine frees them when the lease is reported finished)."""

    block_ids: list[int]
    lease: Lease
    checksums: list[str]  # of the blocks as lent (engine/block_checksums.py)
