"""Role switching's pieces without Serve: the balancer's decisions from synthetic loads, the
index's orders, a replica's drain bookkeeping, where the Router sends a leg once replicas
switched, and the simulator's run against fixed P:D splits."""

from __future__ import annotations

import time

import pytest

from deployments.cluster.kv_index import KVIndexServer
from deployments.cluster.kv_scoring import Holding
from deployments.cluster.role_balance import (
    ReplicaState,
    RoleBalancer,
    RoleSwitching,
    plan_switches,
)
from deployments.cluster.sla_autoscaling import SLOTargets
from deployments.replica.role_switch import MOVED, RoleState, moved_output
from deployments.router.role_placement import HOME, RolePlacement
from engine.core.kv_events import EngineLoad, KVSnapshot
from pdserve.bench.router_sim import RouterSimConfig, run

SLO = SLOTargets(ttft_s=1.0, queued_prompt_tokens=1000, tpot_s=0.1, running_requests=10)
POLICY = RoleSwitching(targets=SLO, max_step=0.5)


def load(running: int = 0, queued: int = 0, ttft: float | None = None) -> EngineLoad:
    return EngineLoad(running, 0, queued, 0.1, ttft_s=ttft)


def cluster(prefill: list[EngineLoad], decode: list[EngineLoad]) -> dict[str, ReplicaState]:
    states = {f"p{i}": ReplicaState("prefill", x) for i, x in enumerate(prefill)}
    states.update({f"d{i}": ReplicaState("decode", x) for i, x in enumerate(decode)})
    return states


def test_an_overloaded_prefill_role_takes_idle_decode_replicas_least_busy_first():
    # 2 prefill replicas hold 4x the queue they may; 4 decode replicas run 1-4 of 10 each.
    states = cluster([load(queued=4000)] * 2, [load(r) for r in (4, 1, 3, 2)])
    moves = plan_switches(states, POLICY)
    # Half the decode replicas at most (max_step), the least busy: d1 (1 running), d3 (2).
    assert moves == {"d1": "prefill", "d3": "prefill"}


def test_nothing_moves_within_targets_or_when_the_giver_would_be_overloaded():
    assert plan_switches(cluster([load(queued=500)] * 2, [load(9)] * 2), POLICY) == {}
    # Decode is as loaded as prefill: moving makes the worse role no better by 10%.
    both = cluster([load(queued=3000)] * 2, [load(30)] * 2)
    assert plan_switches(both, POLICY) == {}
    # A role always keeps min_replicas.
    one = cluster([load(queued=9000)], [load()])
    assert plan_switches(one, POLICY) == {}


def test_an_overloaded_decode_role_takes_prefill_replicas():
    states = cluster([load(queued=0, ttft=0.1)] * 4, [load(running=40)] * 2)
    moves = plan_switches(states, POLICY)
    assert set(moves.values()) == {"decode"} and len(moves) == 2


def test_the_balancer_decides_once_an_interval_and_not_while_orders_are_pending():
    balancer = RoleBalancer(RoleSwitching(targets=SLO, interval_s=10.0, max_step=0.5))
    states = cluster([load(queued=4000)] * 2, [load(1)] * 4)
    assert balancer.due(pending=0, now=100.0) and balancer.decide(states, now=100.0)
    assert not balancer.due(pending=0, now=105.0)  # within the interval
    assert not balancer.due(pending=1, now=111.0)  # a move not yet announced
    assert balancer.due(pending=0, now=111.0)


def test_bad_role_switching_specs_are_refused():
    with pytest.raises(ValueError, match="unknown"):
        RoleSwitching.from_spec({"intervl_s": 3})
    with pytest.raises(ValueError, match="max_step"):
        RoleSwitching.from_spec({"max_step": 0})
    with pytest.raises(ValueError, match="ttft_s"):
        RoleSwitching.from_spec({"ttft_s": -1})
    spec = RoleSwitching.from_spec({"ttft_s": 3, "interval_s": 5})
    assert spec.targets.ttft_s == 3 and spec.interval_s == 5


def announce(index: KVIndexServer, replica: str, role: str, spec=None, queued=0, running=0):
    snapshot = KVSnapshot("epoch", 0, ())
    index.load_snapshot(replica, snapshot, role, load(running, queued), "", spec)


def test_the_index_orders_a_switch_in_the_replica_s_next_round_until_it_announces_it():
    index = KVIndexServer()
    spec = {"queued_prompt_tokens": 1000, "running_requests": 10, "max_step": 0.5}
    announce(index, "p0", "prefill", spec, queued=5000)
    for name in ("d0", "d1"):
        announce(index, name, "decode", spec, running=1)
    reply = index.publish("d0", [], now=50.0)
    assert reply.current
    ordered = [r for r in ("d0", "d1") if index.publish(r, [], now=50.0).switch_to]
    assert len(ordered) == 1  # one of two: a role keeps min_replicas
    (moved,) = ordered
    assert index.publish(moved, [], now=51.0).switch_to == "prefill"  # until announced
    announce(index, moved, "prefill", spec)
    assert index.publish(moved, [], now=52.0).switch_to == ""
    assert index.lookup([])[moved].role == "prefill"
    # An operator's order, and a refused one.
    index.order_switch("p0", "decode")
    assert index.publish("p0", []).switch_to == "decode"
    with pytest.raises(ValueError, match="colocated"):
        index.order_switch("p0", "colocated")
    index.order_switch("p0", "prefill")  # the role it has: no order stands
    assert index.publish("p0", []).switch_to == ""


def test_an_order_never_taken_up_expires_and_lets_the_balancer_decide_again():
    index = KVIndexServer()
    spec = {"queued_prompt_tokens": 1000, "running_requests": 10, "interval_s": 1.0}
    announce(index, "p0", "prefill", spec, queued=5000)
    announce(index, "d0", "decode", spec, running=3)
    announce(index, "d1", "decode", spec)
    index.order_switch("d0", "prefill", now=0.0)  # d0 never publishes again (stuck)
    assert index.publish("d1", [], now=100.0).switch_to == ""  # pending: no decision
    # Past the order's 120 s it is dropped, and the balancer moves d1 (d0 still decodes).
    assert index.publish("d1", [], now=130.0).switch_to == "prefill"


def test_a_replica_that_left_a_role_still_counts_its_draining_work_there():
    # x just became a prefill replica with 40 decodes still running: the one replica left
    # decoding carries them when they end, so decode is over its target (pressure 4).
    states = cluster([load(queued=0)] * 2, [load(5)])
    states["x"] = ReplicaState("prefill", load(running=40), draining_from="decode")
    moves = plan_switches(states, POLICY)
    assert moves and set(moves.values()) == {"decode"} and "x" not in moves
    states["x"] = ReplicaState("prefill", load(running=40))  # drained long ago: not counted
    assert plan_switches(states, POLICY) == {}


def test_a_switch_drains_the_old_role_s_requests_and_moves_those_that_outstay_it():
    announced = []
    state = RoleState("decode", drain_timeout_s=60.0, announce=announced.append)
    old = state.admit()
    before = time.monotonic()
    assert state.switch("prefill") == 1 and announced == ["prefill"]
    new = state.admit()
    assert state.older_than(1) == 1  # the old one drains; the new one came in under the new role
    # The switch gave the old request a drain deadline, and the new one none.
    assert before + 60.0 <= state._legs[old].deadline <= time.monotonic() + 60.0
    assert state._legs[new].deadline == float("inf")
    assert not state.must_move(old) and not state.must_move(new)
    state._legs[old].deadline = time.monotonic() - 1  # its drain ran out
    assert state.must_move(old) and state.moved == 1
    state.finish(old)
    assert state.older_than(1) == 0
    assert state.switch("prefill") == 1  # already: no new epoch
    with pytest.raises(ValueError, match="one of"):
        state.switch("colocated")
    with pytest.raises(ValueError, match="colocated"):
        RoleState("colocated").switch("decode")
    with pytest.raises(ValueError, match="does not switch"):
        RoleState("decode", enabled=False).switch("prefill")  # the app has no role_switching
    output = moved_output("r")
    assert output.error == MOVED and output.finished


def stream(name: str):
    async def call(request):  # pragma: no cover - never called here
        yield name

    return call


def test_a_leg_goes_to_another_deployment_only_for_a_replica_that_switched_into_its_role():
    prefill, decode = stream("prefill"), stream("decode")
    members = {"prefill": ["p0", "p1"], "decode": ["d0", "d1"]}
    placement = RolePlacement({"prefill": prefill, "decode": decode}, members.get, 16)
    busy, idle = load(running=5, queued=3000), load()
    holdings = {
        "p0": Holding(0, busy, "prefill"),
        "p1": Holding(0, busy, "prefill"),
        "d0": Holding(0, idle, "decode"),
        "d1": Holding(0, idle, "prefill"),  # switched from decode to prefill
    }
    placed = placement.place("prefill", holdings, 100)
    assert placed.stream is decode and placed.replica_hint == "d1"  # the idle switched one
    assert placement.place("decode", holdings, 100) == HOME  # d0, in its own deployment
    assert placement.place("prefill", None, 100) == HOME  # the index said nothing
    assert placement.of("decode", "p1").stream is prefill
    assert placement.of("decode", "d0") == HOME


def test_the_simulated_cluster_follows_a_shifting_load_better_than_any_fixed_split():
    config = RouterSimConfig(
        prefill_replicas=4,
        decode_replicas=4,
        num_requests=2400,
        request_rate=95.0,  # more than 4 replicas of either role serve in its heavy phase
        workload="phases",
        step_per_seq_s=0.0006,
        policies=("kv",),
        role_switching=True,
        fixed_splits=(2, 4, 6),
    )
    result = run(config)["role_switching"]
    assert set(result["fixed"]) == {"2:6", "4:4", "6:2"}
    switching = result["switching"]
    assert switching["switches"] > 0  # the balancer moved engines
    best = max(f["goodput_per_s"] for f in result["fixed"].values())
    assert switching["goodput_per_s"] > 1.2 * best  # 1.37x when written


def test_the_app_refuses_role_switching_where_it_cannot_work_and_passes_it_to_engines():
    from deployments.app import build_app
    from deployments.app_config import AppConfig

    spec = {"ttft_s": 3, "drain_timeout_s": 5}
    for args in (
        {"colocated": True},
        {"kv_aware_routing": False},
        {"sla_autoscaling": {"ttft_s": 2}},
    ):
        with pytest.raises(ValueError, match="role_switching"):
            AppConfig.from_args({"role_switching": spec, **args})
    with pytest.raises(ValueError, match="unknown"):
        AppConfig.from_args({"role_switching": {"drain_s": 5}})
    app = build_app({"model": "tiny", "role_switching": spec})
    router = app._bound_deployment
    decode, prefill = router.init_args[1:]
    for engine in (decode, prefill):
        assert engine._bound_deployment.init_kwargs["role_switching"] == spec
    assert router.init_args[0].role_switching  # the Router places legs by role
