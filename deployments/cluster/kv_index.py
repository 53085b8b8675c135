"""The cluster's KV index: which engine replica holds which prefix-cache blocks.

Engines number their prefix cache's events in batches (engine/core/kv_events.py:
`KVEventStream`), one numbering per engine start (an epoch). The index applies them per
replica into a count of blocks per block hash (events are per block: two blocks may hold one
hash), and keeps per hash the replicas holding it. Block hashes are chained — each covers
every token before it — so the blocks of a prompt that a replica can reuse are the leading run
of the prompt's hashes it holds, which is what the engine's own lookup finds (`match`): one
walk of the prompt's hashes, narrowing the replicas still holding every block so far, done
where none holds the next (not one walk per replica: at 128 replicas and 1,000-block prompts
that was about 7x slower, `pdserve bench index`; `tests/unit/test_kv_index.py` keeps the two
equal).

Lost or late events never corrupt it silently. A batch numbered out of turn (events were
lost) or from an epoch the index has not seen (the replica restarted) makes the replica stale:
its entries are dropped, it matches nothing, and `apply` says a snapshot is needed. A snapshot
(every hash the engine holds, and the number of the first batch it does not cover) makes the
replica current again; batches it covers are ignored when they arrive late. A replica that is
no longer running is forgotten (`forget`: a replica that stops says so; a request router that sees
a replica gone from its set says so for it).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from deployments.cluster.kv_scoring import NOTHING_HELD, CacheSurvey, Holding, survey
from deployments.cluster.role_balance import ReplicaState, RoleOrders
from engine.core.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EngineLoad,
    KVEventBatch,
    KVSnapshot,
)

logger = logging.getLogger(__name__)


@dataclass
class _Replica:
    epoch: str = ""
    next_seq: int = 0
    stale: bool = True  # nothing trusted until a snapshot, or batches from number 0
    blocks: Counter[bytes] = field(default_factory=Counter)  # every medium's
    tier: Counter[bytes] = field(default_factory=Counter)  # those in a tier below the pool


class PrefixIndex:
    """Per replica its blocks (a count per hash), and per hash the replicas holding it: a
    lookup walks the prompt's hashes once, whatever the number of replicas, and stops where
    no replica holds the next block."""

    def __init__(self) -> None:
        self._replicas: dict[str, _Replica] = {}
        self._holders: dict[bytes, set[str]] = {}  # current replicas only
        # Per hash the replicas that hold it in a tier only (not in their pool): a hit
        # there is loaded back before use, and routing credits it less (kv_scoring).
        self._tier_only: dict[bytes, set[str]] = {}

    @property
    def replicas(self) -> list[str]:
        return list(self._replicas)

    def is_current(self, replica: str) -> bool:
        state = self._replicas.get(replica)
        return state is not None and not state.stale

    def apply(self, replica: str, batch: KVEventBatch) -> bool:
        """Apply one batch of `replica`'s events. False: the replica is stale (a gap, or a new
        epoch that does not start at batch 0) and needs `load_snapshot`."""
        state = self._replicas.setdefault(replica, _Replica())
        if batch.epoch == state.epoch and batch.seq < state.next_seq:
            return not state.stale  # already covered (by a snapshot, or seen before)
        if batch.epoch != state.epoch and batch.seq == 0:
            # A fresh start whose first batch arrived: nothing before it to miss.
            self._clear(replica, state)
            state.epoch, state.next_seq, state.stale = batch.epoch, 0, False
        if batch.epoch != state.epoch or batch.seq != state.next_seq or state.stale:
            self._clear(replica, state)
            state.epoch, state.stale = batch.epoch, True
            return False
        self._apply_events(replica, state, batch)
        state.next_seq += 1
        return True

    def load_snapshot(self, replica: str, snapshot: KVSnapshot) -> None:
        state = self._replicas.setdefault(replica, _Replica())
        self._clear(replica, state)
        state.epoch, state.next_seq, state.stale = snapshot.epoch, snapshot.next_seq, False
        self._store(replica, state, snapshot.block_hashes)
        for block_hash in snapshot.tier_block_hashes:
            state.tier[block_hash] += 1
            self._mark_tier_only(replica, state, block_hash)

    def match(self, block_hashes: Sequence[bytes]) -> dict[str, int]:
        """Per replica: how many leading blocks of a prompt (its chained hashes) it holds;
        stale replicas count 0."""
        return {**dict.fromkeys(self._replicas, 0), **self.match_held(block_hashes)}

    def match_held(self, block_hashes: Sequence[bytes]) -> dict[str, int]:
        """`match`, for the replicas holding at least the prompt's first block only."""
        out: dict[str, int] = {}
        alive: set[str] | None = None  # the replicas holding every block so far
        depth = 0
        for block_hash in block_hashes:
            holders = self._holders.get(block_hash)
            if not holders:
                break
            if alive is None:
                alive = set(holders)
            elif not alive <= holders:
                for replica in alive - holders:
                    out[replica] = depth
                alive &= holders
                if not alive:
                    return out
            depth += 1
        for replica in alive or ():
            out[replica] = depth
        return out

    def tier_only_blocks(self, replica: str, block_hashes: Sequence[bytes]) -> int:
        """How many of `block_hashes` `replica` holds in a tier only (the leading run that
        `match` counted for it: the blocks it would load back rather than find in its pool)."""
        tier_only = self._tier_only
        if not tier_only:  # no tier anywhere: nothing to look up
            return 0
        return sum(1 for h in block_hashes if replica in tier_only.get(h, ()))

    def forget(self, replica: str) -> None:
        state = self._replicas.pop(replica, None)
        if state is not None:
            self._clear(replica, state)

    def num_entries(self) -> int:
        """(hash, replica) pairs held: what the index's memory grows with."""
        return sum(len(holders) for holders in self._holders.values())

    def _apply_events(self, replica: str, state: _Replica, batch: KVEventBatch) -> None:
        for event in batch.events:
            if isinstance(event, BlockStored):
                self._store(replica, state, event.block_hashes, event.medium != "primary")
            elif isinstance(event, BlockRemoved):
                self._remove(replica, state, event.block_hashes, event.medium != "primary")
            elif isinstance(event, AllBlocksCleared):
                self._clear(replica, state)

    def _store(
        self, replica: str, state: _Replica, block_hashes: Iterable[bytes], in_tier: bool = False
    ) -> None:
        holders, blocks, tier = self._holders, state.blocks, state.tier
        for block_hash in block_hashes:
            count = blocks[block_hash]
            blocks[block_hash] = count + 1
            if not count:
                holders.setdefault(block_hash, set()).add(replica)
            if in_tier:
                tier[block_hash] += 1
            if tier:  # a pool without a tier skips this
                self._mark_tier_only(replica, state, block_hash)

    def _remove(
        self, replica: str, state: _Replica, block_hashes: Iterable[bytes], in_tier: bool
    ) -> None:
        blocks, tier = state.blocks, state.tier
        for block_hash in block_hashes:
            if _count_down(blocks, block_hash):
                self._unhold(replica, block_hash)
            if in_tier:
                _count_down(tier, block_hash)
            if tier or in_tier:
                self._mark_tier_only(replica, state, block_hash)

    def _mark_tier_only(self, replica: str, state: _Replica, block_hash: bytes) -> None:
        """Note whether `replica` now holds `block_hash` in a tier and not in its pool."""
        held = state.blocks.get(block_hash, 0)
        if held and state.tier.get(block_hash, 0) >= held:
            self._tier_only.setdefault(block_hash, set()).add(replica)
            return
        replicas = self._tier_only.get(block_hash)
        if replicas is not None:
            replicas.discard(replica)
            if not replicas:
                del self._tier_only[block_hash]

    def _unhold(self, replica: str, block_hash: bytes) -> None:
        holders = self._holders.get(block_hash)
        if holders is not None:
            holders.discard(replica)
            if not holders:
                del self._holders[block_hash]

    def _clear(self, replica: str, state: _Replica) -> None:
        for block_hash in state.blocks:
            self._unhold(replica, block_hash)
        tier = state.tier
        state.blocks.clear()
        for block_hash in list(tier):
            tier.pop(block_hash)
            self._mark_tier_only(replica, state, block_hash)


def _count_down(counts: Counter[bytes], block_hash: bytes) -> bool:
    """One block fewer holds `block_hash`: True when that was the last one."""
    left = counts[block_hash] - 1
    if left > 0:
        counts[block_hash] = left
        return False
    return counts.pop(block_hash, None) is not None


@dataclass(frozen=True)
class PublishReply:
    current: bool  # False: the replica must send a snapshot (as `apply` answers)
    switch_to: str  # the role the replica is ordered to take ("" for none)


@dataclass
class _Announced:
    role: str = ""
    side_channel: str = ""  # "host:port" it lends prefixes from ("" without KV transfer)
    load: EngineLoad | None = None
    previous_role: str = ""  # before its last switch (its requests of that role drain)
    switched_at: float = float("-inf")


_UNANNOUNCED = _Announced()


class KVIndexServer:
    """The app's one KV index, as a Ray actor: engine replicas push their batches, snapshots
    and load (`KVEventPublisher`), the request routers of both legs ask it per request.

    Why an actor: one copy that every router replica shares and every engine reaches through
    Ray, with no fan-out of events to each router; a router's question is one actor call
    (~1 ms against a prefill of tens of ms). It is detached so that it outlives the replica
    that happened to create it; when it is lost all the same, engines re-announce themselves
    with snapshots and routers fall back to power of two choices meanwhile."""

    def __init__(self) -> None:
        self.index = PrefixIndex()
        # What each replica announced with its snapshot and its latest load, by replica.
        self.replicas: dict[str, _Announced] = {}
        # Per role ("": all) each replica's holding of a prompt it holds nothing of, kept as
        # loads change: a lookup copies these and replaces the few replicas that hold blocks.
        self._idle: dict[str, dict[str, Holding]] = {"": {}}
        self.roles = RoleOrders()  # role switching: orders, and the balancer deciding them

    def apply(
        self, replica: str, batches: list[KVEventBatch], load: EngineLoad | None = None
    ) -> bool:
        """False: the replica must send a snapshot (also for a replica the index does not
        know: an index that restarted learns of idle replicas from their heartbeats)."""
        announced = self.replicas.get(replica)
        if announced is not None and load is not None and load != announced.load:
            announced.load = load
            self._announce(replica, announced)
        ok = announced is not None
        for batch in batches:
            ok = self.index.apply(replica, batch) and ok
        if announced is None and replica in self.index.replicas:
            self._idle[""].setdefault(replica, NOTHING_HELD)
        return ok and self.index.is_current(replica)

    def load_snapshot(
        self,
        replica: str,
        snapshot: KVSnapshot,
        role: str = "",
        load: EngineLoad | None = None,
        side_channel: str = "",
        role_switching: dict[str, Any] | None = None,
        now: float | None = None,
    ) -> None:
        """A replica (re)announces itself: its whole cache, its role, where it lends from, and
        the app's `role_switching` spec (None: the app does not switch roles)."""
        self.index.load_snapshot(replica, snapshot)
        self.roles.configure(role_switching)
        self.roles.announced(replica, role)
        announced = _Announced(role, side_channel, load)
        previous = self.replicas.get(replica)
        if previous is not None:  # what it drains stays known across re-announcements
            announced.previous_role = previous.previous_role
            announced.switched_at = previous.switched_at
        if previous is not None and previous.role != role:  # a switch
            self._idle.get(previous.role, {}).pop(replica, None)
            announced.previous_role = previous.role
            announced.switched_at = time.monotonic() if now is None else now
        self.replicas[replica] = announced
        self._announce(replica, announced)

    def lookup(self, block_hashes: list[bytes], role: str = "") -> dict[str, Holding]:
        """Per replica (of `role`, or all): the prompt's leading blocks it holds, its load."""
        holdings = dict(self._idle.get(role, {}))
        for replica, count in self.index.match_held(block_hashes).items():
            announced = self.replicas.get(replica, _UNANNOUNCED)
            if not role or announced.role == role:
                in_tier = self.index.tier_only_blocks(replica, block_hashes[:count])
                holdings[replica] = Holding(
                    count, announced.load, announced.role, announced.side_channel, in_tier
                )
        return holdings

    def publish(
        self,
        replica: str,
        batches: list[KVEventBatch],
        load: EngineLoad | None = None,
        now: float | None = None,
    ) -> PublishReply:
        """An engine's round (KVEventPublisher): `apply`, and the role it is ordered to take
        ("" for none) — decided now where the app switches roles (deployments/cluster/
        role_balance.py), or ordered by an operator (`order_switch`)."""
        current = self.apply(replica, batches, load)
        now = time.monotonic() if now is None else now
        states = functools.partial(self._states, now)
        return PublishReply(current, self.roles.round(replica, states, now))

    def _states(self, now: float, drain_s: float) -> dict[str, ReplicaState]:
        """Every replica's role and load for the balancer, and the role it is draining out
        of where it switched within the drain time."""
        return {
            r: ReplicaState(
                a.role, a.load, a.previous_role if now - a.switched_at < drain_s else ""
            )
            for r, a in self.replicas.items()
        }

    def order_switch(self, replica: str, role: str, now: float | None = None) -> None:
        """Tell `replica` (in its next round) to take `role`; the order stands until it
        announces that role. ValueError for a role engines cannot switch to."""
        current = self.replicas.get(replica, _UNANNOUNCED).role
        self.roles.order(replica, role, current, time.monotonic() if now is None else now)

    def forget(self, replicas: list[str]) -> None:
        for replica in replicas:
            self.roles.forget(replica)
            self.index.forget(replica)
            announced = self.replicas.pop(replica, None)
            self._idle[""].pop(replica, None)
            if announced is not None:
                self._idle.get(announced.role, {}).pop(replica, None)

    def _announce(self, replica: str, announced: _Announced) -> None:
        idle = Holding(0, announced.load, announced.role, announced.side_channel)
        self._idle[""][replica] = idle
        self._idle.setdefault(announced.role, {})[replica] = idle

    def current(self) -> dict[str, bool]:
        return {replica: self.index.is_current(replica) for replica in self.index.replicas}


class IndexedClusterCache:
    """The Router's view of the cluster's caches through the index actor (cache-aware
    disaggregation and prefix loans): one actor call per request."""

    def __init__(self, app_name: str, block_size: int, timeout_s: float = 0.1) -> None:
        self._app_name = app_name
        self._block_size = block_size
        self._timeout_s = timeout_s
        self._index: Any = None

    async def survey(
        self, prompt_token_ids: list[int], cache_salt: str | None
    ) -> CacheSurvey | None:
        """None also when the index does not answer in time: it is advice, and without it
        the request is disaggregated as usual."""
        from ray.exceptions import RayActorError

        from engine.core.kv_cache_utils import prompt_block_hashes

        hashes = prompt_block_hashes(prompt_token_ids, self._block_size, cache_salt)
        if not hashes:
            return None
        try:
            if self._index is None:
                self._index = await asyncio.to_thread(get_index_actor, self._app_name)
            lookup = self._index.lookup.remote(hashes)
            holdings = await asyncio.wait_for(lookup, self._timeout_s)
        except RayActorError:
            self._index = None  # gone: look it up again next time
            return None
        except Exception as exc:
            logger.info("KV index lookup failed: %r", exc)
            return None
        return survey(holdings, hashes, len(prompt_token_ids), self._block_size)


# In the actor's name: a detached index outlives a redeploy, and new code must not talk to an
# index of an older protocol (it would fail every call, and routing would fall back for good).
_INDEX_PROTOCOL = 3


def index_actor_name(app_name: str) -> str:
    return f"pdserve-kv-index-v{_INDEX_PROTOCOL}-{app_name}"


def get_index_actor(app_name: str) -> Any:
    """The app's KV index actor, created by whoever asks first, and killed by
    `serve.shutdown()` (detached, so that no replica's death takes it along; registered with
    Serve's controller for clean-up, as Ray Serve LLM's prefix tree actor is). A blocking
    GCS lookup: call it off an event loop, or rarely."""
    import ray
    from ray.serve._private.constants import SERVE_CONTROLLER_NAME, SERVE_NAMESPACE

    actor_class = ray.remote(num_cpus=0, max_restarts=-1)(KVIndexServer)
    actor = actor_class.options(
        name=index_actor_name(app_name),
        namespace="pdserve",
        get_if_exists=True,
        lifetime="detached",
    ).remote()
    controller = ray.get_actor(SERVE_CONTROLLER_NAME, namespace=SERVE_NAMESPACE)
    controller._register_shutdown_cleanup_actor.remote(actor)
    return actor
