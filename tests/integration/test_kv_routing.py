"""KV-aware routing on real local Ray Serve: 2 prefill + 2 decode replicas of the tiny model.

The engines publish their prefix caches' events to the app's KV index actor; both legs' Serve
request routers send a request to the replicas holding most of its prompt. A conversation's
follow-up turn extends the earlier turn's prompt, so its prefill leg finds that prompt in the
cache of the prefill replica that ran it — which only cache-aware routing guarantees (power of
two choices over two replicas would send each follow-up to the other replica half the time).
"""

from __future__ import annotations

import random
from collections.abc import Iterator

import pytest
import ray

from deployments.app import AppConfig
from deployments.client import GenerationClient, generate_request
from deployments.kv_index import index_actor_name
from deployments.launch import APP_NAME, ServeOptions, start, stop
from engine.llm import LLM
from engine.request import SamplingParams
from tests.integration.serve_utils import free_port, wait_until

pytestmark = pytest.mark.integration

BLOCK = 16
ENGINE_ARGS = {"max_model_len": 512, "kv_cache_memory_bytes": 16 << 20, "block_size": BLOCK}
ANSWER_TOKENS = 12


@pytest.fixture(scope="module")
def client() -> Iterator[GenerationClient]:
    config = AppConfig.from_args(
        {
            "model": "tiny",
            "engine_args": ENGINE_ARGS,
            "prefill_replicas": 2,
            "decode_replicas": 2,
            "num_cpus_per_engine": 0.5,
            "transport": "nixl",
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


def index_knows_all_engines() -> bool:
    index = ray.get_actor(index_actor_name(APP_NAME), namespace="pdserve")
    current = ray.get(index.current.remote())
    return len(current) == 4 and all(current.values())


def test_follow_up_turns_find_their_earlier_prompt_on_the_prefill_replica(client):
    assert wait_until(index_knows_all_engines, timeout_s=60)
    rng = random.Random(5)
    offline = LLM("tiny", **ENGINE_ARGS)
    params = {"max_tokens": ANSWER_TOKENS, "temperature": 0.0, "ignore_eos": True}
    conversations = [[rng.randrange(10, 400) for _ in range(70)] for _ in range(6)]
    cached = []
    for turn in range(3):
        for i, prompt in enumerate(conversations):
            done = client.complete(generate_request(prompt, **params))
            expected = offline.generate(
                [{"prompt_token_ids": prompt}],
                SamplingParams(max_tokens=ANSWER_TOKENS, temperature=0.0, ignore_eos=True),
            )[0]
            assert done.token_ids == expected.outputs[0].token_ids  # the oracle
            assert done.route == "disaggregated"
            if turn:
                # The earlier turn's whole prompt, in whole blocks, was already on the prefill
                # replica this turn went to (cached_tokens: the prefill leg's prefix hits).
                earlier = len(prompt) - ANSWER_TOKENS - 8
                cached.append(done.usage.cached_tokens / (earlier // BLOCK * BLOCK))
            follow_up = [rng.randrange(10, 400) for _ in range(8)]
            conversations[i] = [*prompt, *done.token_ids, *follow_up]
        # Let the engines' events reach the index before the next turn.
        assert wait_until(index_knows_all_engines, timeout_s=10)
    assert len(cached) == 12 and min(cached) >= 1.0, cached
