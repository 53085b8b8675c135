"""Pins through the whole engine: a pinned turn's prefix survives eviction pressure until its
session's next turn (token-exact with transformers) or its TTL, and is freed after; a pin over
the budget is refused and the request served; under pressure a pin moves down to the tier."""

from __future__ import annotations

import random

from engine.llm import LLM
from engine.pin_request import PinRequest
from engine.request import SamplingParams
from tests.model.conftest import HFReference

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


def engine(ref: HFReference, **args) -> LLM:
    base = dict(max_model_len=112, block_size=4, num_gpu_blocks_override=31, kv_pin_budget=0.5)
    return LLM(ref.path, **{**base, **ref.engine_args, **args})


def tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, 300) for _ in range(n)]


def evict_pool(llm: LLM) -> None:
    """Two unrelated prompts one after the other: every unpinned block is reused."""
    for seed in (50, 51):
        llm.generate([{"prompt_token_ids": tokens(seed, 80)}], GREEDY)


def two_turns(llm: LLM, pin: PinRequest | None) -> tuple[list, int]:
    """A session's turn, pressure, and its next turn: (the next turn's tokens, its hits)."""
    first = tokens(1, 24)
    [out] = llm.generate([{"prompt_token_ids": first}], GREEDY, pins=[pin])
    evict_pool(llm)
    context = first + list(out.outputs[0].token_ids) + tokens(2, 8)
    [out] = llm.generate([{"prompt_token_ids": context}], GREEDY, pins=[pin])
    return [context, list(out.outputs[0].token_ids)], out.num_cached_tokens


def assert_nothing_held(llm: LLM) -> None:
    assert llm.drain()
    manager = llm.engine.scheduler.kv_cache_manager
    manager.check_integrity()
    assert manager.block_pool.get_num_free_blocks() == manager.block_pool.num_blocks - 1


def test_a_pinned_prefix_survives_eviction_until_its_next_turn_and_expires_after(hf_refs):
    ref = hf_refs["llama_gqa"]
    unpinned = engine(ref)
    (_, _), misses = two_turns(unpinned, None)
    assert misses == 0  # the pressure took the whole prefix
    llm = engine(ref)
    (context, answer), hits = two_turns(llm, PinRequest("agent-1", ttl_s=30.0))
    assert hits == 28  # the first turn's 30 tokens, in whole blocks of 4
    assert answer == ref.greedy(context, GREEDY.max_tokens)
    pins = llm.engine.scheduler.pins
    assert pins.stats.pinned == 2 and pins.stats.reused == 1  # the second turn pinned too
    assert pins.holds("agent-1")
    now = pins.clock()
    pins.clock = lambda: now + 31.0  # past the TTL
    llm.engine.step()
    assert not pins.holds("agent-1") and llm.engine.stats.kv_pins["expired"] == 1
    assert_nothing_held(llm)
    for other in (llm, unpinned):
        other.close()


def test_a_pin_over_the_budget_is_refused_and_the_request_served(hf_refs):
    ref = hf_refs["llama_gqa"]
    llm = engine(ref, kv_pin_budget=0.1)  # 3 blocks; the turn caches 7
    prompt = tokens(3, 24)
    [out] = llm.generate([{"prompt_token_ids": prompt}], GREEDY, pins=[PinRequest("s", 30.0)])
    assert list(out.outputs[0].token_ids) == ref.greedy(prompt, GREEDY.max_tokens)
    assert out.timing is not None and out.timing.pin_refused and out.timing.pin_ttl_s is None
    assert llm.engine.stats.kv_pins["refused"] == 1 and llm.engine.stats.kv_pins["held"] == 0
    assert_nothing_held(llm)
    llm.close()


def test_under_pressure_a_pin_moves_down_to_the_tier_and_its_turn_loads_it_back(hf_refs):
    ref = hf_refs["llama_gqa"]
    llm = engine(ref, kv_offloading_size=0.002)
    first = tokens(4, 24)
    pin = PinRequest("s", ttl_s=30.0)
    [out] = llm.generate([{"prompt_token_ids": first}], GREEDY, pins=[pin])
    # A long decode needs every block the pin holds: the pin goes down, nothing is preempted.
    llm.generate(
        [{"prompt_token_ids": tokens(5, 60)}], SamplingParams(max_tokens=40, ignore_eos=True)
    )
    stats = llm.engine.stats
    assert stats.kv_pins["moved_down"] == 1 and stats.num_preemptions == 0
    context = first + list(out.outputs[0].token_ids) + tokens(6, 8)
    [out] = llm.generate([{"prompt_token_ids": context}], GREEDY)
    assert list(out.outputs[0].token_ids) == ref.greedy(context, GREEDY.max_tokens)
    assert llm.engine.stats.kv_tier["hit_tokens"] > 0  # the pinned turn, from the tier
    assert_nothing_held(llm)
    llm.close()


def test_with_nothing_running_pins_give_way_to_a_prompt_that_needs_their_blocks(hf_refs):
    ref = hf_refs["llama_gqa"]
    llm = engine(ref)  # no tier: pins hold until their TTL, unless nothing else could run
    first = tokens(7, 24)
    llm.generate([{"prompt_token_ids": first}], GREEDY, pins=[PinRequest("s", ttl_s=3000.0)])
    long_prompt = tokens(8, 100)  # 27 blocks of 30; the pin holds 7
    [out] = llm.generate([{"prompt_token_ids": long_prompt}], GREEDY)
    assert list(out.outputs[0].token_ids) == ref.greedy(long_prompt, GREEDY.max_tokens)
    pins = llm.engine.stats.kv_pins
    assert pins["gave_way"] == 1 and pins["held"] == 0
    assert_nothing_held(llm)
    llm.close()
