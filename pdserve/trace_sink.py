"""A minimal OTLP/gRPC trace receiver: `pdserve trace-sink` prints the spans it receives, one
JSON object per line. For local development without Jaeger or Tempo, and for tests."""

from __future__ import annotations

import json
import signal
import sys
import threading
from collections.abc import Callable
from concurrent import futures
from typing import Any

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

STATUS_ERROR = 2  # opentelemetry.proto.trace.v1.Status.STATUS_CODE_ERROR


class SpanSink(trace_service_pb2_grpc.TraceServiceServicer):
    """Keeps every exported span as a plain dict (and hands each to `on_span`, if given)."""

    def __init__(self, on_span: Callable[[dict[str, Any]], None] | None = None) -> None:
        self.spans: list[dict[str, Any]] = []
        self.on_span = on_span
        self._lock = threading.Lock()

    def Export(self, request: Any, context: Any) -> Any:
        received: list[dict[str, Any]] = []
        for resource_spans in request.resource_spans:
            resource = _attributes(resource_spans.resource.attributes)
            for scope_spans in resource_spans.scope_spans:
                received.extend(_span(span, resource) for span in scope_spans.spans)
        with self._lock:
            self.spans.extend(received)
        if self.on_span is not None:
            for span in received:
                self.on_span(span)
        return trace_service_pb2.ExportTraceServiceResponse()

    def trace(self, trace_id: str) -> dict[str, dict[str, Any]]:
        """The spans of one trace, by name."""
        with self._lock:
            return {s["name"]: s for s in self.spans if s["trace_id"] == trace_id}

    def find(self, predicate: Callable[[dict[str, Any]], bool]) -> list[dict[str, Any]]:
        with self._lock:
            return [s for s in self.spans if predicate(s)]


def start_sink(sink: SpanSink, host: str = "127.0.0.1", port: int = 0) -> tuple[grpc.Server, int]:
    """Serve `sink` as an OTLP/gRPC endpoint; returns the server and its port."""
    server = grpc.server(futures.ThreadPoolExecutor(4))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(sink, server)
    bound = server.add_insecure_port(f"{host}:{port}")
    if bound == 0:
        raise ValueError(f"cannot listen on {host}:{port}")
    server.start()
    return server, bound


def run(host: str, port: int, quiet: bool) -> None:
    """`pdserve trace-sink`: print spans until interrupted."""

    def show(span: dict[str, Any]) -> None:
        print(json.dumps(span), flush=True)

    stopping = threading.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda *_: stopping.set())
    sink = SpanSink(None if quiet else show)
    server, bound = start_sink(sink, host, port)
    print(f"pdserve: OTLP/gRPC trace sink on {host}:{bound}", file=sys.stderr, flush=True)
    stopping.wait()
    server.stop(0)


def _value(any_value: Any) -> Any:
    kind = any_value.WhichOneof("value")
    if kind == "array_value":
        return [_value(v) for v in any_value.array_value.values]
    return getattr(any_value, kind) if kind else None


def _attributes(key_values: Any) -> dict[str, Any]:
    return {kv.key: _value(kv.value) for kv in key_values}


def _span(span: Any, resource: dict[str, Any]) -> dict[str, Any]:
    return {
        "name": span.name,
        "trace_id": span.trace_id.hex(),
        "span_id": span.span_id.hex(),
        "parent": span.parent_span_id.hex(),
        "start": span.start_time_unix_nano,
        "end": span.end_time_unix_nano,
        "attributes": _attributes(span.attributes),
        "status": span.status.code,
        "message": span.status.message,
        "service": resource.get("service.name"),
    }
