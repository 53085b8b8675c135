"""Serve request routers for the engine deployments (`request_router_config`).

Serve pickles a request router's module by value into every process that holds a handle: state
shared with the rest of the process (the replica-set registry) is reached through an imported
module, never through this module's globals.
"""

from __future__ import annotations

import asyncio
import random
import threading
from typing import Any

from ray.serve.request_router import (
    FIFOMixin,
    LocalityMixin,
    MultiplexMixin,
    PendingRequest,
    ReplicaID,
    RequestRouter,
    RunningReplica,
)

from deployments.cluster import replica_set


class _PublishesReplicaSet:
    """Publishes the deployment's replica-set size to the Router's process whenever Serve
    changes it (`request_router_kwargs` "role" names the set)."""

    curr_replicas: dict[ReplicaID, RunningReplica]

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)  # type: ignore[misc]
        self._publish()

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)  # type: ignore[misc]
        self._publish()

    def _publish(self) -> None:
        ids = [replica.unique_id for replica in self.curr_replicas]
        replica_set.REPLICA_SETS.publish(getattr(self, "_role", ""), ids)


# Serve replica metadata (EngineServer.record_replica_metadata): the engine's KV compatibility
# hash, which the KV a decode request brings must match.
KV_COMPAT_HASH = "kv_compat_hash"


def _compatible(
    candidates: list[RunningReplica], pending_request: PendingRequest | None
) -> list[RunningReplica]:
    """The candidates whose engines can read the KV the request brings (same compatibility
    hash as its producer's): a pairing the handshake would refuse is never made. All of them
    when the request brings none, or when none can (the engine then recomputes the prompt,
    or fails it under policy "fail": a clear answer either way)."""
    from connector.metadata import producer_compat_hash

    request = _engine_request(pending_request)
    wanted = producer_compat_hash(request.kv_transfer_params) if request is not None else ""
    if not wanted:
        return candidates
    same = [r for r in candidates if r.replica_metadata.get(KV_COMPAT_HASH) == wanted]
    return same or candidates


def _hinted(
    candidates: list[RunningReplica], pending_request: PendingRequest | None
) -> list[list[RunningReplica]] | None:
    """The replica a call names (`replica_hint`: cache-aware disaggregation's choice, a health
    probe of one replica) alone, if it is a candidate. Serve waits while it is full."""
    hint = getattr(_first_arg(pending_request), "replica_hint", "")
    if not hint:
        return None
    chosen = [r for r in candidates if r.replica_id.unique_id == hint]
    if not chosen:
        return None
    assert pending_request is not None  # it carried the hint
    pending_request.routing_context.should_backoff = True  # full: wait, then ask again
    return [chosen]


def _two_at_random(
    router: LocalityMixin, pending_request: PendingRequest | None
) -> list[list[RunningReplica]]:
    """Serve's default choice: its locality preference (same node, then zone), then two at
    random; Serve probes their queue lengths and takes the shorter."""
    ids = list(router.apply_locality_routing(pending_request=pending_request))
    if not ids:
        return []
    replicas = router.curr_replicas  # type: ignore[attr-defined]
    return [[replicas[i] for i in random.sample(ids, k=min(2, len(ids))) if i in replicas]]


def _two_of(
    candidates: list[RunningReplica], pending_request: PendingRequest | None
) -> list[list[RunningReplica]]:
    """Two of `candidates` at random (Serve's locality mixin chooses among all replicas);
    when both are full Serve waits before asking again, not at once in a loop."""
    if pending_request is not None:
        pending_request.routing_context.should_backoff = True
    return [random.sample(candidates, k=min(2, len(candidates)))]


class ReplicaSetRouter(
    FIFOMixin, LocalityMixin, MultiplexMixin, _PublishesReplicaSet, RequestRouter
):
    """Serve's default policy (locality, then power of two choices), also publishing the
    replica set and honouring a call's replica hint.
    `request_router_kwargs`: {"role": "prefill"}."""

    def initialize_state(self, role: str = "", **kwargs: Any) -> None:
        self._role = role

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        candidates = _compatible(candidate_replicas, pending_request)
        hinted = _hinted(candidates, pending_request)
        if hinted is not None:
            return hinted
        if len(candidates) < len(candidate_replicas):
            return _two_of(candidates, pending_request)
        return _two_at_random(self, pending_request)


class KVAwareRouter(LocalityMixin, MultiplexMixin, _PublishesReplicaSet, RequestRouter):
    """Replica choice by cache against load (deployments/cluster/kv_scoring.py): the replicas that
    would serve the prompt cheapest — its leading KV blocks cached there, little queued —
    first, the rest after them (Serve moves on when the first are full); where the cache says
    nothing, Serve's default. Used for both legs, each scored against its own role's
    replicas: a prefill replica holding a conversation's earlier turns computes only the new
    ones, a decode replica holding them reads only the tail. A request carrying a replica
    hint (cache-aware disaggregation chose that decode replica) goes to it alone.

    No FIFOMixin: a replica chosen for one request's prompt must go to that request, not to
    the oldest one waiting (Ray Serve LLM's prefix-aware router leaves it out too).
    `request_router_kwargs`: {"role": ..., "block_size": the engines' block size}."""

    _INDEX_TIMEOUT_S = 0.1

    def initialize_state(self, role: str = "", block_size: int = 16, **kwargs: Any) -> None:
        from deployments.cluster import cost_search

        self._role = role
        self._block_size = block_size
        self._index: Any = None
        self._roles: dict[str, str] = {}  # each replica's role, as the index last said
        cost_search.warm_up()

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        candidates = _compatible(candidate_replicas, pending_request)
        hinted = _hinted(candidates, pending_request)
        if hinted is not None:
            # Cache-aware disaggregation chose it for what it holds: only it. Another
            # replica would compute the whole prompt.
            return hinted
        request = _engine_request(pending_request)
        holdings = await self._holdings(pending_request, request)
        candidates = self._in_role(candidates, holdings, request)
        ranks = self._cost_ranks(candidates, pending_request, request, holdings)
        if ranks is None and len(candidates) < len(candidate_replicas):
            return _two_of(candidates, pending_request)
        if ranks is None:
            return _two_at_random(self, pending_request)
        if pending_request is not None:
            # If every ranked replica is full, wait before asking again (as Serve's own
            # locality routing does), not at once in a loop.
            pending_request.routing_context.should_backoff = True
        return ranks

    async def _holdings(
        self, pending_request: PendingRequest | None, request: Any
    ) -> dict[str, Any] | None:
        """Every replica's holding of the prompt, from the Router's survey (it asked the index
        already) or from the index (100 ms at most); None where neither says."""
        from ray.exceptions import RayActorError

        from deployments.cluster.kv_scoring import DEFAULT_WEIGHTS, as_holdings

        if pending_request is None or request is None:
            return None
        holdings = request.routing_holdings
        if holdings is None:
            hashes = self._prompt_hashes(pending_request, request)
            if not hashes:  # shorter than a block: nothing to find in any cache
                return None
            try:
                index = await self._index_actor()
                lookup = index.lookup.remote(hashes)  # every role: a replica may switch
                holdings = await asyncio.wait_for(lookup, self._INDEX_TIMEOUT_S)
            except RayActorError:
                self._index = None  # gone: look it up again next time
                return None
            except Exception:  # slow or not there yet: load decides
                return None
        self._roles = as_holdings(holdings, DEFAULT_WEIGHTS).role_of()
        return holdings

    def _in_role(
        self, candidates: list[RunningReplica], holdings: Any, request: Any
    ) -> list[RunningReplica]:
        """The candidates whose role now is the leg's (a prefill leg hands its KV off; any
        other generates): replicas of this deployment that switched to the other role
        (deployments/cluster/role_balance.py) are left out, as the index last said (this
        request's holdings, else the last seen). All of them where none is in the role (a
        decode leg sent to the prefill deployment when no decode replica runs)."""
        if request is None or self._role not in ("prefill", "decode"):
            return candidates
        kv = request.kv_transfer_params or {}
        wanted = "prefill" if kv.get("do_remote_decode") else "decode"
        other = "decode" if wanted == "prefill" else "prefill"
        roles = self._roles
        kept = [r for r in candidates if roles.get(r.replica_id.unique_id) != other]
        return kept or candidates

    def _cost_ranks(
        self,
        candidates: list[RunningReplica],
        pending_request: PendingRequest | None,
        request: Any,
        holdings: Any,
    ) -> list[list[RunningReplica]] | None:
        from deployments.cluster.kv_scoring import rank_by_cost

        if holdings is None or len(candidates) < 2:
            return None
        by_id = {r.replica_id.unique_id: r for r in candidates}
        queue_lens = self.replica_queue_len_cache
        ongoing = {i: queue_lens.get(r.replica_id) or 0 for i, r in by_id.items()}
        prompt_tokens = len(request.prompt_token_ids)
        lent = _lent_blocks(request.kv_transfer_params, self._block_size)
        ranks = rank_by_cost(
            list(by_id), holdings, prompt_tokens, self._block_size, ongoing, lent_blocks=lent
        )
        return [[by_id[i] for i in rank] for rank in ranks] if ranks is not None else None

    def _prompt_hashes(self, pending_request: PendingRequest, request: Any) -> list[bytes]:
        """The prompt's block hashes, computed once per request (Serve may route it again)."""
        from engine.core.kv_cache_utils import prompt_block_hashes

        cached = getattr(pending_request, "_pdserve_block_hashes", None)
        if cached is not None:
            return cached
        hashes = prompt_block_hashes(request.prompt_token_ids, self._block_size, request.cache_salt)
        pending_request._pdserve_block_hashes = hashes  # type: ignore[attr-defined]
        return hashes

    async def _index_actor(self) -> Any:
        """The index actor's handle; the lookup (a blocking GCS call) runs off the loop."""
        from deployments.cluster.kv_index import get_index_actor

        if self._index is None:
            self._index = await asyncio.to_thread(get_index_actor, self.app_name)
        return self._index

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        now = {r.replica_id.unique_id for r in replicas}
        gone = {r.unique_id for r in self.curr_replicas} - now
        super().update_replicas(replicas)
        self._forget(gone)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self._forget({replica_id.unique_id})

    def _forget(self, replica_ids: set[str]) -> None:
        """Drop replicas from the index (engines that stop cleanly also drop themselves). A
        router that never looked the index up itself (the Router's survey gave it every
        request's holdings) finds it first, off Serve's loop."""
        if not replica_ids:
            return
        if self._index is not None:
            self._index.forget.remote(sorted(replica_ids))
            return
        import ray

        if ray.is_initialized():
            args = (self.app_name, sorted(replica_ids))
            threading.Thread(target=_forget_in_index, args=args, daemon=True).start()


def _forget_in_index(app_name: str, replica_ids: list[str]) -> None:
    from deployments.cluster.kv_index import get_index_actor

    try:
        get_index_actor(app_name).forget.remote(replica_ids)
    except Exception:  # the index gone too: it forgets everything when it comes back
        return


def _lent_blocks(kv_transfer_params: dict[str, Any] | None, block_size: int) -> int:
    """The blocks a prefill leg's prefix loan brings (router/kv_leases.py): any replica reads
    them, so they count as cached on every candidate; 0 without a loan (a decode leg's
    handed-off KV goes to whichever replica reads it, and is not ranked by)."""
    kv = kv_transfer_params or {}
    if not (kv.get("do_remote_prefill") and kv.get("do_remote_decode")):
        return 0
    return int(kv.get("remote_num_tokens") or 0) // block_size


def _first_arg(pending_request: PendingRequest | None) -> Any:
    if pending_request is None or not pending_request.args:
        return None
    return pending_request.args[0]


def _engine_request(pending_request: PendingRequest | None) -> Any:
    """The EngineRequest being routed, if that is what the call carries."""
    from deployments.protocol import EngineRequest

    request = _first_arg(pending_request)
    return request if isinstance(request, EngineRequest) else None
