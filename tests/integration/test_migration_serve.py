"""Request migration on real local Ray Serve: decode replicas killed with SIGKILL mid-stream.
One prefill and two decode replicas; the offline engine in this process is the oracle.
(The case of a single decode replica, whose streams move to the prefill replica, is the last
test of test_serve_app.py.)"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from deployments.app import AppConfig
from deployments.client import GenerationClient, generate_request
from deployments.launch import APP_NAME, ServeOptions, start, stop
from engine.llm import LLM
from engine.request import SamplingParams
from protos.pdserve.v1 import generate_pb2 as pb
from tests.integration.serve_utils import free_port, replica_actors, sigkill_replica, wait_until

pytestmark = pytest.mark.integration

ENGINE_ARGS = {"max_model_len": 256, "kv_cache_memory_bytes": 16 << 20}
MAX_TOKENS = 180


@pytest.fixture(scope="module")
def client() -> Iterator[GenerationClient]:
    config = AppConfig.from_args(
        {
            "model": "tiny",
            "engine_args": ENGINE_ARGS,
            "decode_replicas": 2,
            "num_cpus_per_engine": 0.5,
            "transport": "nixl",
            "lease_seconds": 20,
        }
    )
    grpc_port = free_port()
    start(config, ServeOptions(grpc_port=grpc_port, http_port=free_port(), num_cpus=8))
    served = GenerationClient(f"127.0.0.1:{grpc_port}", APP_NAME)
    try:
        yield served
    finally:
        served.close()
        stop()


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
    """Each stream, with its first three chunks read (the decode leg is under way)."""
    streams = []
    for text in texts:
        request = generate_request(text, max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
        call = client.stream(request, timeout=180)
        streams.append(([next(call) for _ in range(3)], call))
    return streams


def finish(streams: list[tuple[list[Any], Any]]) -> list[list[int]]:
    return [[t for c in head + list(call) for t in c.token_ids] for head, call in streams]


def decode_engines(health: pb.HealthResponse) -> list[pb.EngineStats]:
    return [e for e in health.engines if e.role == "decode"]


def idle(client: GenerationClient) -> bool:
    health = client.health()
    return health.status == "SERVING" and all(
        e.state == "running"
        and e.num_free_blocks == e.num_blocks
        and e.num_running + e.num_waiting + e.num_held_requests == 0
        for e in health.engines
    )


def actor_name(replica_id: str) -> str:
    (name,) = [n for n in replica_actors("DecodeServer") if n.endswith(f"#{replica_id}")]
    return name


def test_health_reports_every_replica(client: GenerationClient) -> None:
    client.complete(generate_request("Hello", max_tokens=4, temperature=0.0))
    health = client.health()
    assert health.status == "SERVING"
    roles = sorted((e.role, e.state) for e in health.engines)
    assert roles == [("decode", "running"), ("decode", "running"), ("prefill", "running")]
    assert len({e.replica_id for e in health.engines}) == 3


def test_sigkill_of_a_decode_replica_loses_no_stream(client, offline) -> None:
    texts = prompts(6, "a")
    streams = start_streams(client, texts)
    busiest = max(decode_engines(client.health()), key=lambda e: e.num_running)
    assert busiest.num_running >= 1
    sigkill_replica(actor_name(busiest.replica_id))
    assert finish(streams) == expected(offline, texts)
    # Serve replaces the dead replica; then nothing is held on any engine.
    assert wait_until(lambda: idle(client), 180), client.health()


def test_with_no_decode_replica_left_the_prefill_replica_takes_over(client, offline) -> None:
    texts = prompts(4, "b")
    streams = start_streams(client, texts)
    for engine in decode_engines(client.health()):
        sigkill_replica(actor_name(engine.replica_id))
    assert finish(streams) == expected(offline, texts)
    # A new request does not wait for Serve to bring a decode replica back.
    (late,) = expected(offline, ["A late request"])
    request = generate_request(
        "A late request", max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True
    )
    assert client.complete(request, timeout=180).token_ids == late
    assert wait_until(lambda: idle(client), 180), client.health()
