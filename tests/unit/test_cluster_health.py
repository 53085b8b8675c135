"""The app's health survey over published replica sets, with in-process probes."""

from __future__ import annotations

import asyncio
from typing import Any

from deployments.cluster.health import (
    DEGRADED,
    NOT_SERVING,
    RUNNING,
    SERVING,
    UNREACHABLE,
    survey,
)
from deployments.cluster.replica_set import ReplicaSets


def stats(role: str, replica: str) -> dict[str, Any]:
    return {"role": role, "replica_id": replica or "picked-by-serve", "num_blocks": 8}


def run(
    sets: ReplicaSets, dead: frozenset[str] = frozenset(), hangs: frozenset[str] = frozenset()
) -> Any:
    asked: list[tuple[str, str]] = []

    async def probe(role: str, replica: str) -> dict[str, Any]:
        asked.append((role, replica))
        if replica in hangs:
            await asyncio.Event().wait()
        if replica in dead:
            raise RuntimeError("The actor died unexpectedly before finishing this task")
        return stats(role, replica)

    report = asyncio.run(survey(["prefill", "decode"], sets, probe, timeout_s=0.2))
    return report, asked


def test_every_published_replica_is_asked():
    sets = ReplicaSets()
    sets.publish("prefill", ["p1"])
    sets.publish("decode", ["d2", "d1"])
    report, asked = run(sets)
    assert sorted(asked) == [("decode", "d1"), ("decode", "d2"), ("prefill", "p1")]
    assert report.status == SERVING
    assert [(e["role"], e["replica_id"], e["state"]) for e in report.engines] == [
        ("prefill", "p1", RUNNING),
        ("decode", "d1", RUNNING),
        ("decode", "d2", RUNNING),
    ]


def test_a_role_not_known_yet_gets_one_probe_to_any_replica():
    sets = ReplicaSets()
    sets.publish("decode", ["d1"])
    report, asked = run(sets)
    assert ("prefill", "") in asked and report.status == SERVING


def test_dead_and_wedged_replicas_are_unreachable_and_nothing_of_ray_leaks():
    sets = ReplicaSets()
    sets.publish("prefill", ["p1"])
    sets.publish("decode", ["d1", "d2"])
    report, _ = run(sets, dead=frozenset({"d1"}), hangs=frozenset({"d2"}))
    assert report.status == DEGRADED  # the prefill replica can still answer requests
    unreachable = [e for e in report.engines if e["state"] == UNREACHABLE]
    assert unreachable == [
        {"role": "decode", "replica_id": "d1", "state": UNREACHABLE},
        {"role": "decode", "replica_id": "d2", "state": UNREACHABLE},
    ]


def test_no_engine_answering_is_not_serving():
    sets = ReplicaSets()
    sets.publish("prefill", ["p1"])
    sets.publish("decode", [])
    report, _ = run(sets, dead=frozenset({"p1"}))
    assert report.status == NOT_SERVING
    assert [e["state"] for e in report.engines] == [UNREACHABLE]


def test_no_replica_running_in_any_role_is_not_serving():
    """Every engine still starting (the model loading, GPU nodes joining): the routers have
    published empty sets, nobody is asked, and the app is not serving."""
    sets = ReplicaSets()
    sets.publish("prefill", [])
    sets.publish("decode", [])
    report, asked = run(sets)
    assert asked == [] and report.engines == []
    assert report.status == NOT_SERVING


def test_a_role_with_no_replica_running_is_degraded():
    sets = ReplicaSets()
    sets.publish("prefill", ["p1"])
    sets.publish("decode", [])
    report, _ = run(sets)
    assert [e["state"] for e in report.engines] == [RUNNING]
    assert report.status == DEGRADED


def test_a_hinted_probe_answered_by_another_replica_is_unreachable():
    """Serve routes a hint naming a replica no longer in its set to another one: its answer
    must not make the gone replica look running."""
    sets = ReplicaSets()
    sets.publish("prefill", ["p1"])
    sets.publish("decode", ["d-gone"])

    async def probe(role: str, replica: str) -> dict[str, Any]:
        return stats(role, "d-other" if replica == "d-gone" else replica)

    report = asyncio.run(survey(["prefill", "decode"], sets, probe, timeout_s=0.2))
    assert report.status == DEGRADED
    assert report.engines[-1] == {"role": "decode", "replica_id": "d-gone", "state": UNREACHABLE}


def test_health_is_surveyed_once_per_ttl_however_many_ask():
    """Concurrent callers share the survey in flight, later ones its answer until the TTL;
    a caller that gives up does not cancel it for the others."""
    from deployments.cluster.health import CachedHealth, HealthReport

    now = [0.0]
    release = asyncio.Event()
    surveying = asyncio.Event()

    async def survey_once() -> HealthReport:
        surveying.set()
        await release.wait()
        return HealthReport(SERVING, [stats("decode", f"r{cached.surveys}")])

    cached = CachedHealth(survey_once, ttl_s=1.0, clock=lambda: now[0])

    async def scenario() -> list[HealthReport]:
        waiting = [asyncio.ensure_future(cached.report()) for _ in range(20)]
        impatient = asyncio.ensure_future(cached.report())
        # The survey starts after every caller scheduled before it has reached it.
        await asyncio.wait_for(surveying.wait(), 10)
        impatient.cancel()
        release.set()
        first = await asyncio.gather(*waiting)
        now[0] = 0.9
        within = await cached.report()
        now[0] = 1.5
        after = await cached.report()
        return [*first, within, after]

    reports = asyncio.run(scenario())
    assert cached.surveys == 2
    assert {r.engines[0]["replica_id"] for r in reports[:-1]} == {"r1"}
    assert reports[-1].engines[0]["replica_id"] == "r2"
