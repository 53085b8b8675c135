"""Traces and metrics of the Serve app: a real OTLP/gRPC receiver (the OTLP TraceService from
opentelemetry-proto, served in this process) gets the spans every replica exports; Ray's
Prometheus endpoint serves the metrics."""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import grpc
import pytest

from deployments.launch import APP_NAME
from pdserve.client import GenerationClient, generate_request
from pdserve.trace_sink import STATUS_ERROR, SpanSink, start_sink
from tests.integration.serving import AppSettings, ServeCluster, ServedApp
from tests.waiting import wait_until

pytestmark = pytest.mark.integration

ENGINE_ARGS = {"max_model_len": 256, "kv_cache_memory_bytes": 16 << 20}


def long_prompt(tag: str) -> str:
    """A prompt of a few full blocks whose KV crosses over NIXL, distinct from the first token
    on for each tag: a prompt a decode replica already holds skips the prefill leg."""
    return f"{tag}: " + "In the beginning the universe was created. " * 6


CLIENT_TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN_ID = "00f067aa0ba902b7"


@dataclass
class Served:
    receiver: SpanSink
    app: ServedApp

    @property
    def client(self) -> GenerationClient:
        return self.app.client


@pytest.fixture(scope="module")
def served(serve_cluster: ServeCluster) -> Iterator[Served]:
    receiver = SpanSink()
    server, otlp_port = start_sink(receiver)
    settings = AppSettings(
        app={
            "model": "tiny",
            "engine_args": ENGINE_ARGS,
            "num_cpus_per_engine": 0.5,
            "transport": "nixl",
            "otlp_endpoint": f"http://127.0.0.1:{otlp_port}",
        }
    )
    try:
        with serve_cluster.serving(settings) as app:
            yield Served(receiver, app)
    finally:
        server.stop(0)


def _traceparent(trace_id: str, span_id: str) -> tuple[tuple[str, str], ...]:
    return (("traceparent", f"00-{trace_id}-{span_id}-01"),)


def test_one_trace_per_request_across_router_prefill_kv_transfer_decode(served: Served) -> None:
    request = generate_request(long_prompt("trace"), max_tokens=12, temperature=0.0)
    metadata = served.client.metadata + _traceparent(CLIENT_TRACE_ID, CLIENT_SPAN_ID)
    responses = list(served.client.stub.Generate(request, metadata=metadata, timeout=120))
    assert responses[-1].route == "disaggregated"
    names = {"router.request", "prefill", "kv_transfer", "decode"}
    assert wait_until(lambda: names <= set(served.receiver.trace(CLIENT_TRACE_ID)), 30), (
        served.receiver.trace(CLIENT_TRACE_ID).keys()
    )
    spans = served.receiver.trace(CLIENT_TRACE_ID)
    router, prefill = spans["router.request"], spans["prefill"]
    kv, decode = spans["kv_transfer"], spans["decode"]
    # The client's traceparent is honoured: its span is the router span's parent.
    assert router["parent"] == CLIENT_SPAN_ID
    assert prefill["parent"] == router["span_id"] and decode["parent"] == router["span_id"]
    assert kv["parent"] == decode["span_id"]
    assert (router["service"], prefill["service"], decode["service"], kv["service"]) == (
        "pdserve-router",
        "pdserve-prefill",
        "pdserve-decode",
        "pdserve-decode",
    )
    # Engine spans sit inside the router's, in flow order (timestamps from the engines).
    assert router["start"] <= prefill["start"] <= prefill["end"] <= decode["start"]
    assert decode["start"] <= kv["start"] <= kv["end"] <= decode["end"] <= router["end"]
    attrs = router["attributes"]
    assert attrs["gen_ai.request.model"] == "tiny"
    assert attrs["gen_ai.request.max_tokens"] == 12
    assert attrs["gen_ai.request.temperature"] == 0.0
    assert attrs["gen_ai.usage.input_tokens"] == len(responses[0].prompt_token_ids)
    assert attrs["gen_ai.usage.output_tokens"] == 12
    assert attrs["gen_ai.response.finish_reasons"] == ["length"]
    assert prefill["attributes"]["pdserve.queue_time_s"] >= 0
    assert prefill["attributes"]["pdserve.compute_time_s"] > 0
    assert prefill["attributes"]["gen_ai.usage.input_tokens"] == attrs["gen_ai.usage.input_tokens"]
    assert decode["attributes"]["gen_ai.usage.output_tokens"] == 12
    assert decode["attributes"]["pdserve.time_to_first_token_s"] > 0
    assert kv["attributes"]["pdserve.kv.transport"] == "nixl"
    assert kv["attributes"]["pdserve.kv.blocks"] > 0
    assert kv["attributes"]["pdserve.kv.bytes"] > 0
    # Runs of blocks consecutive on both sides: at least one, at most one per block.
    assert 1 <= kv["attributes"]["pdserve.kv.descriptors"] <= kv["attributes"]["pdserve.kv.blocks"]
    assert kv["attributes"]["pdserve.kv.outcome"] == "ok" and kv["status"] != STATUS_ERROR
    assert "pdserve.kv.problem" not in kv["attributes"]
    # The decode engine took the prompt's KV with the prefill's token and computed none of it.
    assert kv["attributes"]["pdserve.kv.first_token_adopted"] is True


def test_a_prompt_the_decode_replica_holds_skips_the_prefill_leg_in_the_trace(
    served: Served,
) -> None:
    """Cache-aware disaggregation: the same prompt again finds all of it on the decode
    replica, which computes its last token itself; the trace says so (route decode_cached, a
    decode span, no prefill or KV transfer)."""
    prompt = long_prompt("again")
    first = served.client.complete(generate_request(prompt, max_tokens=4, temperature=0.0))
    assert first.route == "disaggregated"

    def again(attempt: int) -> tuple[str, list[Any]]:
        trace_id = f"2af7651916cd43dd8448eb211c8031{attempt:02x}"
        metadata = served.client.metadata + _traceparent(trace_id, "d7ad6b7169203333")
        request = generate_request(prompt, max_tokens=4, temperature=0.0)
        return trace_id, list(served.client.stub.Generate(request, metadata=metadata, timeout=120))

    # The decode replica's cache reaches the index a publishing period after the request.
    for attempt in range(20):
        trace_id, responses = again(attempt)
        if responses[-1].route == "decode_cached":
            break
    assert responses[-1].route == "decode_cached"
    assert [t for r in responses for t in r.token_ids] == first.token_ids
    names = {"router.request", "decode"}
    assert wait_until(lambda: names <= set(served.receiver.trace(trace_id)), 30)
    spans = served.receiver.trace(trace_id)
    assert spans["router.request"]["attributes"]["pdserve.route"] == "decode_cached"
    assert "prefill" not in spans and "kv_transfer" not in spans
    assert spans["decode"]["attributes"]["pdserve.cached_tokens"] > 0


def test_http_traceparent_header_is_honoured(served: Served) -> None:
    trace_id, parent = "5bf92f3577b34da6a3ce929d0e0e4737", "10f067aa0ba902b8"
    conn = served.app.connection(timeout=60)
    body = json.dumps({"prompt": long_prompt("http"), "max_tokens": 4, "temperature": 0})
    headers = {"Content-Type": "application/json", "traceparent": f"00-{trace_id}-{parent}-01"}
    conn.request("POST", "/v1/completions", body, headers)
    assert conn.getresponse().status == 200
    conn.close()
    names = {"router.request", "prefill", "kv_transfer", "decode"}
    assert wait_until(lambda: names <= set(served.receiver.trace(trace_id)), 30)
    assert served.receiver.trace(trace_id)["router.request"]["parent"] == parent


def test_without_a_client_traceparent_the_router_span_is_the_root(served: Served) -> None:
    response = list(
        served.client.stream(generate_request("Hello", max_tokens=3, request_id="r-root"))
    )
    assert response[-1].finish_reason

    def root() -> list[dict[str, Any]]:
        return served.receiver.find(
            lambda s: (
                s["name"] == "router.request"
                and s["attributes"].get("pdserve.request_id") == "r-root"
            )
        )

    assert wait_until(lambda: len(root()) == 1, 30)
    assert root()[0]["parent"] == ""


def test_bad_request_span_has_error_status(served: Served) -> None:
    trace_id = "0af7651916cd43dd8448eb211c80319c"
    metadata = served.client.metadata + _traceparent(trace_id, "b7ad6b7169203331")
    with pytest.raises(grpc.RpcError) as info:
        list(
            served.client.stub.Generate(
                generate_request("Hello", max_tokens=0), metadata=metadata, timeout=30
            )
        )
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert wait_until(lambda: "router.request" in served.receiver.trace(trace_id), 30)
    span = served.receiver.trace(trace_id)["router.request"]
    assert span["status"] == STATUS_ERROR and "max_tokens" in span["message"]
    assert span["attributes"]["pdserve.outcome"] == "invalid"


def test_injected_transfer_failure_is_recovered_and_traced(served: Served) -> None:
    from ray import serve

    expected = served.client.complete(
        generate_request(long_prompt("expected"), max_tokens=8, temperature=0.0)
    )
    decode = serve.get_deployment_handle("DecodeServer", app_name=APP_NAME)
    decode.inject_kv_failure.remote(0).result()
    trace_id = "1af7651916cd43dd8448eb211c80319d"
    metadata = served.client.metadata + _traceparent(trace_id, "c7ad6b7169203332")
    request = generate_request(long_prompt("injected"), max_tokens=8, temperature=0.0)
    got = list(served.client.stub.Generate(request, metadata=metadata, timeout=120))
    assert got[-1].finish_reason == expected.finish_reason  # the request still succeeds
    assert wait_until(lambda: "kv_transfer" in served.receiver.trace(trace_id), 30)
    kv = served.receiver.trace(trace_id)["kv_transfer"]
    assert kv["attributes"]["pdserve.kv.outcome"] == "recovered"
    assert kv["attributes"]["pdserve.kv.problem"] == "failed"  # the transport's (injected)
    assert "pdserve.kv.first_token_adopted" not in kv["attributes"]  # recomputed here instead
    assert kv["status"] == STATUS_ERROR


def test_prometheus_endpoint_exports_the_metrics(served: Served) -> None:
    """The counters and histograms grow with this app's requests. Series are told apart by
    growth, not by labels: an app an earlier module ran on this Ray had the same application,
    deployments and ranks (labels that stay put across restarts), and Ray's node agent keeps
    exporting a dead process's counters."""
    import ray

    node = ray._private.worker.global_worker.node
    url = f"http://{node.node_ip_address}:{node.metrics_export_port}/metrics"
    wanted = [
        "ray_pdserve_ttft_seconds_bucket",
        "ray_pdserve_tpot_seconds_bucket",
        "ray_pdserve_e2e_seconds_bucket",
        "ray_pdserve_requests_total",
        "ray_pdserve_prompt_tokens_total",
        "ray_pdserve_generation_tokens_total",
        "ray_pdserve_kv_transfer_bytes_total",
        "ray_pdserve_kv_transfer_descriptors_total",
        "ray_pdserve_kv_transfer_seconds_bucket",
        "ray_pdserve_prefix_cache_queries_total",
    ]
    gauges = [
        "ray_pdserve_kv_cache_usage",
        "ray_pdserve_running_requests",
        "ray_pdserve_waiting_requests",
    ]

    def scrape() -> dict[str, float]:
        """Each metric's sum over this application's series."""
        body = urllib.request.urlopen(url, timeout=10).read().decode()
        sums: dict[str, float] = {}
        for line in body.splitlines():
            if line.startswith("ray_pdserve_") and f'application="{APP_NAME}"' in line:
                name, _, value = line.rpartition(" ")
                metric = name.split("{", 1)[0]
                sums[metric] = sums.get(metric, 0.0) + float(value)
        return sums

    before = scrape()
    for i in range(4):
        served.client.complete(generate_request(long_prompt(f"metrics {i}"), max_tokens=6))
    after: dict[str, float] = {}

    def grown() -> bool:
        after.update(scrape())
        return all(after.get(name, 0.0) > before.get(name, 0.0) for name in wanted) and all(
            name in after for name in gauges
        )

    assert wait_until(grown, 90, period_s=2), {n: (before.get(n), after.get(n)) for n in wanted}


def _trace_steps(served: Served, *flags: str) -> subprocess.CompletedProcess[str]:
    """`pdserve trace steps` against the app, as an operator runs it."""
    target = f"127.0.0.1:{served.app.grpc_port}"
    command = [sys.executable, "-m", "pdserve.cli", "trace", "steps", "--target", target]
    return subprocess.run([*command, *flags], capture_output=True, text=True, timeout=120)


def test_pdserve_trace_steps_fetches_every_engines_scheduler_trace(served: Served) -> None:
    """Tracing is turned on in the running app, a request crosses it, and the records say
    what each engine's scheduler decided: the prefill engine computed the prompt, the decode
    engine admitted it to load the prompt's KV from the prefill engine first (the external
    hit), as JSON lines and as a Chrome trace; turned off again, the engines say so."""
    started = _trace_steps(served, "--keep-steps", "256")
    assert started.returncode == 0, started.stderr
    prompt = long_prompt("step trace")
    done = served.client.complete(generate_request(prompt, max_tokens=4, temperature=0.0))
    listed = _trace_steps(served)
    assert listed.returncode == 0, listed.stderr
    records = [json.loads(line) for line in listed.stdout.splitlines()]
    by_role: dict[str, list[dict[str, Any]]] = {}
    for record in records:
        by_role.setdefault(record["role"], []).append(record)
    assert set(by_role) == {"prefill", "decode"}
    prompt_tokens = len(done.prompt_token_ids)
    prefill_hits = [h for r in by_role["prefill"] for h in r["prefix_hits"].values()]
    assert any(h["prompt_tokens"] == prompt_tokens for h in prefill_hits)
    loads = [h for r in by_role["decode"] for h in r["prefix_hits"].values() if h["async_load"]]
    assert loads and loads[0]["external"] > 0  # the KV it read over NIXL
    assert any(r["started_loading"] for r in by_role["decode"])
    for role_records in by_role.values():
        steps = [r["step"] for r in role_records]
        assert steps == sorted(steps) and len(set(steps)) == len(steps)
    chrome = _trace_steps(served, "--format", "chrome")
    events = json.loads(chrome.stdout)["traceEvents"]
    assert {e["ph"] for e in events} == {"M", "C", "i"}
    assert len([e for e in events if e["ph"] == "i"]) == len(records)
    stopped = _trace_steps(served, "--keep-steps", "-1")
    assert stopped.returncode == 0 and stopped.stdout == ""
    off = _trace_steps(served)
    assert off.stdout == "" and off.stderr.count("keeps no step trace") == 2, off.stderr
