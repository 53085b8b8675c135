"""KV cache events: what entered and left the prefix cache, for external indexers/routers.

Events are per block: a hash that two blocks hold is stored twice and removed twice. `medium`
says where: "primary" (the engine's pool) or a KV tier below it ("cpu", "disk":
engine/offload/), whose blocks the engine can also serve (loaded back before use), so a
router counts a hash held while any medium holds it."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import NamedTuple


@dataclass(frozen=True)
class BlockStored:
    """Full blocks that became reusable prefix-cache entries, in sequence order."""

    block_hashes: list[bytes]
    parent_block_hash: bytes | None
    token_ids: list[int]
    block_size: int
    medium: str = "primary"


@dataclass(frozen=True)
class BlockRemoved:
    """Cache entries that are gone (evicted for reuse or dropped as invalid)."""

    block_hashes: list[bytes]
    medium: str = "primary"


@dataclass(frozen=True)
class AllBlocksCleared:
    """The whole prefix cache was reset."""


KVCacheEvent = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(frozen=True)
class KVEventBatch:
    """The events of one engine since its previous batch, in order. `seq` numbers an engine's
    batches from 0 without gaps within one `epoch` (a start of the engine): a reader that sees
    a number out of turn knows it lost events."""

    epoch: str
    seq: int
    events: tuple[KVCacheEvent, ...]


@dataclass(frozen=True)
class KVSnapshot:
    """The hash of every block in an engine's prefix cache now (a hash twice when two blocks
    hold it: events are per block), a tier's below the pool included; those of a tier again
    in `tier_block_hashes`. It covers every event before the batch numbered `next_seq`, and
    no later one."""

    epoch: str
    next_seq: int
    block_hashes: tuple[bytes, ...]
    tier_block_hashes: tuple[bytes, ...] = ()


class EngineLoad(NamedTuple):
    """The work an engine has ahead of it, for KV-aware routers (read on the engine thread).
    A tuple: the routing searches in C read its first four fields by position
    (deployments/cluster/csrc/search.h), a router's costs at 128 replicas being mostly
    reads of loads."""

    num_running: int
    num_waiting: int
    queued_prompt_tokens: int  # prompt tokens of unfinished requests not yet computed
    kv_cache_usage: float
    # Mean time to first token and per output token of the requests the replica finished
    # lately (its serving layer adds them: role switching weighs them against SLO targets);
    # None without any.
    ttft_s: float | None = None
    tpot_s: float | None = None


class KVEventStream:
    """An engine's prefix-cache events, numbered for publishing (a router-side index applies
    them: deployments/cluster/kv_index.py). Called from the engine's own thread."""

    def __init__(
        self,
        take_events: Callable[[], list[KVCacheEvent]],
        cached: Callable[[], Iterable[bytes]],
        cached_in_tiers: Callable[[], Iterable[bytes]] = tuple,
    ) -> None:
        """`cached`: every hash held (per block, the tiers' too); `cached_in_tiers`: those of
        the tiers below the pool."""
        self.epoch = uuid.uuid4().hex
        self._take_events = take_events
        self._cached = cached
        self._cached_in_tiers = cached_in_tiers
        self._next_seq = 0

    def take_batch(self) -> KVEventBatch | None:
        """The events since the last batch, or None when there are none."""
        events = self._take_events()
        if not events:
            return None
        batch = KVEventBatch(self.epoch, self._next_seq, tuple(events))
        self._next_seq += 1
        return batch

    def snapshot(self) -> KVSnapshot:
        """The cache as it is; events not yet taken are in it, so they are dropped (a reader
        that applied them on top would count their blocks twice)."""
        self._take_events()
        return KVSnapshot(
            self.epoch, self._next_seq, tuple(self._cached()), tuple(self._cached_in_tiers())
        )
