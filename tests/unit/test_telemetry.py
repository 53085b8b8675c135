"""Tracing helpers without Ray or a collector: span trees from engine timings, context
propagation, and the dashboard's metric names."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode

from deployments.replica.telemetry import record_engine_spans
from deployments.router.telemetry import RouterTelemetry
from deployments.telemetry import OTLP_ENDPOINT_ENV, Tracing, extract_context, inject_context
from engine.request import RequestTiming, SamplingParams

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def exporter() -> InMemorySpanExporter:
    return InMemorySpanExporter()


@pytest.fixture
def tracer(exporter: InMemorySpanExporter):
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return provider.get_tracer("test")


def test_without_an_endpoint_tracing_is_a_no_op(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(OTLP_ENDPOINT_ENV, raising=False)
    tracing = Tracing("router", "r1")
    assert not tracing.enabled
    span = RouterTelemetry(tracing.tracer).observe(None)
    assert span.carrier() == {}  # nothing to propagate, nothing recorded
    tracing.shutdown()


def test_endpoint_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(OTLP_ENDPOINT_ENV, "http://127.0.0.1:1")
    tracing = Tracing("decode", "d1")
    assert tracing.enabled and tracing.endpoint == "http://127.0.0.1:1"
    tracing.shutdown()


def test_router_span_carries_the_client_parent_and_gen_ai_attributes(tracer, exporter) -> None:
    carrier = {"Traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"}
    observed = RouterTelemetry(tracer).observe(carrier)
    observed.started("r1", "default", SamplingParams(max_tokens=5, temperature=0.5), 7)
    child = extract_context(observed.carrier())
    assert child is not None
    observed.failed("error", "engine exploded")
    observed.end()
    (span,) = exporter.get_finished_spans()
    assert span.name == "router.request"
    assert format(span.context.trace_id, "032x") == "4bf92f3577b34da6a3ce929d0e0e4736"
    assert format(span.parent.span_id, "016x") == "00f067aa0ba902b7"
    assert span.attributes["gen_ai.request.max_tokens"] == 5
    assert span.attributes["gen_ai.usage.input_tokens"] == 7
    assert span.status.status_code == StatusCode.ERROR
    assert span.status.description == "engine exploded"


def test_engine_spans_from_timings_nest_and_keep_their_times(tracer, exporter) -> None:
    root = tracer.start_span("router.request")
    carrier = inject_context(root)
    timing = RequestTiming(
        arrival=100.0,
        first_scheduled=100.5,
        first_token=100.6,
        finished=101.0,
        kv_load_start=100.1,
        kv_load_end=100.4,
        kv_load_blocks=3,
        kv_load_descriptors=2,
        kv_load_outcome="recovered",
        kv_load_problem="checksum",
    )
    record_engine_spans(
        tracer,
        "decode",
        carrier,
        timing,
        {"gen_ai.request.model": "m"},
        kv={"transport": "nixl", "block_bytes": 1024},
    )
    root.end()
    spans = {s.name: s for s in exporter.get_finished_spans()}
    decode, kv = spans["decode"], spans["kv_transfer"]
    assert decode.parent.span_id == root.context.span_id
    assert kv.parent.span_id == decode.context.span_id
    assert (decode.start_time, decode.end_time) == (100 * 10**9, 101 * 10**9)
    assert (kv.start_time, kv.end_time) == (int(100.1 * 10**9), int(100.4 * 10**9))
    assert decode.attributes["pdserve.queue_time_s"] == pytest.approx(0.1)  # after the KV
    assert decode.attributes["pdserve.time_to_first_token_s"] == pytest.approx(0.6)
    assert kv.attributes["pdserve.kv.bytes"] == 3 * 1024
    assert kv.attributes["pdserve.kv.descriptors"] == 2
    assert kv.attributes["pdserve.kv.outcome"] == "recovered"
    assert kv.attributes["pdserve.kv.problem"] == "checksum"
    assert kv.status.status_code == StatusCode.ERROR


def test_no_trace_context_means_no_engine_spans(tracer, exporter) -> None:
    record_engine_spans(tracer, "prefill", None, RequestTiming(1.0, finished=2.0), {})
    assert exporter.get_finished_spans() == ()


def test_dashboard_queries_only_metrics_the_code_exports() -> None:
    dashboard = json.loads((ROOT / "k8s" / "dashboards" / "pdserve.json").read_text())
    used = set(re.findall(r"ray_(pdserve_[a-z0-9_]+)", json.dumps(dashboard)))
    sides = ("router", "replica")
    code = "".join((ROOT / "deployments" / side / "telemetry.py").read_text() for side in sides)
    exported = set(re.findall(r'"(pdserve_[a-z0-9_]+)"', code))
    assert used
    base = {re.sub(r"_(total|bucket|sum|count)$", "", name) for name in used}
    assert base <= exported, base - exported


def test_engine_metrics_sample_a_prefix_cache_with_lookups_and_no_hits() -> None:
    """Ray's counters refuse `inc(0)`: a sample with lookups but no hits (the common case on a
    cold cache) must not fail, or the hit-rate gauge goes stale and the log fills up."""
    from deployments.replica.telemetry import EngineMetrics
    from engine.spec_decode.ngram import SpecDecodeStats
    from engine.stats import EngineStats

    def reading(queries: int, hits: int, spec: SpecDecodeStats | None = None) -> EngineStats:
        """The engine's counters run from its start; the metrics add the deltas."""
        return EngineStats(
            num_blocks=10,
            num_free_blocks=8,
            num_running=1,
            num_waiting=0,
            num_held_requests=0,
            queued_prompt_tokens=0,
            prefix_cache_queries=queries,
            prefix_cache_hits=hits,
            spec_decode=spec or SpecDecodeStats(),
        )

    metrics = EngineMetrics()
    metrics.sample(reading(32, 0))  # lookups, no hits
    metrics.sample(reading(64, 16))
    metrics.sample(reading(64, 16))  # no lookups since
    # Speculative decoding: drafts all rejected (no accepted-token increment), then accepted.
    metrics.sample(reading(64, 16, SpecDecodeStats(2, 6, 0)))
    metrics.sample(reading(64, 16, SpecDecodeStats(3, 9, 4)))
    assert metrics._seen is not None and metrics._seen.spec_decode == SpecDecodeStats(3, 9, 4)


def test_engine_metrics_count_what_the_kv_checks_found() -> None:
    """The KV check counters (blocks verified, blocks corrupted, failed, fenced, unanswered
    and timed-out reads, time spent summing blocks) reach Prometheus as the deltas of the
    engine's counters, never as `inc(0)`."""
    from deployments.replica.telemetry import EngineMetrics
    from engine.stats import EngineStats

    class Recording:
        def __init__(self) -> None:
            self.increments: list[float] = []

        def inc(self, value: float, tags: dict[str, str] | None = None) -> None:
            assert value > 0  # Ray's counters refuse anything else
            self.increments.append(value if tags is None else (value, tags["side"]))

    def reading(**kv: int) -> EngineStats:
        return EngineStats(10, 8, 1, 0, 0, 0, kv_transfer={"blocks_read": 99, **kv})

    metrics = EngineMetrics()
    recorded = {name: Recording() for name in metrics.kv_counters}
    metrics.kv_counters = recorded  # type: ignore[assignment]
    metrics.kv_checksum_seconds = seconds = Recording()  # type: ignore[assignment]
    metrics.sample(reading(blocks_verified=3, checksum_us_verified=1500))
    metrics.sample(reading(blocks_verified=3, checksum_us_verified=1500))  # nothing new
    metrics.sample(
        reading(
            blocks_verified=5,
            blocks_corrupted=1,
            checksum_failures=1,
            checksum_us_verified=2000,
            checksum_us_produced=250,
        )
    )
    metrics.sample(
        reading(
            blocks_verified=5,
            fenced_reads=2,
            unanswered_reads=1,
            timed_out_reads=1,
            leases_expired=2,
        )
    )
    metrics.sample(EngineStats(10, 8, 1, 0, 0, 0))  # an engine without KV transfer
    # The time spent summing blocks, in seconds, by side.
    assert seconds.increments == [(0.0015, "verified"), (0.00025, "produced"), (0.0005, "verified")]
    assert {name: r.increments for name, r in recorded.items()} == {
        "blocks_verified": [3, 2],
        "blocks_corrupted": [1],
        "checksum_failures": [1],
        "fenced_reads": [2],
        "unanswered_reads": [1],
        "timed_out_reads": [1],
        "leases_expired": [2],
    }
