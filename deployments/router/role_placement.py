"""Which engine deployment a leg goes to once replicas switch roles
(deployments/cluster/role_balance.py).

A replica's deployment is where Serve started it; its role is what it does now. Serve routes a
call among one deployment's replicas only, so a leg for a replica that switched into its role
from the other deployment goes through that deployment's handle with a replica hint (its
request router offers that replica alone, as for cache-aware disaggregation). The role's own
deployment's request router keeps to its replicas still in the role
(request_routers.KVAwareRouter). Without switched replicas, or where the index has not
answered, every leg goes to its role's own deployment, as before.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from deployments.cluster.kv_scoring import Holding, RoutingWeights, replica_cost
from deployments.router.migration import StreamFn


@dataclass(frozen=True)
class Placement:
    stream: StreamFn | None  # another deployment's call; None: the role's own deployment
    replica_hint: str = ""  # the replica it goes to there


HOME = Placement(None)


class RolePlacement:
    def __init__(
        self,
        streams: Mapping[str, StreamFn],
        members: Callable[[str], list[str] | None],
        block_size: int,
    ) -> None:
        """`streams`: each engine deployment's call, by the role it was started in;
        `members`: a deployment's replica ids (its request router publishes them)."""
        self._streams = streams
        self._members = members
        self._block_size = block_size

    def place(
        self, role: str, holdings: Mapping[str, Holding] | None, prompt_tokens: int
    ) -> Placement:
        """A leg of `role`: to the cheapest replica now in that role when it lives in another
        deployment, else to the role's own deployment."""
        if not holdings:
            return HOME
        in_role = {r: h for r, h in holdings.items() if h.role == role}
        elsewhere = set().union(*(self._members(d) or () for d in self._streams if d != role))
        if elsewhere.isdisjoint(in_role):  # nobody switched into the role: no cost to weigh
            return HOME
        best = self._about_cheapest(in_role, prompt_tokens)
        return self.of(role, best) if best is not None else HOME

    def _about_cheapest(self, holdings: Mapping[str, Holding], prompt_tokens: int) -> str | None:
        """One of the replicas costing within a request's weight of the cheapest, at random:
        the loads are the engines' last reports (up to 20 ms old) and this Router's own legs
        in flight are not in them, so a burst would otherwise all go to one replica."""
        weights = RoutingWeights()
        costs = {
            r: replica_cost(prompt_tokens, self._block_size, h, 0, weights)
            for r, h in holdings.items()
        }
        if not costs:
            return None
        least = min(costs.values())
        near = [r for r, cost in costs.items() if cost <= least + weights.request_tokens]
        return random.choice(near)

    def of(self, role: str, replica: str) -> Placement:
        """A leg of `role` that must go to `replica` (a cache-aware disaggregation hint)."""
        for deployment, stream in self._streams.items():
            if deployment != role and replica in (self._members(deployment) or ()):
                return Placement(stream, replica)
        return HOME
