"""The replicas' metrics as alerts read them: every counter and gauge recorded at 0 when the
replica starts (for each tag value known up front), and no label that a restart changes. The
real scrape of a fresh Ray is checked in tests/integration/test_serve_cli.py."""

from __future__ import annotations

from typing import Any

import pytest
from ray.util import metrics

from deployments.metrics import IDENTITY_TAGS, ReplicaMetrics, replica_identity
from deployments.replica.telemetry import KV_LOAD_FAILURES, TIER_OPS, EngineMetrics
from deployments.router.telemetry import OUTCOMES, RouterMetrics
from engine.stats import EngineStats

IDENTITY = {"application": "pdserve", "deployment": "DecodeServer", "rank": "1"}


@pytest.fixture
def records(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, float, dict[str, str]]]:
    """Every value Ray's metrics record: (metric name, value, final tags)."""
    seen: list[tuple[str, float, dict[str, str]]] = []
    original = metrics.Metric._record

    def record(self: Any, value: float, tags: dict[str, str] | None = None) -> None:
        seen.append((self._name, value, self._get_final_tags(tags)))
        original(self, value, tags)

    monkeypatch.setattr(metrics.Metric, "_record", record)
    return seen


def test_rays_counter_still_refuses_zero_so_the_start_records_below_it() -> None:
    """ReplicaMetrics.counter records 0 through `_record` because `inc(0)` raises: should a
    Ray upgrade accept 0 (or drop `_record`), this fails and the workaround goes."""
    counter = metrics.Counter("pdserve_test_refusal", "t")
    with pytest.raises(ValueError, match="must be >0"):
        counter.inc(0)
    assert callable(metrics.Counter._record)


def test_counters_and_gauges_exist_at_zero_for_every_known_tag_value(records) -> None:
    make = ReplicaMetrics(IDENTITY)
    EngineMetrics("nixl", make)
    RouterMetrics(("decode", "prefill"), make)
    zeros = [(name, tags) for name, value, tags in records if value == 0]
    assert len(zeros) == len(records)  # nothing but zeros before any event
    names = {name for name, _ in zeros}
    for name in (
        "pdserve_running_requests",
        "pdserve_kv_cache_usage",
        "pdserve_prefix_cache_queries",
        "pdserve_preemptions",
        "pdserve_kv_blocks_corrupted",
        "pdserve_kv_checksum_failures",
        "pdserve_kv_leases_expired",
        "pdserve_spec_decode_num_drafts",
        "pdserve_tp_collective_seconds",
        "pdserve_prompt_tokens",
    ):
        assert name in names, name
    outcomes = {t["outcome"] for n, t in zeros if n == "pdserve_requests"}
    assert outcomes == set(OUTCOMES)
    failures = {
        (t["transport"], t["outcome"]) for n, t in zeros if n == "pdserve_kv_transfer_failures"
    }
    assert failures == {("nixl", outcome) for outcome in KV_LOAD_FAILURES}
    sides = {t["side"] for n, t in zeros if n == "pdserve_kv_checksum_seconds"}
    assert sides == {"produced", "verified"}
    assert {t["target"] for n, t in zeros if n == "pdserve_migrations"} == {"decode", "prefill"}
    # Every series carries the replica's stable identity, and nothing per process.
    for _, tags in zeros:
        assert {k: tags[k] for k in IDENTITY_TAGS} == IDENTITY
        assert "replica" not in tags


def test_an_engine_without_kv_transfer_starts_no_transport_series(records) -> None:
    EngineMetrics("", ReplicaMetrics(IDENTITY))
    names = {name for name, _, _ in records}
    assert "pdserve_kv_transfer_bytes" not in names
    assert "pdserve_kv_transfer_failures" not in names
    assert "pdserve_kv_blocks_verified" in names  # the check counters are per engine


def test_an_engine_with_a_kv_tier_starts_its_series_at_0_and_counts_what_it_did(records) -> None:
    metrics_ = EngineMetrics("", ReplicaMetrics(IDENTITY), tier="cpu")
    ops = {t["op"] for n, v, t in records if n == "pdserve_kv_tier_blocks" and v == 0}
    assert ops == set(TIER_OPS)
    assert any(n == "pdserve_kv_tier_hit_tokens" and t["tier"] == "cpu" for n, _, t in records)
    base = {"num_blocks": 8, "num_free_blocks": 8, "num_running": 0, "num_waiting": 0}
    base |= {"num_held_requests": 0, "queued_prompt_tokens": 0}
    metrics_.sample(EngineStats(**base, kv_tier={"stored": 3, "hit_tokens": 16}))
    metrics_.sample(EngineStats(**base, kv_tier={"stored": 5, "loaded": 4, "hit_tokens": 16}))
    counted = [(n, v, t.get("op")) for n, v, t in records if n.startswith("pdserve_kv_tier") and v]
    assert counted == [
        ("pdserve_kv_tier_blocks", 3, "stored"),
        ("pdserve_kv_tier_hit_tokens", 16, None),
        ("pdserve_kv_tier_blocks", 2, "stored"),  # the deltas since the last sample
        ("pdserve_kv_tier_blocks", 4, "loaded"),
    ]


def test_outside_a_replica_the_identity_is_empty() -> None:
    assert replica_identity() == dict.fromkeys(IDENTITY_TAGS, "")
