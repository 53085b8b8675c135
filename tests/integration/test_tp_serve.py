"""Tensor-parallel engine replicas on real local Ray Serve: a colocated replica of two ranks
(a placement-group bundle each) answers as the offline single-rank engine does, greedy and
seeded; a rank killed mid-stream ends every stream with its output or a clear error, and
Serve replaces the replica, ranks and all. Prefill and decode replicas of different sizes,
both ways (prefill 2 + decode 1, prefill 1 + decode 2), each over NIXL and over gRPC, answer
the same, disaggregated, and hold no block afterwards; a decode rank killed mid-stream moves
each stream to the prefill replica (migration), which finishes it token for token."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator

import grpc
import pytest

from engine.llm import LLM
from engine.request import SamplingParams
from pdserve.client import GenerationClient, generate_request
from tests.integration.serving import (
    APP_NAME,
    AppSettings,
    ServeCluster,
    ServedApp,
    running_replicas,
)
from tests.waiting import wait_until

pytestmark = pytest.mark.integration

ENGINE_ARGS = {"max_model_len": 256, "kv_cache_memory_bytes": 16 << 20}
PREFILL_2_DECODE_1 = "p2d1"  # over NIXL
PREFILL_1_DECODE_2 = "p1d2"  # over gRPC
# The same two directions over the other transport, each rank keeping its own heads' KV
# cache (as ranks on GPUs do; host memory stands in for their devices' here): rank 0 maps the
# other's, and reads map heads between the engines (connector/kv_shards.py).
PREFILL_2_DECODE_1_GRPC = "p2d1g"
PREFILL_1_DECODE_2_NIXL = "p1d2n"
PER_RANK = {
    "engine_args": {
        **ENGINE_ARGS,
        "tensor_parallel_size": 2,
        "tensor_parallel_kv_cache": "per_rank",
    }
}
SETTINGS = AppSettings(
    app={
        "model": "tiny",
        "colocated": True,
        "engine_args": {**ENGINE_ARGS, "tensor_parallel_size": 2},
        "num_cpus_per_engine": 0.5,
        "max_migrations": 0,  # one replica: a stream whose engine dies fails, clearly
    },
    extra_apps={
        PREFILL_2_DECODE_1: {"colocated": False, "decode_tensor_parallel_size": 1},
        PREFILL_1_DECODE_2: {
            "colocated": False,
            "prefill_tensor_parallel_size": 1,
            "transport": "grpc",
            "max_migrations": 2,
        },
        PREFILL_2_DECODE_1_GRPC: {
            "colocated": False,
            "decode_tensor_parallel_size": 1,
            "transport": "grpc",
            **PER_RANK,
        },
        PREFILL_1_DECODE_2_NIXL: {
            "colocated": False,
            "prefill_tensor_parallel_size": 1,
            **PER_RANK,
        },
    },
)
DEPLOYMENT = "EngineServer"  # the colocated deployment
MAX_TOKENS = 200


@pytest.fixture(scope="module")
def served(serve_cluster: ServeCluster) -> Iterator[ServedApp]:
    with serve_cluster.serving(SETTINGS) as app:
        yield app


@pytest.fixture(scope="module")
def offline() -> Iterator[LLM]:
    llm = LLM("tiny", **ENGINE_ARGS)  # one rank: the oracle
    yield llm
    llm.close()


def _rank_pids(deployment: str = DEPLOYMENT, app: str = APP_NAME) -> list[int]:
    from ray import serve

    handle = serve.get_deployment_handle(deployment, app_name=app)
    return handle.rank_pids.remote().result()


def test_two_rank_replica_answers_as_one_rank(served: ServedApp, offline: LLM) -> None:
    client: GenerationClient = served.client
    assert len(_rank_pids()) == 1  # the replica did start a second rank
    texts = [f"Tensor parallel story {i} begins with" for i in range(3)]
    for params in (
        SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True),
        SamplingParams(max_tokens=24, temperature=0.9, seed=11, ignore_eos=True),
    ):
        expected = [list(o.outputs[0].token_ids) for o in offline.generate(texts, params)]
        for text, tokens in zip(texts, expected, strict=True):
            request = generate_request(
                text,
                max_tokens=params.max_tokens,
                temperature=params.temperature,
                seed=params.seed,
                ignore_eos=True,
            )
            assert list(client.complete(request).token_ids) == tokens, text


def test_a_rank_killed_mid_stream_ends_each_stream_clearly(served: ServedApp) -> None:
    client = served.client
    (follower,) = _rank_pids()
    calls = []
    for i in range(4):
        request = generate_request(
            f"Long story {i}", max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True
        )
        call = client.stream(request, timeout=120)
        calls.append((list(next(call).token_ids), call))  # under way
    os.kill(follower, signal.SIGKILL)
    outcomes = []
    for first, call in calls:
        try:
            tokens = first + [t for chunk in call for t in chunk.token_ids]
            assert len(tokens) == MAX_TOKENS  # finished before the kill: every token
            outcomes.append("completed")
        except grpc.RpcError as err:
            # "the colocated engine failed mid-request: its engine loop stopped"
            assert err.code() == grpc.StatusCode.UNAVAILABLE, err
            message = err.details() or ""
            assert "engine" in message and "Traceback" not in message, message
            assert "rank" not in message and "pid" not in message, message  # no internals
            outcomes.append("failed")
    # The streams run batched and end together, well after the kill: it reached them.
    assert "failed" in outcomes, outcomes
    # Serve restarts the replica (its health check fails): a new pair of ranks answers.
    assert wait_until(lambda: _rank_pids() and _rank_pids()[0] != follower, 120)
    assert wait_until(lambda: running_replicas(DEPLOYMENT) == 1, 120)
    reply = client.complete(generate_request("After the restart", max_tokens=4))
    assert len(reply.token_ids) == 4


def _request(text: str, params: SamplingParams) -> object:
    return generate_request(
        text,
        max_tokens=params.max_tokens,
        temperature=params.temperature,
        seed=params.seed,
        ignore_eos=True,
    )


@pytest.mark.parametrize(
    ("app", "sizes"),
    [
        (PREFILL_2_DECODE_1, (2, 1)),
        (PREFILL_1_DECODE_2, (1, 2)),
        (PREFILL_2_DECODE_1_GRPC, (2, 1)),
        (PREFILL_1_DECODE_2_NIXL, (1, 2)),
    ],
)
def test_prefill_and_decode_of_other_sizes_answer_as_one_rank(served, offline, app, sizes) -> None:
    client = served.clients[app]
    prefill_ranks = 1 + len(_rank_pids("PrefillServer", app))
    decode_ranks = 1 + len(_rank_pids("DecodeServer", app))
    assert (prefill_ranks, decode_ranks) == sizes
    for round_, params in enumerate(
        (
            SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True),
            SamplingParams(max_tokens=16, temperature=0.9, seed=3, ignore_eos=True),
        )
    ):
        # Prompts no engine has seen: a cached one would skip the prefill replica.
        # (Unique from the first token: a shared first block would be a cache hit too.)
        texts = [f"{round_}.{i} {app}: a disaggregated story starts when" for i in range(3)]
        expected = [list(o.outputs[0].token_ids) for o in offline.generate(texts, params)]
        for text, tokens in zip(texts, expected, strict=True):
            reply = client.complete(_request(text, params))
            assert reply.route == "disaggregated"  # the KV came from the prefill replica
            assert list(reply.token_ids) == tokens, text
    assert wait_until(lambda: served.engines_idle(app), 30), "blocks held after the requests"
    # How the decode engine read: whole blocks of every head where both keep one cache of
    # every head; per rank, through staging (prefill and decode ranks hold other heads).
    [decode] = [e for e in client.health().engines if e.role == "decode"]
    assert decode.kv_pieces_direct + decode.kv_pieces_staged >= 6
    per_rank = app in (PREFILL_2_DECODE_1_GRPC, PREFILL_1_DECODE_2_NIXL)
    assert (decode.kv_pieces_staged > 0) == per_rank


def test_bench_serve_reports_the_split_roles_time_in_collectives(served) -> None:
    from pdserve.bench.serve import ServeBenchConfig, run

    report = run(
        ServeBenchConfig(
            target=served.target,
            apps=[PREFILL_2_DECODE_1],
            num_prompts=4,
            input_len=24,
            output_len=8,
            warmup=1,
            progress=False,
            concurrency=2,
        )
    )
    result = report["results"][PREFILL_2_DECODE_1]
    assert result["completed"] == 4 and result["failed"] == 0
    split = result["tensor_parallel"]
    assert set(split) == {"prefill"}  # the decode replica has one rank
    assert split["prefill"]["tensor_parallel_size"] == 2
    assert 0 < split["prefill"]["collective_share"] < 1


def test_a_decode_rank_killed_mid_stream_migrates_its_streams(served, offline) -> None:
    client = served.clients[PREFILL_1_DECODE_2]
    (follower,) = _rank_pids("DecodeServer", PREFILL_1_DECODE_2)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    texts = [f"Migrating story {i}" for i in range(3)]
    expected = [list(o.outputs[0].token_ids) for o in offline.generate(texts, params)]
    calls = []
    for text in texts:
        call = client.stream(_request(text, params), timeout=120)
        calls.append(([next(call)], call))  # the decode leg is under way
    os.kill(follower, signal.SIGKILL)
    migrations = []
    for (head, call), tokens in zip(calls, expected, strict=True):
        chunks = head + list(call)  # a stream that fails would raise: none may
        assert [t for c in chunks for t in c.token_ids] == tokens
        migrations.append(chunks[-1].migrations)
    assert sum(migrations) >= 1, migrations  # the kill reached a stream, which moved
