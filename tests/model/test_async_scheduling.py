"""Async scheduling through the whole engine: the outputs of synchronous scheduling, token for
token, for every kind of request the sampler serves, through chunked prefill and preemption."""

from __future__ import annotations

import random

import pytest

from engine.core.scheduler import Scheduler
from engine.llm import LLM
from engine.request import SamplingParams
from engine.stats import scheduler_stats
from tests.model.conftest import HFReference


def mixed_batch(seed: int) -> tuple[list[list[int]], list[SamplingParams]]:
    """Greedy, seeded (top-p, top-k, min-p), penalties, logprobs, min_tokens, stop tokens and
    short max_tokens, each on prompts of different lengths."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(1, 300) for _ in range(rng.randrange(3, 30))] for _ in range(10)]
    params = [
        SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True),
        SamplingParams(temperature=0.9, top_p=0.9, seed=1, max_tokens=20, ignore_eos=True),
        SamplingParams(temperature=1.2, top_k=5, seed=2, max_tokens=15, ignore_eos=True),
        SamplingParams(temperature=0.7, min_p=0.1, seed=3, max_tokens=18, ignore_eos=True),
        SamplingParams(
            temperature=1.0, seed=4, presence_penalty=0.5, repetition_penalty=1.3, max_tokens=16
        ),
        SamplingParams(temperature=0.0, max_tokens=12, logprobs=3, ignore_eos=True),
        SamplingParams(temperature=1.0, seed=5, min_tokens=6, max_tokens=14),
        SamplingParams(temperature=0.0, max_tokens=1),
        SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True),
        SamplingParams(temperature=1.0, seed=6, max_tokens=20, stop_token_ids=[7, 8, 9, 10, 11]),
    ]
    return prompts, params


def engine(ref: HFReference, async_scheduling: bool, **overrides) -> LLM:
    args = dict(max_model_len=64, block_size=4, num_gpu_blocks_override=400)
    return LLM(
        ref.path, async_scheduling=async_scheduling, **{**args, **ref.engine_args, **overrides}
    )


def outputs_of(llm: LLM, prompts, params) -> list[tuple]:
    """Tokens, finish reasons, and the logprobs' token ids and ranks (their values follow the
    batch's shape in the last bits, as any batching does)."""
    results = llm.generate(prompts, params)
    return [
        (
            o.outputs[0].token_ids,
            o.outputs[0].finish_reason,
            [(ids, rank) for ids, _, rank in o.outputs[0].logprobs or []],
        )
        for o in results
    ]


def test_async_scheduling_is_an_engine_argument_off_by_default(hf_refs):
    ref = hf_refs["llama_gqa"]
    args = dict(max_model_len=32, num_gpu_blocks_override=16, **ref.engine_args)
    assert not LLM(ref.path, **args).engine.async_scheduling
    assert LLM(ref.path, **args, async_scheduling=True).engine.async_scheduling
    with pytest.raises(ValueError, match="async_scheduling must be a bool"):
        LLM(ref.path, **args, async_scheduling="yes")


def test_async_equals_sync_for_every_kind_of_request(hf_refs, monkeypatch):
    """A pool of 20 blocks for ten requests: preemption happens, in flight too (a request
    preempted while its step runs keeps that step's sample)."""
    preempted_in_flight = []
    keep = Scheduler._append_to_preempted

    def spy(self, request, token_ids):
        preempted_in_flight.append(request.request_id)
        return keep(self, request, token_ids)

    monkeypatch.setattr(Scheduler, "_append_to_preempted", spy)
    ref = hf_refs["llama_gqa"]
    prompts, params = mixed_batch(0)
    tight = dict(num_gpu_blocks_override=21, max_num_batched_tokens=24)
    sync = engine(ref, False, **tight)
    expected = outputs_of(sync, prompts, params)
    assert not preempted_in_flight and scheduler_stats(sync.engine.scheduler).num_preemptions > 0
    fast = engine(ref, True, **tight)
    assert outputs_of(fast, prompts, params) == expected
    assert scheduler_stats(fast.engine.scheduler).num_preemptions > 0 and preempted_in_flight
    # An unconstrained pool, a second round over cached prefixes: the same again.
    roomy = engine(ref, True)
    assert outputs_of(roomy, prompts, params) == expected
    assert outputs_of(roomy, prompts, params) == expected
    for llm in (fast, roomy):
        pool = llm.engine.scheduler.kv_cache_manager.block_pool
        assert pool.get_num_free_blocks() == pool.num_blocks - 1  # nothing held
        assert not llm.engine.step_in_flight and not llm.engine.has_requests()


def test_async_with_ngram_speculation_equals_plain_sync(hf_refs):
    """Speculating requests and ones that cannot speculate side by side, async on: steps whose
    requests speculate run synchronously, the others ahead; outputs are plain decoding's."""
    ref = hf_refs["llama_gqa"]
    prompts, params = mixed_batch(1)
    prompts = [p * 2 for p in prompts]  # repeats for the n-gram drafts to find
    expected = outputs_of(engine(ref, False), prompts, params)
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}
    llm = engine(ref, True, speculative_config=spec)
    assert outputs_of(llm, prompts, params) == expected
    assert llm.engine.scheduler.speculator.stats.num_accepted_tokens > 0
