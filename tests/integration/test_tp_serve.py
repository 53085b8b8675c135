"""Tensor-parallel engine replicas on real local Ray Serve: a colocated replica of two ranks
(a placement-group bundle each) answers as the offline single-rank engine does, greedy and
seeded; a rank killed mid-stream ends every stream with its output or a clear error, and
Serve replaces the replica, ranks and all."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator

import grpc
import pytest

from engine.llm import LLM
from engine.request import SamplingParams
from pdserve.client import GenerationClient, generate_request
from tests.integration.serving import AppSettings, ServeCluster, ServedApp, running_replicas
from tests.waiting import wait_until

pytestmark = pytest.mark.integration

ENGINE_ARGS = {"max_model_len": 256, "kv_cache_memory_bytes": 16 << 20}
SETTINGS = AppSettings(
    app={
        "model": "tiny",
        "colocated": True,
        "engine_args": {**ENGINE_ARGS, "tensor_parallel_size": 2},
        "num_cpus_per_engine": 0.5,
        "max_migrations": 0,  # one replica: a stream whose engine dies fails, clearly
    }
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


def _rank_pids() -> list[int]:
    from ray import serve

    from tests.integration.serving import APP_NAME

    handle = serve.get_deployment_handle(DEPLOYMENT, app_name=APP_NAME)
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
