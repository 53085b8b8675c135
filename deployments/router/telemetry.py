"""The router's telemetry: a `router.request` span per request and the request-level metrics,
measured where the client sees them."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from opentelemetry import trace
from opentelemetry.trace import Span, SpanKind, Tracer

from deployments.metrics import ReplicaMetrics, each
from deployments.telemetry import (
    LATENCY_BUCKETS_S,
    extract_context,
    inject_context,
    request_attributes,
    set_error,
)
from engine.request import SamplingParams

if TYPE_CHECKING:
    from deployments.router.migration import Migration


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
        """Its generating leg moved to another engine (deployments/router/migration.py)."""
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


# How a request ends (`pdserve_requests{outcome}`): every one is a series from start-up.
OUTCOMES = (
    "ok",
    "aborted",  # ended by an Abort
    "cancelled",  # the client went away
    "invalid",
    "unauthenticated",
    "timeout",
    "unavailable",  # no engine replica running yet
    "overloaded",
    "error",
)


class RouterMetrics:
    """Request-level metrics, measured where the client sees them (the router)."""

    def __init__(
        self, roles: tuple[str, ...] = ("decode", "prefill"), make: ReplicaMetrics | None = None
    ) -> None:
        """`roles`: the engine roles a request can move to (migrations' targets)."""
        make = make or ReplicaMetrics()
        self.ttft = make.histogram(
            "pdserve_ttft_seconds", "Time to first token", LATENCY_BUCKETS_S, ("route",)
        )
        self.tpot = make.histogram(
            "pdserve_tpot_seconds",
            "Time per output token after the first",
            LATENCY_BUCKETS_S,
            ("route",),
        )
        self.e2e = make.histogram(
            "pdserve_e2e_seconds", "Request latency, end to end", LATENCY_BUCKETS_S, ("route",)
        )
        # At 0 from start-up: each outcome (under route "none": sum over routes to alert).
        outcomes = [{"outcome": outcome, "route": "none"} for outcome in OUTCOMES]
        self.requests = make.counter(
            "pdserve_requests", "Requests by outcome", ("outcome", "route"), outcomes
        )
        self.prompt_tokens = make.counter("pdserve_prompt_tokens", "Prompt tokens")
        self.generation_tokens = make.counter("pdserve_generation_tokens", "Generated tokens")
        self.migrations = make.counter(
            "pdserve_migrations",
            "Requests moved to another engine after theirs failed, by the role moved to",
            ("target",),
            each("target", roles),
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
