"""`pdserve bench router-sim` on a small cluster: every policy routes the same requests over
fresh simulated engines; the engines' events keep the real index as complete as the caches
(but for the last publishing period); nobody beats the unlimited-cache oracle; the KV-aware
policy (pdserve's routing code) finds more of the conversations' context than round robin."""

from __future__ import annotations

import random

import pytest

from pdserve.bench.router_sim import RouterSimConfig, _Simulation, run
from pdserve.bench.sim_engine import EngineModel, SimEngine
from pdserve.bench.sim_workload import sim_requests

SMALL = {"prefill_replicas": 4, "decode_replicas": 4, "num_requests": 200, "request_rate": 50.0}


def test_policies_against_the_oracle_on_multi_turn_conversations() -> None:
    report = run(RouterSimConfig(**SMALL))
    oracle = report["oracle_hit_rate"]
    policies = report["policies"]
    assert set(policies) == {"kv", "round_robin", "dynamo"}
    for result in policies.values():
        assert 0 <= result["hit_rate"] <= oracle + 1e-9
        assert result["decision_us"]["p50"] > 0 and result["index_entries"] > 0
        # An event carries a step's blocks: more blocks than events (prompts of many blocks).
        assert result["kv_event_blocks_per_s"] > result["kv_events_per_s"] > 0
    assert policies["kv"]["hit_rate"] > policies["round_robin"]["hit_rate"]
    assert policies["kv"]["decode_only_routes"] > 0  # cache-aware disaggregation was taken
    assert policies["round_robin"]["decode_only_routes"] == 0
    # The kv decision by part: every request looked up and surveyed, the rest ranked.
    parts = policies["kv"]["decision_parts_us"]
    assert set(parts) == {"lookup", "survey", "rankings"} and parts["lookup"]["p50"] > 0
    assert "decision_parts_us" not in policies["dynamo"]


def test_the_index_follows_the_engines_caches() -> None:
    config = RouterSimConfig(**SMALL, policies=("kv",))
    simulation = _Simulation(config, "kv")
    requests = sim_requests(config)
    simulation.run(requests)
    for name in simulation.engines:  # the last period's events too
        simulation._publish(name, requests[-1].at_s + 1.0)
    held = sum(len(e._cache) for e in simulation.engines.values())
    assert simulation.index.index.num_entries() == held
    assert all(simulation.index.current().values())


def test_an_engine_evicts_its_least_recently_used_blocks_and_says_so() -> None:
    engine = SimEngine("e", "prefill", EngineModel(capacity_blocks=3), 16)
    assert engine.store([b"a", b"b"]) == 0
    assert engine.store([b"a", b"c"]) == 1  # touches a; b is now the oldest
    assert engine.store([b"d"]) == 0
    assert engine.held_blocks([b"a", b"c"]) == 2 and engine.held_blocks([b"b"]) == 0
    batch = engine.take_batch()
    assert batch is not None and batch.seq == 0
    removed = [e for e in batch.events if type(e).__name__ == "BlockRemoved"]
    assert [h for e in removed for h in e.block_hashes] == [b"b"]


def test_bad_configurations_are_refused() -> None:
    with pytest.raises(ValueError, match="policies"):
        RouterSimConfig(policies=("random",))
    with pytest.raises(ValueError, match="request_rate"):
        RouterSimConfig(request_rate=0)


def test_an_engine_reports_the_load_it_would_work_out_afresh() -> None:
    """The load an engine keeps between the starts and ends of its work is the one it would
    work out at any time in between."""
    rng = random.Random(3)
    engine = SimEngine("e", "decode", EngineModel(capacity_blocks=64), 16)
    now, kept = 0.0, 0
    for _ in range(400):
        now += rng.choice([0.0, 0.001, 0.004, 0.02])
        work = rng.random()
        if work < 0.1:  # a prefill leg here
            engine.prefill(now, rng.randint(1, 600))
        elif work < 0.2:  # a decode leg (its KV came from elsewhere)
            engine.decode(now, now + rng.choice([0.0, 0.01]), rng.randint(1, 40), rng.randint(1, 8))
        load = engine.load(now)
        kept += engine._load is load and load is engine.load(now)
        engine._load = None  # afresh
        assert engine.load(now) == load
    assert kept > 300  # (it was kept, not worked out each time)
