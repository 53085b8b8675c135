"""Request migration on real local Ray Serve: decode replicas killed with SIGKILL mid-stream.
One prefill, two decode and two router replicas; the offline engine in this process is the
oracle. Also: Abort across router replicas, Health over every replica, admission bounds, and
last, `pdserve bench chaos` (short) on the same app.
(The case of a single decode replica, whose streams move to the prefill replica, is in
serve_app/test_replica_kills.py.)"""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc
import pytest

from engine.llm import LLM
from engine.request import SamplingParams
from pdserve.bench.chaos import ChaosConfig, run_on
from pdserve.client import GenerationClient, generate_request
from protos.pdserve.v1 import generate_pb2 as pb
from tests.integration.serving import (
    APP_NAME,
    AppSettings,
    ServeCluster,
    ServedApp,
    ongoing_requests,
    replica_actors,
    replica_pid,
    running_replicas,
)
from tests.waiting import wait_until

pytestmark = pytest.mark.integration

ENGINE_ARGS = {"max_model_len": 256, "kv_cache_memory_bytes": 16 << 20}
MAX_TOKENS = 180
TIGHT = "tight"
TIGHT_LIMITS = {
    "decode_replicas": 1,
    "router_replicas": 1,  # the bounds are per router replica
    "max_ongoing_requests": 1,
    "max_queued_requests": 1,
    "retry_after_s": 3.0,
}
SETTINGS = AppSettings(
    app={
        "model": "tiny",
        "engine_args": ENGINE_ARGS,
        "decode_replicas": 2,
        "router_replicas": 2,
        "num_cpus_per_engine": 0.5,
        "transport": "nixl",
        "lease_seconds": 20,
        # Half the KV reads get a fault as they complete (corrupted, delayed, lost, their
        # remote dying mid-read; connector/faults.py): every test here must still get
        # offline's tokens (each caught by its checksum or its deadline, then recomputed).
        "kv_fault_injection": {"rate": 0.5, "seed": 3},
    },
    # "tight": one colocated engine taking one request at a time, one more waiting at each
    # caller: the admission bounds are reached with a handful of requests.
    extra_apps={TIGHT: {"colocated": True, **TIGHT_LIMITS}},
)


@pytest.fixture(scope="module")
def served(serve_cluster: ServeCluster) -> Iterator[ServedApp]:
    with serve_cluster.serving(SETTINGS) as app:
        yield app


@pytest.fixture(scope="module")
def client(served: ServedApp) -> GenerationClient:
    return served.client


@pytest.fixture(scope="module")
def offline() -> Iterator[LLM]:
    llm = LLM("tiny", **ENGINE_ARGS)
    yield llm
    llm.close()


def prompts(n: int, tag: str) -> list[str]:
    return [f"Stream {tag} number {i} tells a story about" for i in range(n)]


def expected(offline: LLM, texts: list[str]) -> list[list[int]]:
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    return [list(o.outputs[0].token_ids) for o in offline.generate(texts, params)]


def start_streams(client: GenerationClient, texts: list[str]) -> list[tuple[list[Any], Any]]:
    """Each stream, with its first three chunks read (the decode leg is under way). Started
    together: one after the other, the first could finish before the last is under way (and
    a kill then finds it done, not moving)."""

    def start(text: str) -> tuple[list[Any], Any]:
        request = generate_request(text, max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
        call = client.stream(request, timeout=180)
        return [next(call) for _ in range(3)], call

    with ThreadPoolExecutor(len(texts)) as pool:
        return list(pool.map(start, texts))


def finish(streams: list[tuple[list[Any], Any]]) -> tuple[list[list[int]], list[int]]:
    """Each stream's tokens, and how many times each moved to another engine (its last
    chunk says)."""
    chunks = [head + list(call) for head, call in streams]
    return [[t for c in cs for t in c.token_ids] for cs in chunks], [
        cs[-1].migrations for cs in chunks
    ]


def decode_engines(health: pb.HealthResponse) -> list[pb.EngineStats]:
    return [e for e in health.engines if e.role == "decode"]


def actor_name(replica_id: str) -> str:
    (name,) = [n for n in replica_actors("DecodeServer") if n.endswith(f"#{replica_id}")]
    return name


def live_decode_engines(client: GenerationClient) -> list[pb.EngineStats]:
    """The decode replicas the Router reports, once each has a live actor: after an earlier
    test's kill, Serve's replacement runs before the Router's view drops the dead one."""

    def all_live() -> bool:
        live = {name.rsplit("#", 1)[-1] for name in replica_actors("DecodeServer")}
        return {e.replica_id for e in decode_engines(client.health())} <= live

    assert wait_until(all_live, 60), client.health()
    return decode_engines(client.health())


def test_health_reports_every_replica(client: GenerationClient) -> None:
    client.complete(generate_request("Hello", max_tokens=4, temperature=0.0))
    health = client.health()
    assert health.status == "SERVING"
    roles = sorted((e.role, e.state) for e in health.engines)
    assert roles == [("decode", "running"), ("decode", "running"), ("prefill", "running")]
    assert len({e.replica_id for e in health.engines}) == 3


def test_abort_finds_the_request_on_whichever_router_replica_holds_it(served, client) -> None:
    """Serve's proxy sends each call to either router replica: every Abort finds its stream
    (about half of them on the other replica), and each stream ends with "abort". Each is
    aborted once its first token is out (all six first, then the aborts, let a stream finish
    its 200 tokens first on a loaded machine: seen in CI)."""
    calls, found = [], []
    for i in range(6):
        request = generate_request(
            f"Abort me {i}", request_id=f"abort-{i}", max_tokens=200, ignore_eos=True
        )
        call = client.stream(request, timeout=120)
        next(call)
        calls.append(call)
        found.append(client.abort(f"abort-{i}"))
    assert found == [True] * 6
    for call in calls:
        rest = list(call)
        assert rest[-1].finish_reason == "abort"
    assert not client.abort("abort-0")  # ended: nobody holds it
    assert wait_until(served.engines_idle, 60), client.health()


def test_sigkill_of_a_decode_replica_loses_no_stream(served, client, offline) -> None:
    texts = prompts(6, "a")
    pids = {
        e.replica_id: replica_pid(actor_name(e.replica_id)) for e in live_decode_engines(client)
    }
    streams = start_streams(client, texts)
    busiest = max(decode_engines(client.health()), key=lambda e: e.num_running)
    assert busiest.num_running >= 1
    os.kill(pids[busiest.replica_id], signal.SIGKILL)  # looked up before: no delay now
    tokens, migrations = finish(streams)
    assert tokens == expected(offline, texts)
    assert sum(m > 0 for m in migrations) >= 1, migrations  # the killed replica's streams moved
    # Serve replaces the dead replica; then nothing is held on any engine.
    assert wait_until(served.engines_idle, 180), client.health()


def test_with_no_decode_replica_left_the_prefill_replica_takes_over(
    served, client, offline
) -> None:
    texts = prompts(4, "b")
    # The pids first: looking them up can take seconds, by which time a stream may be done.
    pids = [replica_pid(actor_name(e.replica_id)) for e in live_decode_engines(client)]
    streams = start_streams(client, texts)
    for pid in pids:  # every decode replica at once
        os.kill(pid, signal.SIGKILL)
    tokens, migrations = finish(streams)
    assert tokens == expected(offline, texts)
    assert all(m >= 1 for m in migrations), migrations  # every stream moved, to the prefill
    # A new request does not wait for Serve to bring a decode replica back.
    (late,) = expected(offline, ["A late request"])
    request = generate_request(
        "A late request", max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True
    )
    assert client.complete(request, timeout=180).token_ids == late
    assert wait_until(served.engines_idle, 180), client.health()


def test_over_the_admission_bounds_requests_are_refused_at_once(served: ServedApp) -> None:
    """Eight streams at once on the tight app: those past the bounds (the engine's queue at
    the Router, the Router's at the proxy) end at once with RESOURCE_EXHAUSTED, the Router's
    refusals with a retry-after; the rest complete. HTTP gets 429 with Retry-After in
    OpenAI's error shape. Then the app serves as before."""
    tight = GenerationClient(served.target, TIGHT)
    request = generate_request("Count", max_tokens=200, temperature=0.0, ignore_eos=True)

    def one(_: int) -> tuple[Any, float]:
        begin = time.monotonic()
        try:
            return tight.complete(request, timeout=120), time.monotonic() - begin
        except grpc.RpcError as exc:
            return exc, time.monotonic() - begin

    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(one, range(8)))
    refused = [(r, t) for r, t in results if isinstance(r, grpc.RpcError)]
    completed = [r for r, _ in results if not isinstance(r, grpc.RpcError)]
    assert refused and completed, results
    assert {r.code() for r, _ in refused} == {grpc.StatusCode.RESOURCE_EXHAUSTED}
    assert all(t < 10 for _, t in refused)  # at once, not after the running streams
    # The Router's refusals (the engine's queue full) say when to retry; the proxy's own
    # (its queue for the Router full) are Serve's.
    assert any("(retry after 3 s)" in r.details() for r, _ in refused), refused
    for r, _ in refused:
        assert "actor" not in r.details().lower() and "Traceback" not in r.details()
    assert all(len(c.token_ids) == 200 for c in completed)
    # One stream on the engine, one waiting for it at the Router: the next is refused.
    running = tight.stream(request, timeout=120)
    next(running)
    waiting = tight.stream(request, timeout=120)
    (router,) = replica_actors("Router", TIGHT)
    assert wait_until(lambda: ongoing_requests(router) == 2, 30)  # both at the Router
    body = {"model": "tiny", "prompt": "Count", "max_tokens": 100, "ignore_eos": True}
    status, headers, text = served.request(f"/{TIGHT}/v1/completions", body)
    body = json.loads(text)
    assert status == 429 and headers.get("retry-after") == "3", (status, body)
    assert body["error"]["type"] == "rate_limit_error" and "capacity" in body["error"]["message"]
    assert len([t for c in waiting for t in c.token_ids]) == 200
    running.cancel()
    after = tight.complete(generate_request("Count", max_tokens=4, temperature=0.0))
    assert len(after.token_ids) == 4
    tight.close()


SHAPE = {"PrefillServer": 1, "DecodeServer": 2, "Router": 2}


def app_shape() -> dict[str, int]:
    return {name: running_replicas(name) for name in SHAPE}


def test_a_short_chaos_run_loses_nothing_and_leaks_nothing(served: ServedApp) -> None:
    """pdserve bench chaos, short, on this module's app (the shape the bench deploys: one
    prefill, two decode, two router replicas): one replica of each role is killed while
    clients stream, cancel and send malformed requests. Nothing may be lost, no completed
    stream may differ from offline generation, no client may read Ray's internals, and
    afterwards no engine may hold a block."""
    config = ChaosConfig(
        engine_args=ENGINE_ARGS,
        duration_s=36,
        kill_every_s=10,  # kills at 10, 20 and 30 s: prefill, decode, router
        concurrency=4,
        max_tokens=32,
        seed=3,
    )
    # Every replica the earlier tests killed is back: the kills need a live one of each role.
    assert wait_until(lambda: app_shape() == SHAPE, 180), app_shape()
    assert wait_until(served.engines_idle, 60)
    report = run_on(config, served.target, APP_NAME)
    print(report)
    assert report["kills"] == {"prefill": 1, "decode": 1, "router": 1}
    # Every request sent has exactly one outcome; with a decode replica killed under load,
    # streams moved (migration switched off would fail here, not pass as clear failures).
    assert report["outcomes_add_up"] and report["outcomes_total"] == report["requests"]
    assert report["migrations"] >= report["migrated_requests"] >= 1
    # Every KV data fault injected into a live engine's reads was caught by a checksum;
    # every lost completion and remote dying mid-read failed its read (then recomputed).
    assert report["kv_faults_injected"] >= 1
    assert report["kv_checksum_failures"] == report["kv_faults_injected"]
    transport_faults = report["kv_faults_lost"] + report["kv_faults_died"]
    assert report["kv_reads_failed"] >= transport_faults >= 1
    assert report["lost"] == 0 and report["timed_out"] == 0
    assert report["completed_mismatch"] == 0
    assert report["failed_unclear"] == 0, report["unclear_examples"]
    assert report["malformed_accepted"] == 0
    assert report["completed_exact"] > 20 and report["malformed_refused"] >= 1
    assert report["idle_after_s"] is not None
    assert report["blocks_held_after"] == 0 and report["requests_held_after"] == 0
