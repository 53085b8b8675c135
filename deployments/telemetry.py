"""OpenTelemetry tracing shared by the router and the engine replicas (their own spans and
metrics: deployments/router/telemetry.py, deployments/replica/telemetry.py).

Tracing: one TracerProvider per process (per replica), with `service.name` = pdserve-<role> and
the replica id; spans go to an OTLP/gRPC collector through a batch processor when an endpoint is
configured (`otlp_endpoint`, or OTEL_EXPORTER_OTLP_ENDPOINT); without one the tracer is
OpenTelemetry's no-op tracer, which costs next to nothing. The W3C trace context travels from the
client (gRPC metadata, HTTP headers) through the router into each engine request as a carrier
dict, so every request leaves one trace: router.request -> prefill, decode -> kv_transfer.

Metrics go through Ray's metrics API (deployments/metrics.py), so Ray's Prometheus endpoint
exports them (prefixed `ray_`).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from opentelemetry import trace
from opentelemetry.trace import Span, Status, StatusCode, Tracer
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from engine.request import SamplingParams

OTLP_ENDPOINT_ENV = "OTEL_EXPORTER_OTLP_ENDPOINT"
_PROPAGATOR = TraceContextTextMapPropagator()

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
