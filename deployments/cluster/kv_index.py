"""The cluster's KV index: which engine replica holds which prefix-cache blocks, and how
loaded each is, for the request routers of both legs (`KVIndexServer`, a Ray actor).

Engines number their prefix cache's events in batches (engine/core/kv_events.py:
`KVEventStream`), one numbering per engine start (an epoch), and publish them with their load
(`KVEventPublisher`); the prefix index (prefix_index.py) applies them and asks for a snapshot
where events were lost. A lookup answers every replica's holding of a prompt laid out so that
the routers' searches skip most replicas (kv_holdings.Holdings): the holders grouped by how
much they hold (a big group as a bit mask), and every replica by load, per role too
(load_board.py's `LoadBoard`, kept sorted as loads arrive). A replica
that is no longer running is forgotten (`forget`: a replica that stops says so; a request
router that sees a replica gone from its set says so for it).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from dataclasses import dataclass
from typing import Any, NamedTuple

from deployments.cluster import cost_search
from deployments.cluster.kv_holdings import Board
from deployments.cluster.kv_scoring import (
    NOTHING_HELD,
    SMALL_GROUP,
    CacheSurvey,
    HeldGroup,
    Holding,
    Holdings,
    survey,
)
from deployments.cluster.load_board import LoadBoard
from deployments.cluster.prefix_index import PrefixIndex
from deployments.cluster.role_balance import ReplicaState, RoleOrders
from engine.core.kv_events import EngineLoad, KVEventBatch, KVSnapshot

logger = logging.getLogger(__name__)


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


class _RoleTable:
    """A role's replicas (every role's for ""), each as its holding of a prompt it holds
    nothing of (a lookup hands these out and adds the groups of those holding blocks), their
    bits, and their load board.

    `idle` is copied on write: a lookup hands it out as it is, never copying it. Loads change
    thousands of times a second at 128 replicas, spread over time, so nearly every lookup
    would find a change since the last: the copy belongs to the change, off the requests'
    path (2 us at 128 replicas)."""

    def __init__(self) -> None:
        self.idle: dict[str, Holding] = {}
        self.known = 0
        self.board = LoadBoard()

    def put(self, replica: str, holding: Holding, bit: int) -> None:
        self.board.place(replica, holding.load, bit)  # (first: a load it refuses changes nothing)
        self.idle = {**self.idle, replica: holding}
        self.known |= bit

    def drop(self, replica: str, bit: int) -> None:
        if replica in self.idle:
            self.idle = {r: h for r, h in self.idle.items() if r != replica}
            self.known &= ~bit
        self.board.remove(replica)


class _View(NamedTuple):
    """A role's tables as a lookup hands them out (never changed afterwards)."""

    replicas: dict[str, Holding]
    known: int
    board: Board
    roles: dict[str, tuple[int, Board]]


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
        # loads change: a lookup hands these out with the groups of the replicas holding blocks.
        self._tables: dict[str, _RoleTable] = {"": _RoleTable()}
        # What a lookup hands out of the tables, per role: made again at each change of a
        # role's table (and of "", which carries every role's), off the requests' path.
        self._views: dict[str, _View] = {}
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
        unlisted = replica not in self._tables[""].idle
        if announced is None and replica in self.index.replicas and unlisted:
            self._put(replica, NOTHING_HELD, "")
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
            self._drop(replica, previous.role)
            announced.previous_role = previous.role
            announced.switched_at = time.monotonic() if now is None else now
        self.replicas[replica] = announced
        self._announce(replica, announced)

    def lookup(self, block_hashes: list[bytes], role: str = "") -> Holdings:
        """Per replica (of `role`, or all): the prompt's leading blocks it holds, its load."""
        index = self.index
        view = self._view(role)
        replicas, known, bits = view.replicas, view.known, index.bits
        groups: list[HeldGroup] = []
        held: dict[str, Holding] = {}
        tiers = index.has_tiers
        for count, mask in index.match_masks(block_hashes):
            mask &= known
            if not tiers:  # (every holder holds its blocks in its pool: one group)
                if mask.bit_count() > SMALL_GROUP:
                    groups.append(HeldGroup(count, 0, mask, ()))  # named only where walked
                    continue
                members = index.names_of(mask)
                for replica in members:
                    a = replicas[replica]
                    held[replica] = Holding(count, a.load, a.role, a.side_channel)
                if members:
                    groups.append(HeldGroup(count, 0, mask, tuple(members)))
                continue
            alike: dict[int, list[str]] = {}  # by blocks in a tier only (they cost alike)
            for replica in index.names_of(mask):
                a = replicas[replica]
                in_tier = index.tier_only_blocks(replica, block_hashes, count)
                held[replica] = Holding(count, a.load, a.role, a.side_channel, in_tier)
                alike.setdefault(in_tier, []).append(replica)
            for in_tier, members in alike.items():
                named = tuple(members) if len(members) <= SMALL_GROUP else ()
                group_mask = sum(bits[r] for r in members)
                groups.append(HeldGroup(count, in_tier, group_mask, named))
        return Holdings(replicas, tuple(groups), view.board, bits, known, view.roles, held)

    def _view(self, role: str) -> _View:
        view = self._views.get(role)
        if view is None:
            view = self._views[role] = self._make_view(role)
        return view

    def _make_view(self, role: str) -> _View:
        table = self._tables.get(role) or _RoleTable()
        board = table.board.snapshot
        # A role's answer carries its own board alone (it crosses Ray per request).
        roles = {role: (table.known, board)}
        if not role:
            roles = {r: (t.known, t.board.snapshot) for r, t in self._tables.items() if r}
        return _View(table.idle, table.known, board, roles)

    def _changed(self, roles: tuple[str, ...]) -> None:
        """Lookups' views of the `roles` whose tables changed (and of "", which carries
        every role's board): made now, at the change, rather than by the next lookup (loads
        change thousands of times a second at 128 replicas: nearly every lookup found one)."""
        for role in {"", *roles}:
            self._views[role] = self._make_view(role)

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
            announced = self.replicas.pop(replica, None)
            self._drop(replica, "", *([announced.role] if announced is not None else []))
            self.roles.forget(replica)
            self.index.forget(replica)  # (its bit is free from here)

    def _announce(self, replica: str, announced: _Announced) -> None:
        idle = Holding(0, announced.load, announced.role, announced.side_channel)
        self._put(replica, idle, "", announced.role)

    def _put(self, replica: str, idle: Holding, *roles: str) -> None:
        """Every change to the tables goes through here or `_drop` (lookups' views follow)."""
        bit = self.index.bits[replica]
        for role in roles:
            self._tables.setdefault(role, _RoleTable()).put(replica, idle, bit)
        self._changed(roles)

    def _drop(self, replica: str, *roles: str) -> None:
        bit = self.index.bits.get(replica, 0)
        for role in roles:
            if role in self._tables:
                self._tables[role].drop(replica, bit)
        self._changed(roles)

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
        cost_search.warm_up()

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
_INDEX_PROTOCOL = 5  # 5: the answer is a kv_holdings.Holdings of masks and boards


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
