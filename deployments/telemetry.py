"""OpenTelemetry tracing and Serve metrics for the router and the engine replicas.

Tracing: one TracerProvider per process (per replica), with `service.name` = pdserve-<role> and
the replica id; spans go to an OTLP/gRPC collector through a batch processor when an endpoint is
configured (`otlp_endpoint`, or OTEL_EXPORTER_OTLP_ENDPOINT); without one the tracer is
OpenTelemetry's no-op tracer, which costs next to nothing. The W3C trace context travels from the
client (gRPC metadata, HTTP headers) through the router into each engine request as a carrier
dict, so every request leaves one trace: router.request -> prefill, decode -> kv_transfer.

Engine spans are built after the fact from the engine's RequestTiming (wall-clock moments taken
in the engine loop thread), with explicit start and end times.

Metrics go through `ray.serve.metrics`, so Ray's Prometheus endpoint exports them (prefixed
`ray_`). They are created lazily: the module imports without Ray running.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from opentelemetry import trace
from opentelemetry.trace import Span, SpanKind, Status, StatusCode, Tracer
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from engine.request import RequestTiming, SamplingParams
from engine.spec_decode.ngram import SpecDecodeStats

if TYPE_CHECKING:
    from deployments.migration import Migration
    from engine.core.kv_cache_manager import PrefixCacheStats
    from engine.engine_core import EngineStats

OTLP_ENDPOINT_ENV = "OTEL_EXPORTER_OTLP_ENDPOINT"
_PROPAGATOR = TraceContextTextMapPropagator()
_NS = 1_000_000_000

# Seconds; from a few ms (a decode step) to minutes (a long generation).
LATENCY_BUCKETS_S = [0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300]


class Tracing:
    """A process's tracer (no-op without an endpoint) and its provider, to flush on exit."""

    def __init__(self, role: str, replica_id: str, endpoint: str | None = None) -> None:
        self.endpoint = endpoint or os.environ.get(OTLP_ENDPOINT_ENV) or None
        self._provider: Any = None
        if self.endpoint is None:
            self.tracer: Tracer = trace.NoOpTracer()
            return
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor

        resource = Resource.create(
            {
                "service.name": f"pdserve-{role}",
                "service.instance.id": replica_id,
                "pdserve.role": role,
            }
        )
        self._provider = TracerProvider(resource=resource)
        exporter = OTLPSpanExporter(endpoint=self.endpoint, insecure=_insecure(self.endpoint))
        self._provider.add_span_processor(BatchSpanProcessor(exporter, schedule_delay_millis=1000))
        self.tracer = self._provider.get_tracer("pdserve")

    @property
    def enabled(self) -> bool:
        return self._provider is not None

    def shutdown(self) -> None:
        if self._provider is not None:
            self._provider.shutdown()  # flushes what is queued


def _insecure(endpoint: str) -> bool:
    return not endpoint.startswith("https://")


def extract_context(carrier: Mapping[str, str] | None) -> Any:
    """The parent context in a W3C carrier (gRPC metadata or HTTP headers), or None."""
    if not carrier:
        return None
    lowered = {str(k).lower(): str(v) for k, v in carrier.items()}
    if "traceparent" not in lowered:
        return None
    return _PROPAGATOR.extract(lowered)


def inject_context(span: Span) -> dict[str, str]:
    """A carrier that makes `span` the parent of spans made elsewhere (engine replicas)."""
    carrier: dict[str, str] = {}
    if span.get_span_context().is_valid:
        _PROPAGATOR.inject(carrier, trace.set_span_in_context(span))
    return carrier


def request_attributes(model: str, params: SamplingParams) -> dict[str, Any]:
    """GenAI semantic-convention attributes of a request."""
    return {
        "gen_ai.operation.name": "text_completion",
        "gen_ai.system": "pdserve",
        "gen_ai.request.model": model,
        "gen_ai.request.max_tokens": params.max_tokens,
        "gen_ai.request.temperature": params.temperature,
        "gen_ai.request.top_p": params.top_p,
    }


def set_error(span: Span, message: str) -> None:
    span.set_status(Status(StatusCode.ERROR, message))


def _ns(seconds: float) -> int:
    return int(seconds * _NS)


def record_engine_spans(
    tracer: Tracer,
    role: str,
    carrier: Mapping[str, str] | None,
    timing: RequestTiming,
    attributes: dict[str, Any],
    error: str | None = None,
    kv: dict[str, Any] | None = None,
) -> None:
    """The engine's part of a request's trace, from its timing: `prefill` or `decode` (the
    colocated engine's is `engine`), and under a decode span the `kv_transfer` it waited for."""
    parent = extract_context(carrier)
    if parent is None or timing.finished is None:
        return
    name = {"prefill": "prefill", "decode": "decode"}.get(role, "engine")
    span = tracer.start_span(
        name, context=parent, kind=SpanKind.INTERNAL, start_time=_ns(timing.arrival)
    )
    span.set_attributes({**attributes, **_phase_attributes(timing)})
    if error is not None:
        set_error(span, error)
    if timing.kv_load_start is not None and timing.kv_load_end is not None:
        _record_kv_transfer(tracer, span, timing, kv or {})
    span.end(end_time=_ns(timing.finished))


def _phase_attributes(timing: RequestTiming) -> dict[str, Any]:
    attributes: dict[str, Any] = {}
    ready = timing.kv_load_end or timing.arrival  # a decode waits for its KV, then queues
    if timing.first_scheduled is not None:
        attributes["pdserve.queue_time_s"] = max(0.0, timing.first_scheduled - ready)
        if timing.finished is not None:
            attributes["pdserve.compute_time_s"] = timing.finished - timing.first_scheduled
    if timing.first_token is not None:
        attributes["pdserve.time_to_first_token_s"] = timing.first_token - timing.arrival
    return attributes


def _record_kv_transfer(
    tracer: Tracer, parent: Span, timing: RequestTiming, kv: dict[str, Any]
) -> None:
    assert timing.kv_load_start is not None and timing.kv_load_end is not None
    span = tracer.start_span(
        "kv_transfer",
        context=trace.set_span_in_context(parent),
        kind=SpanKind.CLIENT,
        start_time=_ns(timing.kv_load_start),
    )
    outcome = timing.kv_load_outcome or "ok"
    span.set_attributes(
        {
            "pdserve.kv.transport": kv.get("transport", ""),
            "pdserve.kv.blocks": timing.kv_load_blocks,
            "pdserve.kv.bytes": timing.kv_load_blocks * int(kv.get("block_bytes", 0)),
            "pdserve.kv.duration_s": timing.kv_load_end - timing.kv_load_start,
            "pdserve.kv.outcome": outcome,
        }
    )
    if outcome != "ok":
        set_error(span, f"KV transfer {outcome}")
    span.end(end_time=_ns(timing.kv_load_end))


class RouterTelemetry:
    """The router's span and metrics per request (`observe()` one, then feed it)."""

    def __init__(self, tracer: Tracer | None = None, metrics: Any = None) -> None:
        self.tracer = tracer or trace.NoOpTracer()
        self.metrics = metrics  # RouterMetrics inside Serve; None elsewhere

    def observe(self, carrier: Mapping[str, str] | None) -> ObservedRequest:
        span = self.tracer.start_span(
            "router.request", context=extract_context(carrier), kind=SpanKind.SERVER
        )
        return ObservedRequest(span, self.metrics)

    def rejected(
        self, carrier: Mapping[str, str] | None, message: str, outcome: str = "invalid"
    ) -> None:
        """A request refused before it could be parsed (malformed, missing fields; outcome
        "unauthenticated": no valid API key)."""
        observed = self.observe(carrier)
        observed.failed(outcome, message)
        observed.end()


class ObservedRequest:
    """One request seen by the router: its `router.request` span and its metrics."""

    def __init__(self, span: Span, metrics: Any) -> None:
        self.span = span
        self.metrics = metrics
        self.route = ""
        self.prompt_tokens = 0
        self.completion_tokens = 0
        self.ttft_s: float | None = None
        self.e2e_s: float | None = None
        self.finish_reason: str | None = None
        self.outcome = "cancelled"  # until it ends one way or another
        self.migrations = 0

    def carrier(self) -> dict[str, str]:
        return inject_context(self.span)

    def started(
        self, request_id: str, model: str, params: SamplingParams, prompt_tokens: int
    ) -> None:
        self.prompt_tokens = prompt_tokens
        self.span.set_attributes(
            {**request_attributes(model, params), "pdserve.request_id": request_id}
        )

    def chunk(self, chunk: Any) -> None:
        """A ResponseChunk sent to the client."""
        self.route = chunk.route or self.route
        self.completion_tokens += len(chunk.token_ids)
        if self.ttft_s is None and chunk.token_ids:
            self.ttft_s = chunk.ttft_s
        if chunk.finish_reason is not None:
            self.finish_reason = chunk.finish_reason
            self.e2e_s = chunk.e2e_s
            self.outcome = "ok" if chunk.finish_reason != "abort" else "aborted"

    def migrated(self, move: Migration) -> None:
        """Its generating leg moved to another engine (deployments/migration.py)."""
        self.migrations += 1
        self.span.add_event(
            "pdserve.migration",
            {
                "pdserve.migration.attempt": move.attempt,
                "pdserve.migration.target": move.target,
                "pdserve.migration.output_tokens": move.num_output_tokens,
                "pdserve.migration.reason": move.reason,
            },
        )
        if self.metrics is not None:
            self.metrics.migrations.inc(1, {"target": move.target})

    def failed(self, outcome: str, message: str) -> None:
        self.outcome = outcome
        set_error(self.span, message)

    def end(self) -> None:
        attributes: dict[str, Any] = {
            "gen_ai.usage.input_tokens": self.prompt_tokens,
            "gen_ai.usage.output_tokens": self.completion_tokens,
            "pdserve.route": self.route,
            "pdserve.outcome": self.outcome,
            "pdserve.migrations": self.migrations,
        }
        if self.finish_reason is not None:
            attributes["gen_ai.response.finish_reasons"] = [self.finish_reason]
        if self.ttft_s is not None:
            attributes["pdserve.ttft_s"] = self.ttft_s
        self.span.set_attributes(attributes)
        self.span.end()
        if self.metrics is not None:
            self.metrics.observe(self)


def _tags(*keys: str) -> Any:
    return keys  # ray.serve.metrics annotates tag_keys as a 1-tuple; any tuple works


class RouterMetrics:
    """Request-level metrics, measured where the client sees them (the router)."""

    def __init__(self) -> None:
        from ray.serve import metrics

        self.ttft = metrics.Histogram(
            "pdserve_ttft_seconds", "Time to first token", LATENCY_BUCKETS_S, ("route",)
        )
        self.tpot = metrics.Histogram(
            "pdserve_tpot_seconds",
            "Time per output token after the first",
            LATENCY_BUCKETS_S,
            ("route",),
        )
        self.e2e = metrics.Histogram(
            "pdserve_e2e_seconds", "Request latency, end to end", LATENCY_BUCKETS_S, ("route",)
        )
        self.requests = metrics.Counter(
            "pdserve_requests", "Requests by outcome", _tags("outcome", "route")
        )
        self.prompt_tokens = metrics.Counter("pdserve_prompt_tokens", "Prompt tokens")
        self.generation_tokens = metrics.Counter("pdserve_generation_tokens", "Generated tokens")
        self.migrations = metrics.Counter(
            "pdserve_migrations",
            "Requests moved to another engine after theirs failed, by the role moved to",
            ("target",),
        )

    def observe(self, request: ObservedRequest) -> None:
        tags = {"route": request.route or "none"}
        self.requests.inc(1, {"outcome": request.outcome, **tags})
        if request.prompt_tokens:
            self.prompt_tokens.inc(request.prompt_tokens)
        if request.completion_tokens:
            self.generation_tokens.inc(request.completion_tokens)
        if request.ttft_s is not None:
            self.ttft.observe(request.ttft_s, tags)
        if request.e2e_s is not None:
            self.e2e.observe(request.e2e_s, tags)
            if request.ttft_s is not None and request.completion_tokens > 1:
                tpot = (request.e2e_s - request.ttft_s) / (request.completion_tokens - 1)
                self.tpot.observe(tpot, tags)


class EngineMetrics:
    """An engine replica's metrics: queues, KV cache, prefix cache, preemptions, transfers."""

    def __init__(self) -> None:
        from ray.serve import metrics

        self.running = metrics.Gauge("pdserve_running_requests", "Requests running")
        self.waiting = metrics.Gauge("pdserve_waiting_requests", "Requests waiting")
        self.kv_usage = metrics.Gauge("pdserve_kv_cache_usage", "Fraction of KV blocks in use")
        self.prefix_hit_rate = metrics.Gauge(
            "pdserve_prefix_cache_hit_rate", "Prefix-cache hit rate (tokens) since last sample"
        )
        self.prefix_queries = metrics.Counter(
            "pdserve_prefix_cache_queries", "Prompt tokens looked up in the prefix cache"
        )
        self.prefix_hits = metrics.Counter(
            "pdserve_prefix_cache_hits", "Prompt tokens found in the prefix cache"
        )
        self.preemptions = metrics.Counter("pdserve_preemptions", "Requests preempted")
        self.kv_bytes = metrics.Counter(
            "pdserve_kv_transfer_bytes", "KV bytes read from prefill engines", ("transport",)
        )
        self.kv_seconds = metrics.Histogram(
            "pdserve_kv_transfer_seconds",
            "KV transfer duration",
            LATENCY_BUCKETS_S,
            ("transport",),
        )
        self.kv_failures = metrics.Counter(
            "pdserve_kv_transfer_failures",
            "KV transfers that failed",
            _tags("transport", "outcome"),
        )
        # Speculative decoding (vLLM's spec_decode counters): acceptance rate = accepted / draft
        # tokens, mean accepted length = 1 + accepted / drafts.
        self.spec_counters = {
            field: metrics.Counter(f"pdserve_spec_decode_{field}", help_text)
            for field, help_text in (
                ("num_drafts", "Verification steps of requests with drafts"),
                ("num_draft_tokens", "Draft tokens verified"),
                ("num_accepted_tokens", "Draft tokens accepted"),
            )
        }
        self.spec_acceptance = metrics.Gauge(
            "pdserve_spec_decode_acceptance_rate", "Accepted / draft tokens since the engine began"
        )
        self._preemptions_seen = 0
        self._spec_seen = SpecDecodeStats()

    def sample(
        self, stats: EngineStats, prefix: PrefixCacheStats, spec: SpecDecodeStats | None = None
    ) -> None:
        """Periodic: gauges from a stats snapshot, counters from the deltas since last time."""
        self.running.set(stats.num_running)
        self.waiting.set(stats.num_waiting)
        self.kv_usage.set(stats.kv_cache_usage)
        if prefix.queries:
            self.prefix_queries.inc(prefix.queries)
            if prefix.hits:  # Ray's counters refuse an increment of 0
                self.prefix_hits.inc(prefix.hits)
            self.prefix_hit_rate.set(prefix.hit_rate)
        preemptions = stats.num_preemptions
        if preemptions > self._preemptions_seen:
            self.preemptions.inc(preemptions - self._preemptions_seen)
            self._preemptions_seen = preemptions
        if spec is not None and spec.num_drafts > self._spec_seen.num_drafts:
            current = dataclasses.replace(spec)  # one reading of counters another thread moves
            for field, counter in self.spec_counters.items():
                delta = getattr(current, field) - getattr(self._spec_seen, field)
                if delta > 0:  # Ray's counters refuse an increment of 0
                    counter.inc(delta)
            self.spec_acceptance.set(current.acceptance_rate)
            self._spec_seen = current

    def observe_transfer(self, timing: RequestTiming, transport: str, block_bytes: int) -> None:
        if timing.kv_load_start is None or timing.kv_load_end is None:
            return
        tags = {"transport": transport}
        self.kv_seconds.observe(timing.kv_load_end - timing.kv_load_start, tags)
        if timing.kv_load_blocks and block_bytes:
            self.kv_bytes.inc(timing.kv_load_blocks * block_bytes, tags)
        if timing.kv_load_outcome not in (None, "ok"):
            self.kv_failures.inc(1, {**tags, "outcome": str(timing.kv_load_outcome)})
