"""PDWorker: the connector's worker side — side channel, transport, leases, reads.

Every engine serves a KVTransfer side channel (it may be asked for its blocks: the producing
side, here) and can read from others (the consuming side, connector/kv_reads.py). Both share
one transport, registered over the engine's KV cache.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence

import torch

from connector.faults import NO_FAULTS, FaultyTransport
from connector.kv_reads import KVReads
from connector.kv_shards import ShardSet
from connector.leases import no_generations
from connector.metadata import ConnectorMetadata, RemoteKV, tokens_hash
from connector.side_channel import Loan, SideChannelServer
from connector.transport import KVTransport
from engine.config import KVTransferConfig
from engine.worker.kv_cache import KVShard

logger = logging.getLogger(__name__)


def make_transport(name: str, engine_id: str) -> KVTransport:
    if name == "nixl":
        from connector.nixl_transport import NixlTransport

        return NixlTransport(engine_id)
    from connector.grpc_transport import GrpcTransport

    return GrpcTransport()


class PDWorker:
    def __init__(self, config: KVTransferConfig, engine_id: str, compat_hash: str) -> None:
        self.config = config
        self.engine_id = engine_id
        self.compat_hash = compat_hash
        faults = config.fault_injection
        self.transport = make_transport(config.connector, engine_id)
        self._faulty: FaultyTransport | None = None
        if faults is not None and faults.rate > 0:
            self.transport = self._faulty = FaultyTransport(self.transport, faults)
        self.reads = KVReads(config, engine_id, compat_hash, self.transport)
        self.server: SideChannelServer | None = None
        self.port = 0
        self._shards: ShardSet | None = None
        # The engine's block generations (set by watch_generations): leases fence on them.
        self._generation_of: Callable[[int], int] = no_generations
        self._checksum_us = 0  # spent summing the blocks we hand out or lend

    @property
    def stats(self) -> dict[str, int]:
        """The reads' counters, kv_transfer_config.fault_injection's (data faults, each to be
        caught by its checksum; completions delayed, lost, remotes died mid-read) and, on the
        producing side, `generation_fences`: our leases found with a block freed or rewritten
        since it was lent (each fenced its reader's read), `leases_expired`: our leases that
        ran out before their reader released them, and `checksum_us_produced`: the
        microseconds spent summing the blocks handed out or lent (the reader's are
        `checksum_us_verified`)."""
        faults = self._faulty.counts() if self._faulty is not None else NO_FAULTS
        leases = self.server.leases if self.server is not None else None
        return {
            **self.reads.stats,
            **faults,
            "generation_fences": leases.fences if leases is not None else 0,
            "leases_expired": leases.expirations if leases is not None else 0,
            "checksum_us_produced": self._checksum_us,
        }

    # ------------------------------------------------------------------ set-up

    def register(self, kv_cache: torch.Tensor | Sequence[KVShard]) -> None:
        """The engine's cache, or each rank's shard of it (connector/kv_shards.py)."""
        shards = self._shards = ShardSet(kv_cache)
        self.transport.register(shards.caches)
        self.reads.register(shards)
        self.server = SideChannelServer(
            self.config,
            self.engine_id,
            self.compat_hash,
            shards.caches,
            self.transport.local_metadata(),
            self.transport.name,
            shard_heads=shards.ranges,
            generation_of=lambda block_id: self._generation_of(block_id),
        )
        self.port = self.server.start()

    def watch_generations(self, generation_of: Callable[[int], int]) -> None:
        self._generation_of = generation_of

    # ------------------------------------------------------------------ producing side

    def lease_blocks(self, request_id: str, block_ids: list[int], token_ids: list[int]) -> RemoteKV:
        """Hold the blocks for a reader; `token_ids` are those whose KV the blocks hold."""
        assert self.server is not None, "register() first"
        checksums = self.checksums(block_ids)  # first: a lease is never left without its owner
        lease = self.server.leases.add(request_id, block_ids, self.config.lease_seconds)
        return RemoteKV(
            engine_id=self.engine_id,
            request_id=request_id,
            block_ids=list(block_ids),
            host=self.config.side_channel_host,
            port=self.port,
            lease_id=lease.lease_id,
            num_tokens=len(token_ids),
            tokens_hash=tokens_hash(token_ids),
            block_checksums=checksums,
            compat_hash=self.compat_hash,
        )

    def checksums(self, block_ids: list[int]) -> list[str]:
        """Of our blocks as they are now (the producer's side of the verification)."""
        assert self._shards is not None, "register() first"
        started = time.perf_counter()
        sums = self._shards.checksums(block_ids)
        self._checksum_us += round((time.perf_counter() - started) * 1e6)
        return sums

    def serve_loans(self, lend: Callable[[list[bytes], float], Loan | None]) -> None:
        """Answer LendPrefix calls with `lend` (set once the engine can pin blocks)."""
        assert self.server is not None, "register() first"
        self.server.lender = lend

    def lease_lent_blocks(self, lease_request_id: str, block_ids: list[int]) -> Loan:
        """Lent prefix blocks under a lease of their own (`lease_request_id` names it)."""
        assert self.server is not None, "register() first"
        checksums = self.checksums(block_ids)
        lease = self.server.leases.add(lease_request_id, block_ids, self.config.lease_seconds)
        return Loan(list(block_ids), lease, checksums)

    def cancel_lease(self, request_id: str) -> None:
        if self.server is not None:
            self.server.leases.cancel_request(request_id)

    # ------------------------------------------------------------------ consuming side

    def start(self, meta: ConnectorMetadata) -> None:
        self.reads.start(meta)

    def get_finished(self) -> tuple[set[str], set[str]]:
        """(leases whose readers are done with them, loads that ended) since the last call."""
        done_recving = self.reads.get_finished()
        done_sending = self.server.leases.take_finished() if self.server else set()
        return done_sending, done_recving

    def take_invalid_block_ids(self) -> set[int]:
        return self.reads.take_invalid_block_ids()

    def take_load_problems(self) -> dict[str, str]:
        return self.reads.take_load_problems()

    def has_pending(self) -> bool:
        leases = self.server.leases.num_active if self.server is not None else 0
        return self.reads.has_pending() or leases > 0

    def close(self) -> None:
        self.reads.close()
        if self.server is not None:
            self.server.stop()
        self.transport.close()
