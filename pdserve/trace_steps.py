"""`pdserve trace steps`: every engine replica's per-step scheduler trace from a running
deployment (engine/core/step_trace.py), through the gRPC API (a key where the app has keys),
as JSON lines or as a Chrome / Perfetto trace file (chrome://tracing, ui.perfetto.dev).

    pdserve trace steps --keep-steps 4096          # start tracing on every engine
    pdserve trace steps > steps.jsonl              # later: what they kept
    pdserve trace steps --format chrome --out steps.json
    pdserve trace steps --keep-steps -1            # stop
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any, TextIO

from pdserve.cli_options import EndpointOptions

FORMATS = ("jsonl", "chrome")


@dataclass
class TraceStepsOptions(EndpointOptions):
    """Where `trace steps` asks, and what it writes."""

    max_steps: int = 0
    """the newest this many steps of each engine (0: all it keeps)"""
    keep_steps: int = 0
    """first have every engine keep this many steps from now on (-1: stop tracing)"""
    format: str = "jsonl"
    """jsonl (a record per step, with its engine's role and replica) or chrome (a trace file
    for chrome://tracing and Perfetto)"""
    out: str | None = None
    """write here instead of to stdout"""
    timeout: float = 60.0
    """seconds the call may take"""

    def __post_init__(self) -> None:
        if self.format not in FORMATS:
            raise ValueError(f"format must be one of {FORMATS}, got {self.format!r}")
        if self.max_steps < 0 or self.keep_steps < -1:
            raise ValueError("max_steps must be >= 0 and keep_steps >= -1")


def run(options: TraceStepsOptions) -> int:
    import grpc

    from pdserve.client import GenerationClient

    with GenerationClient.connect(options) as client:
        try:
            reply = client.step_trace(options.max_steps, options.keep_steps, options.timeout)
        except grpc.RpcError as exc:
            print(f"pdserve: error: {exc.code().name}: {exc.details()}", file=sys.stderr)
            return 1
    engines = [_engine(e) for e in reply.engines]
    for engine in engines:
        if engine["left_out"]:
            print(
                f"pdserve: {engine['role']} {engine['replica_id']}: its oldest "
                f"{engine['left_out']} steps left out (the answer's size bound; --max-steps)",
                file=sys.stderr,
            )
        if engine["error"]:
            print(
                f"pdserve: {engine['role']} {engine['replica_id']}: {engine['error']}",
                file=sys.stderr,
            )
    out = open(options.out, "w") if options.out else sys.stdout  # noqa: SIM115
    try:
        write(engines, options.format, out)
    finally:
        if out is not sys.stdout:
            out.close()
    return 0


def _engine(message: Any) -> dict[str, Any]:
    return {
        "role": message.role,
        "replica_id": message.replica_id,
        "error": message.error,
        "left_out": message.left_out,
        "records": [json.loads(line) for line in message.records],
    }


def write(engines: list[dict[str, Any]], fmt: str, out: TextIO) -> None:
    if fmt == "jsonl":
        for line in jsonl(engines):
            out.write(line + "\n")
    else:
        json.dump(chrome_trace(engines), out)
        out.write("\n")


def jsonl(engines: Iterable[dict[str, Any]]) -> Iterator[str]:
    """A line per step record, naming its engine."""
    for engine in engines:
        for record in engine["records"]:
            yield json.dumps({"role": engine["role"], "replica_id": engine["replica_id"], **record})


def chrome_trace(engines: list[dict[str, Any]]) -> dict[str, Any]:
    """Chrome's trace event format: a process per engine; counters for its queues, blocks and
    scheduled tokens, and an instant event per step carrying what it decided."""
    events: list[dict[str, Any]] = []
    for pid, engine in enumerate(engines, start=1):
        name = f"{engine['role']} {engine['replica_id']}"
        events.append({"ph": "M", "name": "process_name", "pid": pid, "args": {"name": name}})
        for record in engine["records"]:
            events.extend(_step_events(pid, record))
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def _step_events(pid: int, record: dict[str, Any]) -> list[dict[str, Any]]:
    ts = record["time"] * 1e6  # microseconds, as the format wants
    base = {"pid": pid, "tid": 0, "ts": ts}
    tiers = {
        f"{tier} {kind}": figures[kind]
        for tier, figures in record["tiers"].items()
        for kind in ("free", "cached")
    }
    decision = {
        key: record[key]
        for key in (
            "new",
            "resumed",
            "kept_running",
            "preempted",
            "started_loading",
            "loaded",
            "prefix_hits",
        )
        if record.get(key)
    }
    return [
        {
            **base,
            "ph": "C",
            "name": "queues",
            "args": {
                "waiting": record["waiting"],
                "skipped_waiting": record["skipped_waiting"],
                "running": record["running"],
            },
        },
        {**base, "ph": "C", "name": "KV blocks", "args": tiers},
        {
            **base,
            "ph": "C",
            "name": "scheduled tokens",
            "args": {"tokens": record["scheduled_tokens"]},
        },
        {**base, "ph": "i", "s": "p", "name": f"step {record['step']}", "args": decision},
    ]
