"""NIXL KV transport: one-sided READs of block runs from a peer's registered cache.

The whole cache is registered once. A read becomes one NIXL descriptor per run of consecutive
block ids on both sides (`contiguous_runs`), so the blocks of one prompt usually move as a single
descriptor. On one host UCX serves the READ with CMA (`process_vm_readv`): zero-copy, performed
by the reader's thread inside `transfer`; the peer's CPU does nothing once connected.

Fault injection (tests): `inject_failure(n)`, or the environment variable
PDSERVE_NIXL_FAIL_AFTER_DESCRIPTORS=n read when the transport is built, arms a one-shot failure:
the next read with at least one block posts only its first n descriptors (runs) and is then
reported failed by `poll`, like a read broken mid-way (some blocks written, the rest not).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from connector.nixl_regions import CacheRegion, PeerMetadata, region_of
from connector.transport import (
    BlockRead,
    KVTransport,
    TransferResults,
    as_shards,
    contiguous_runs,
    destination,
)

if TYPE_CHECKING:
    from nixl._api import nixl_agent, nixl_xfer_handle

logger = logging.getLogger(__name__)

FAIL_AFTER_DESCRIPTORS_ENV = "PDSERVE_NIXL_FAIL_AFTER_DESCRIPTORS"
DEFAULT_READ_TIMEOUT_S = 60.0
_CANCEL_GRACE_S = 5.0  # a cancelled read still in flight this long is released, reported
# Idle wait of NIXL's UCX progress thread, in microseconds. The thread wakes on UCX events, so
# this only bounds how late it notices one it missed. NIXL's Python wrapper pins it to 0, which
# makes the thread busy-poll: a whole core per engine, measured at 100% CPU with no transfer.
PROGRESS_THREAD_DELAY_US = 10_000


@dataclass
class NixlTransferStats:
    """Totals since start-up; the bench reads descriptors per block from them."""

    reads: int = 0
    blocks: int = 0
    descriptors: int = 0
    bytes: int = 0
    failed: int = 0


@dataclass
class _Read:
    handle: nixl_xfer_handle | None  # None once nothing more can be written locally
    deadline: float  # time.monotonic() after which the read is aborted
    failure: str | None = None  # set before the end: post error, injected failure, cancel
    staging: Any = None  # the registration of the read's staging tensor, dropped at its end


def _fail_after_from_env() -> int | None:
    raw = os.environ.get(FAIL_AFTER_DESCRIPTORS_ENV, "").strip()
    if not raw:
        return None
    if not raw.isdigit():
        raise ValueError(f"{FAIL_AFTER_DESCRIPTORS_ENV} must be an integer >= 0, got {raw!r}")
    return int(raw)


def _import_nixl() -> None:
    """Import NIXL's wrapper, undoing what its import does to the process's logging.

    The wrapper configures a "nixl" logger that writes INFO lines to stdout and does not
    propagate ("NIXL INFO _api.py:281 Initialized NIXL agent ..."), which breaks any program
    whose stdout is its output (JSON from a benchmark, a CLI's answer). Its records go
    through the application's logging instead, at the application's level (stderr unless
    configured otherwise). It also sets the global `logging.raiseExceptions`; the
    application's value is kept.
    """
    raise_exceptions = logging.raiseExceptions
    import nixl._api  # noqa: F401 - configures the "nixl" logger on first import

    logging.raiseExceptions = raise_exceptions
    nixl_logger = logging.getLogger("nixl")
    for handler in list(nixl_logger.handlers):
        nixl_logger.removeHandler(handler)
    nixl_logger.propagate = True
    if not os.environ.get("NIXL_LOG_LEVEL"):  # NIXL's own knob still works when set
        nixl_logger.setLevel(logging.NOTSET)  # the application's level decides


def _create_agent(name: str) -> nixl_agent:
    _import_nixl()
    from nixl import _bindings
    from nixl._api import nixl_agent, nixl_agent_config

    # The wrapper is built without backends and then given a core agent configured here, as its
    # own configuration cannot set the progress thread's idle wait (PROGRESS_THREAD_DELAY_US).
    # The thread is needed: a peer must answer UCX wireup before the first READ completes, and
    # an idle prefill engine calls nothing that would make its agent progress.
    agent = nixl_agent(name, nixl_agent_config(enable_prog_thread=False, backends=[]))
    config = _bindings.nixlAgentConfig()
    config.useProgThread = True
    config.useListenThread = False
    config.syncMode = _bindings.NIXL_THREAD_SYNC_NONE  # calls are serialized by our lock
    config.pthrDelay = PROGRESS_THREAD_DELAY_US
    agent.agent = _bindings.nixlAgent(name, config)
    agent.plugin_list = agent.agent.getAvailPlugins()
    if "UCX" not in agent.plugin_list:
        raise RuntimeError(f"NIXL has no UCX plugin (available: {agent.plugin_list})")
    agent.create_backend("UCX", {})
    return agent


def _check_pairing(read: BlockRead) -> None:
    if len(read.local_block_ids) != len(read.remote_block_ids):
        raise ValueError(
            f"read {read.transfer_id}: {len(read.local_block_ids)} local block ids for "
            f"{len(read.remote_block_ids)} remote ones"
        )
    if len(set(read.local_block_ids)) != len(read.local_block_ids):
        raise ValueError(f"read {read.transfer_id}: a local block id appears twice")


class NixlTransport(KVTransport):
    """KV transport over NIXL (UCX backend); the decode side READs from the prefill side."""

    name = "nixl"

    def __init__(self, agent_name: str, read_timeout_s: float = DEFAULT_READ_TIMEOUT_S) -> None:
        if not agent_name:
            raise ValueError("agent_name must be non-empty")
        if read_timeout_s <= 0:
            raise ValueError(f"read_timeout_s must be > 0, got {read_timeout_s}")
        self.agent_name = agent_name
        self.read_timeout_s = read_timeout_s
        self.last_num_descriptors = 0  # descriptors of the latest start_read
        self.stats = NixlTransferStats()
        self._fail_after: int | None = _fail_after_from_env()
        self._lock = threading.Lock()  # NIXL runs unsynchronized (NIXL_THREAD_SYNC_NONE)
        self._agent: nixl_agent | None = _create_agent(agent_name)
        self._kv_caches: list[torch.Tensor] = []  # keeps the registered storage alive
        self._registrations: list[Any] = []
        self._regions: list[CacheRegion] = []
        self._metadata: bytes | None = None
        self._peers: dict[str, PeerMetadata] = {}
        self._reads: dict[str, _Read] = {}

    # -- set-up -------------------------------------------------------------------------------

    def register(self, kv_cache: torch.Tensor | Sequence[torch.Tensor]) -> None:
        with self._lock:
            agent = self._require_agent()
            if self._regions:
                raise RuntimeError("the KV cache is already registered")
            shards = as_shards(kv_cache)
            regions = [region_of(shard) for shard in shards]
            for shard in shards:
                self._registrations.append(agent.register_memory(shard))
            self._kv_caches = shards
            self._regions = regions
            # Taken after registering: the agent metadata carries the remote keys of our memory.
            local = PeerMetadata(self.agent_name, agent.get_agent_metadata(), tuple(regions))
            self._metadata = local.to_bytes()

    def local_metadata(self) -> bytes:
        metadata = self._metadata
        if metadata is None:
            raise RuntimeError("register the KV cache before asking for its metadata")
        return metadata

    def add_remote(self, engine_id: str, metadata: bytes) -> None:
        peer = PeerMetadata.from_bytes(metadata)
        with self._lock:
            agent = self._require_agent()
            ours = self._require_regions()
            # Engines of as many shards hold the same heads in each: their blocks must match.
            # (Others are checked per read: a staging tensor takes the remote's shape.)
            theirs = [region.block_bytes for region in peer.regions]
            if len(theirs) == len(ours) and theirs != [region.block_bytes for region in ours]:
                raise ValueError(
                    f"engine {engine_id!r} has {theirs[0]}-byte blocks, we have "
                    f"{ours[0].block_bytes}: incompatible KV cache layouts"
                )
            known = self._peers.get(engine_id)
            if known == peer:
                return
            if peer.agent_name == self.agent_name:
                raise ValueError(
                    f"engine {engine_id!r} uses our own agent name {self.agent_name!r}"
                )
            if known is not None:
                # A restarted peer: its old memory is gone, forget it before loading the new one.
                del self._peers[engine_id]
                agent.remove_remote_agent(known.agent_name)
            agent.add_remote_agent(peer.agent_metadata)
            self._peers[engine_id] = peer

    def forget_remote(self, engine_id: str) -> None:
        """Drop a peer that is gone (restarted under a new engine id): its agent's metadata."""
        with self._lock:
            peer = self._peers.pop(engine_id, None)
            if peer is not None and self._agent is not None:
                self._agent.remove_remote_agent(peer.agent_name)

    # -- reads --------------------------------------------------------------------------------

    def inject_failure(self, after: int) -> None:
        """Make the next non-empty read post only `after` descriptors (runs), then fail."""
        if after < 0:
            raise ValueError(f"after must be >= 0, got {after}")
        with self._lock:
            self._fail_after = after

    def start_read(self, read: BlockRead) -> None:
        with self._lock:
            agent = self._require_agent()
            peer = self._peers.get(read.remote_engine_id)
            if peer is None:
                raise ValueError(
                    f"unknown remote engine {read.remote_engine_id!r}: add_remote first"
                )
            if read.transfer_id in self._reads:
                raise ValueError(f"read {read.transfer_id!r} is already in flight")
            _check_pairing(read)
            region = region_of(destination(read, self._require_caches()))
            remote = peer.region(read.remote_shard)
            if remote.block_bytes != region.block_bytes:
                raise ValueError(
                    f"engine {read.remote_engine_id!r} has {remote.block_bytes}-byte blocks "
                    f"where we read into {region.block_bytes}: incompatible KV cache layouts"
                )
            region.check_block_ids(read.local_block_ids, "local")
            remote.check_block_ids(read.remote_block_ids, f"remote ({read.remote_engine_id})")
            runs = contiguous_runs(read.local_block_ids, read.remote_block_ids)
            self._count(runs, region)
            deadline = time.monotonic() + self.read_timeout_s
            failure = None
            if runs and self._fail_after is not None:
                runs = runs[: self._fail_after]
                failure = f"injected failure after {len(runs)} descriptor(s)"
                self._fail_after = None
            # A staging tensor is registered for this read only (a few blocks, read once).
            # NIXL's errors share no base class below Exception: a RuntimeError here, with
            # nothing left registered, as every other refusal to start.
            staging = None
            try:
                staging = agent.register_memory(read.into) if read.into is not None else None
                posted = self._post(runs, region, peer.agent_name, remote, deadline, failure)
            except Exception as exc:
                if staging is not None:
                    self._best_effort(agent.deregister_memory, staging)
                raise RuntimeError(f"NIXL could not start the read: {exc}") from exc
            posted.staging = staging
            self._reads[read.transfer_id] = posted

    def poll(self) -> TransferResults:
        results = TransferResults()
        with self._lock:
            for transfer_id, read in list(self._reads.items()):
                if not self._has_stopped(read):
                    continue
                del self._reads[transfer_id]
                self._drop_staging(read)
                if read.failure is None:
                    results.done.add(transfer_id)
                else:
                    results.failed[transfer_id] = read.failure
                    self.stats.failed += 1
        return results

    def cancel(self, transfer_id: str) -> None:
        """Fail the read; reported once NIXL says it ended, or released (NIXL's abort, which
        UCX may not honour at once) after a grace: its blocks are not reused mid-write."""
        with self._lock:
            read = self._reads.get(transfer_id)
            if read is None:
                return  # unknown, or already reported
            read.failure = read.failure or "cancelled"
            read.deadline = min(read.deadline, time.monotonic() + _CANCEL_GRACE_S)

    def close(self) -> None:
        with self._lock:
            agent, self._agent = self._agent, None
            if agent is None:
                return
            for read in self._reads.values():
                self._release(read)
                if read.staging is not None:
                    self._best_effort(agent.deregister_memory, read.staging)
            self._reads.clear()
            for peer in self._peers.values():
                self._best_effort(agent.remove_remote_agent, peer.agent_name)
            self._peers.clear()
            for registration in self._registrations:
                self._best_effort(agent.deregister_memory, registration)
            self._registrations, self._kv_caches = [], []

    # -- internals ----------------------------------------------------------------------------

    def _post(
        self,
        runs: list[tuple[int, int, int]],
        region: CacheRegion,
        peer_agent: str,
        remote_region: CacheRegion,
        deadline: float,
        failure: str | None,
    ) -> _Read:
        """Create and post one READ, one descriptor per run; errors end up in `failure`."""
        if not runs:
            return _Read(None, deadline, failure)  # nothing to move: reported at the next poll
        agent = self._require_agent()
        local_runs = [region.run_desc(first, n) for first, _, n in runs]
        remote_runs = [remote_region.run_desc(first, n) for _, first, n in runs]
        local = agent.get_xfer_descs(local_runs, region.mem_type)
        remote = agent.get_xfer_descs(remote_runs, remote_region.mem_type)
        read = _Read(None, deadline, failure)
        try:
            # No notification: nobody on the prefill side drains them, they would pile up there.
            read.handle = agent.initialize_xfer("READ", local, remote, peer_agent, b"")
            state = agent.transfer(read.handle)
        except Exception as exc:  # NIXL's errors share no base class below Exception
            state = "ERR"
            read.failure = (
                read.failure or f"NIXL could not post the read: {type(exc).__name__}: {exc}"
            )
        if state == "ERR":
            read.failure = read.failure or "NIXL rejected the read (ERR at post)"
        if state != "PROC" and read.handle is not None:
            self._release(read)  # CMA reads usually finish inside transfer()
        return read

    def _has_stopped(self, read: _Read) -> bool:
        """Advance one read; True once nothing more will be written into its local blocks."""
        if read.handle is None:
            return True
        try:
            state = self._require_agent().check_xfer_state(read.handle)
        except Exception as exc:  # NIXL's errors share no base class below Exception
            state = "ERR"
            read.failure = read.failure or f"NIXL read failed: {type(exc).__name__}: {exc}"
        if state == "PROC":
            if time.monotonic() < read.deadline:
                return False
            read.failure = read.failure or f"timed out after {self.read_timeout_s:g} s"
            return self._release(read)  # stopped only if NIXL could abort it
        if state == "ERR":
            read.failure = read.failure or "NIXL reported the read failed (ERR)"
        self._release(read)
        read.handle = None  # finished either way; a failed release is only a leak
        return True

    def _release(self, read: _Read) -> bool:
        """Release (and so abort, if still active) a read's request; False if NIXL refused."""
        if read.handle is None:
            return True
        try:
            read.handle.release()
        except Exception as exc:  # NIXL's errors share no base class below Exception
            logger.warning("NIXL could not release a transfer request: %s", exc)
            return False
        read.handle = None
        return True

    def _count(self, runs: list[tuple[int, int, int]], region: CacheRegion) -> None:
        num_blocks = sum(length for _, _, length in runs)
        self.last_num_descriptors = len(runs)
        self.stats.reads += 1
        self.stats.blocks += num_blocks
        self.stats.descriptors += len(runs)
        self.stats.bytes += num_blocks * region.block_bytes

    @staticmethod
    def _best_effort(call: Any, *args: Any) -> None:
        try:
            call(*args)
        except Exception as exc:  # close() must get through every step
            logger.warning("NIXL clean-up step %s failed: %s", getattr(call, "__name__", call), exc)

    def _require_agent(self) -> nixl_agent:
        if self._agent is None:
            raise RuntimeError("the NIXL transport is closed")
        return self._agent

    def _drop_staging(self, read: _Read) -> None:
        if read.staging is not None and self._agent is not None:
            self._best_effort(self._agent.deregister_memory, read.staging)
        read.staging = None

    def _require_regions(self) -> list[CacheRegion]:
        if not self._regions:
            raise RuntimeError("register the KV cache first")
        return self._regions

    def _require_caches(self) -> list[torch.Tensor]:
        self._require_regions()
        return self._kv_caches
