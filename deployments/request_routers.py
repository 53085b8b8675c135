"""Serve request routers for the engine deployments (`request_router_config`).

Serve pickles a request router's module by value into every process that holds a handle: state
shared with the rest of the process (the replica-set registry) is reached through an imported
module, never through this module's globals.
"""

from __future__ import annotations

import asyncio
import random
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

from deployments import replica_set


class ReplicaSetRouter(FIFOMixin, LocalityMixin, MultiplexMixin, RequestRouter):
    """Serve's default policy (locality, then power of two choices), also publishing the
    replica set's size.
    `request_router_kwargs`: {"role": "prefill"}."""

    def initialize_state(self, role: str = "", **kwargs: Any) -> None:
        self._role = role

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        # Serve's locality preference (same node, then zone), then two at random: Serve
        # probes their queue lengths and takes the shorter.
        ids = list(self.apply_locality_routing(pending_request=pending_request))
        if not ids:
            return []
        replicas = self.curr_replicas
        return [[replicas[i] for i in random.sample(ids, k=min(2, len(ids))) if i in replicas]]

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        self._publish()

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self._publish()

    def _publish(self) -> None:
        replica_set.REPLICA_SETS.publish(getattr(self, "_role", ""), len(self.curr_replicas))


class KVAwareRouter(ReplicaSetRouter):
    """Replica choice by cache: the replicas holding the most of the prompt's leading KV
    blocks first (the app's KV index, deployments/kv_index.py), the rest after them (Serve
    moves on when the first are full); where the cache says nothing, Serve's default. Used for
    both legs: a prefill replica holding a conversation's earlier turns computes only the new
    ones, a decode replica holding them reads only the tail.
    `request_router_kwargs`: {"role": ..., "block_size": the engines' block size}."""

    _INDEX_TIMEOUT_S = 0.1

    def initialize_state(self, role: str = "", block_size: int = 16, **kwargs: Any) -> None:
        super().initialize_state(role=role, **kwargs)
        self._block_size = block_size
        self._index: Any = None

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        ranks = await self._cache_ranks(candidate_replicas, pending_request)
        if ranks is not None:
            return ranks
        return await super().choose_replicas(candidate_replicas, pending_request)

    async def _cache_ranks(
        self, candidates: list[RunningReplica], pending_request: PendingRequest | None
    ) -> list[list[RunningReplica]] | None:
        from deployments.kv_index import get_index_actor, rank_by_cache
        from deployments.protocol import EngineRequest
        from engine.core.kv_cache_utils import prompt_block_hashes

        args = pending_request.args if pending_request is not None else ()
        request = args[0] if args else None
        if not isinstance(request, EngineRequest) or len(candidates) < 2:
            return None
        hashes = prompt_block_hashes(request.prompt_token_ids, self._block_size, request.cache_salt)
        if not hashes:
            return None
        try:
            if self._index is None:
                self._index = get_index_actor(self.app_name)
            matches = await asyncio.wait_for(
                self._index.match.remote(hashes), self._INDEX_TIMEOUT_S
            )
        except Exception:  # no index (yet): load decides
            self._index = None
            return None
        by_id = {r.replica_id.unique_id: r for r in candidates}
        ranks = rank_by_cache(list(by_id), matches)
        if ranks is None:
            return None
        return [[by_id[i] for i in rank] for rank in ranks]

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        gone = {r.unique_id for r in self.curr_replicas} - {
            r.replica_id.unique_id for r in replicas
        }
        super().update_replicas(replicas)
        self._forget(gone)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self._forget({replica_id.unique_id})

    def _forget(self, replica_ids: set[str]) -> None:
        if replica_ids and self._index is not None:
            self._index.forget.remote(sorted(replica_ids))
