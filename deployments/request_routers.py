"""Serve request routers for the engine deployments (`request_router_config`).

Serve pickles a request router's module by value into every process that holds a handle: state
shared with the rest of the process (the replica-set registry) is reached through an imported
module, never through this module's globals.
"""

from __future__ import annotations

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
