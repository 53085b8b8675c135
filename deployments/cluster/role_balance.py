"""Role switching: which engine replicas change role (prefill <-> decode) so that the P:D
ratio follows the load instead of staying where the config put it.

Every engine computes prompts and generates tokens alike; a replica's role only decides which
leg the routers send it. A load that moves between long prompts (prefill-heavy: RAG, agents
re-reading context) and long answers (decode-heavy: reasoning, chat) needs a different split
hour by hour. Scaling one role up and the other down restarts engines (minutes of weight
loading on a GPU node); a switch keeps the engine, its weights and its cache, and drains only
the old role's requests.

The decision is `plan_switches`, pure and shared by the app's KV index actor (which hears every
replica's load every 20 ms: deployments/cluster/kv_index.py) and `pdserve bench router-sim`:
- each role's pressure is `sla_autoscaling.pressure`, the largest ratio of a signal (TTFT,
  queued prompt tokens; TPOT, KV usage, running requests) to its SLO target;
- when a role is over its targets (pressure > 1), replicas of the other role move to it: as
  many as bring the larger of the two pressures lowest, assuming a role's pressure falls in
  proportion to its replicas (what the autoscaling policy assumes too), at most `max_step` of
  the giving role per decision and never leaving a role with fewer than `min_replicas`;
- nothing moves unless that lowers the larger pressure by `improvement` at least (no flapping
  between two splits that are as bad as each other);
- the replicas that move are the giving role's least busy: they drain soonest.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from deployments.cluster.sla_autoscaling import RoleLoad, SLOTargets, pressure
from engine.core.kv_events import EngineLoad

ROLES = ("prefill", "decode")


@dataclass(frozen=True)
class RoleSwitching:
    """The app's `role_switching` spec (AppConfig): how the KV index moves replicas."""

    targets: SLOTargets = field(default_factory=SLOTargets)
    interval_s: float = 10.0  # between decisions: a move's effect must show in the signals
    max_step: float = 0.25  # of the giving role's replicas per decision (at least one)
    min_replicas: int = 1  # per role, always
    improvement: float = 0.9  # the larger pressure must fall at least to this fraction
    drain_timeout_s: float = 30.0  # a switched replica's old-role requests move after this

    def __post_init__(self) -> None:
        if self.interval_s <= 0 or self.drain_timeout_s <= 0:
            raise ValueError("role_switching: interval_s and drain_timeout_s must be > 0")
        if not 0 < self.max_step <= 1 or not 0 < self.improvement <= 1:
            raise ValueError("role_switching: max_step and improvement must be in (0, 1]")
        if self.min_replicas < 1:
            raise ValueError("role_switching: min_replicas must be >= 1")

    @classmethod
    def from_spec(cls, spec: Mapping[str, Any]) -> RoleSwitching:
        """From the config's dict: this class's fields and SLOTargets' in one mapping;
        ValueError for an unknown key or a bad value."""
        own = {f.name for f in fields(cls)} - {"targets"}
        target_names = {f.name for f in fields(SLOTargets)}
        unknown = sorted(set(spec) - own - target_names)
        if unknown:
            known = ", ".join(sorted(own | target_names))
            raise ValueError(f"role_switching: unknown key(s) {unknown}; known: {known}")
        targets = SLOTargets(**{k: v for k, v in spec.items() if k in target_names})
        return cls(targets=targets, **{k: v for k, v in spec.items() if k in own})


@dataclass(frozen=True)
class ReplicaState:
    """What the index knows of one engine replica: its role now and its latest load."""

    role: str
    load: EngineLoad | None
    draining_from: str = ""  # the role it left within the drain time (its requests run on)


def role_load(members: list[EngineLoad], carrying: list[EngineLoad]) -> RoleLoad:
    """The autoscaling signals of a role: its replicas' latencies (where they have some) and
    KV usage, and the queued prompt tokens and running requests of `carrying`: its replicas
    and those that left it within the drain time. Those still run the role's requests, which
    the role carries once they end: left out, the role would look idle and lose more."""
    return RoleLoad(
        ttft_s=[x.ttft_s for x in members if x.ttft_s is not None],
        queued_prompt_tokens=[float(x.queued_prompt_tokens) for x in carrying],
        tpot_s=[x.tpot_s for x in members if x.tpot_s is not None],
        kv_cache_usage=[x.kv_cache_usage for x in members],
        running_requests=[float(x.num_running) for x in carrying],
    )


def plan_switches(replicas: Mapping[str, ReplicaState], policy: RoleSwitching) -> dict[str, str]:
    """{replica: its new role} for this decision (empty: the split stays)."""
    members = {role: sorted(r for r, s in replicas.items() if s.role == role) for role in ROLES}
    pressures = {}
    for role in ROLES:
        loads = [replicas[r].load for r in members[role]]
        known = [x for x in loads if x is not None]
        drained = [s.load for s in replicas.values() if s.draining_from == role and s.load]
        signals = role_load(known, known + drained)
        p = pressure(role, signals, policy.targets, len(members[role])) if known else None
        if p is None:
            return {}  # a role with no signal yet: nothing to weigh it against
        pressures[role] = p
    taker = max(ROLES, key=lambda role: pressures[role])
    giver = ROLES[1 - ROLES.index(taker)]
    if pressures[taker] <= 1:
        return {}
    moves = _best_move(
        pressures[taker], len(members[taker]), pressures[giver], members[giver], policy
    )
    if not moves:
        return {}
    chosen = sorted(members[giver], key=lambda r: _busy(replicas[r].load))[:moves]
    return dict.fromkeys(chosen, taker)


def _best_move(
    taker: float, num_taker: int, giver: float, givers: list[str], policy: RoleSwitching
) -> int:
    """How many replicas to move: the count bringing max(pressures) lowest, within bounds; 0
    when no count lowers it by `improvement`."""
    most = min(max(1, int(len(givers) * policy.max_step)), len(givers) - policy.min_replicas)
    best, best_worst = 0, max(taker, giver)
    for k in range(1, most + 1):
        worst = max(taker * num_taker / (num_taker + k), giver * len(givers) / (len(givers) - k))
        if worst < best_worst:
            best, best_worst = k, worst
    return best if best and best_worst <= policy.improvement * max(taker, giver) else 0


def _busy(load: EngineLoad | None) -> tuple[int, int]:
    if load is None:
        return (0, 0)
    return (load.num_running + load.num_waiting, load.queued_prompt_tokens)


class RoleBalancer:
    """`plan_switches` every `interval_s` of the caller's clock (the index actor's, or the
    simulator's), and not while a replica it moved has yet to announce its new role: the
    caller asks `due`, then builds the states and calls `decide`."""

    def __init__(self, policy: RoleSwitching, last: float = float("-inf")) -> None:
        self.policy = policy
        self.last = last  # when it last decided

    def due(self, pending: int, now: float) -> bool:
        """Whether to decide now. `pending`: orders given out and not yet announced (their
        replicas still say the old role: deciding again now would count them twice)."""
        return not pending and now - self.last >= self.policy.interval_s

    def decide(self, replicas: Mapping[str, ReplicaState], now: float) -> dict[str, str]:
        self.last = now
        return plan_switches(replicas, self.policy)


# An order its replica has not announced by then is dropped (the balancer may decide again).
ORDER_TTL_S = 120.0


class RoleOrders:
    """What the app's KV index actor keeps for role switching: the role each replica is told
    to take (until it announces it), and the balancer deciding them where the app switches
    roles (its spec comes with every engine's snapshot, so an index that restarted has it
    back with the first one)."""

    def __init__(self) -> None:
        self.balancer: RoleBalancer | None = None
        self._spec: dict[str, Any] | None = None
        self._orders: dict[str, tuple[str, float]] = {}  # replica -> (role, when ordered)

    def configure(self, spec: dict[str, Any] | None) -> None:
        """The app's spec as an engine brings it (a redeploy may change it): a new balancer
        keeps the time of the last decision, so `interval_s` holds across the change."""
        if spec == self._spec:
            return
        self._spec = spec
        last = self.balancer.last if self.balancer is not None else float("-inf")
        self.balancer = RoleBalancer(RoleSwitching.from_spec(spec), last) if spec else None

    def order(self, replica: str, role: str, current_role: str, now: float) -> None:
        """ValueError for a role engines cannot switch to; none stands for the role it has."""
        if role not in ROLES:
            raise ValueError(f"a replica can switch to {ROLES}, not {role!r}")
        if current_role == role:
            self._orders.pop(replica, None)
            return
        self._orders[replica] = (role, now)

    def announced(self, replica: str, role: str) -> None:
        order = self._orders.get(replica)
        if order is not None and order[0] == role:
            del self._orders[replica]  # done

    def forget(self, replica: str) -> None:
        self._orders.pop(replica, None)

    def round(
        self, replica: str, states: Callable[[float], Mapping[str, ReplicaState]], now: float
    ) -> str:
        """A replica's publishing round: drop orders never taken up (their replicas are stuck
        or gone), let the balancer decide when due (`states(drain_timeout_s)` then says every
        replica's), and answer the role `replica` is told to take ("" for none)."""
        for stuck in [r for r, (_, at) in self._orders.items() if now - at > ORDER_TTL_S]:
            del self._orders[stuck]
        balancer = self.balancer
        if balancer is not None and balancer.due(len(self._orders), now):
            replicas = states(balancer.policy.drain_timeout_s)
            for moved, role in balancer.decide(replicas, now).items():
                self.order(moved, role, replicas[moved].role, now)
        return self._orders.get(replica, ("", 0.0))[0]
