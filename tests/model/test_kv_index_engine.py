"""A real engine's prefix-cache events, applied to the cluster KV index, say exactly what the
engine's own cache holds — through evictions, lost batches (snapshot) and a restart."""

from __future__ import annotations

import random

from deployments.cluster.prefix_index import PrefixIndex
from engine.core.kv_cache_utils import prompt_block_hashes
from engine.core.kv_events import BlockRemoved
from engine.llm import LLM
from engine.request import SamplingParams
from engine.stats import scheduler_stats

BLOCK = 4
PARAMS = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


def engine(path: str) -> LLM:
    # 40 usable blocks: later rounds evict what earlier ones cached.
    return LLM(
        path,
        max_model_len=64,
        block_size=BLOCK,
        num_gpu_blocks_override=41,
        kv_events_config={"enable_kv_cache_events": True},
    )


def cached_run(llm: LLM, token_ids: list[int]) -> int:
    """What the engine itself would reuse: the leading run of the prompt's blocks it holds."""
    pool = llm.engine.scheduler.kv_cache_manager.block_pool
    count = 0
    for block_hash in prompt_block_hashes(token_ids, BLOCK):
        if pool.get_cached_block(block_hash) is None:
            break
        count += 1
    return count


def test_the_index_follows_the_engine_through_evictions_gaps_and_restarts(hf_refs):
    path = hf_refs["llama_gqa"].path
    rng = random.Random(3)
    shared = [rng.randrange(1, 300) for _ in range(12)]
    prompts = [[*shared[: rng.randrange(0, 12)], *(rng.randrange(1, 300) for _ in range(14))]]
    index = PrefixIndex()
    llm = engine(path)
    stream = llm.engine.kv_events
    assert stream is not None
    lost = needed_snapshot = removed = matched = 0
    for round_index in range(8):
        prompts = [
            [*shared[: rng.randrange(0, 12)], *(rng.randrange(1, 300) for _ in range(14))]
            for _ in range(4)
        ] + prompts[:2]
        llm.generate(prompts, PARAMS)
        batch = stream.take_batch()
        assert batch is not None
        removed += sum(isinstance(e, BlockRemoved) for e in batch.events)
        if round_index == 3:
            lost += 1  # never delivered: the index cannot know yet, and lags
            continue
        if not index.apply("r1", batch):  # the next batch shows the gap
            needed_snapshot += 1
            index.load_snapshot("r1", stream.snapshot())
        for prompt in prompts:
            got = index.match(prompt_block_hashes(prompt, BLOCK))["r1"]
            assert got == cached_run(llm, prompt), round_index
            matched += got
    assert lost == needed_snapshot == 1 and matched > 20  # prompts sent again are cached
    assert removed > 0  # the rounds evicted each other's blocks
    # The replica restarts: a new engine under the same name, its first batch starts over.
    llm = engine(path)
    llm.generate(prompts[:1], PARAMS)
    batch = llm.engine.kv_events.take_batch()
    assert batch is not None and batch.seq == 0
    assert index.apply("r1", batch)
    for prompt in prompts:
        assert index.match(prompt_block_hashes(prompt, BLOCK))["r1"] == cached_run(llm, prompt)


def test_events_are_off_unless_asked_for(hf_refs):
    llm = LLM(hf_refs["llama_gqa"].path, max_model_len=32)
    assert llm.engine.kv_events is None


def test_the_async_engine_hands_out_batches_in_order_and_snapshots_between_steps(hf_refs):
    import asyncio

    from engine.async_engine import AsyncEngine

    engine = AsyncEngine(
        hf_refs["llama_gqa"].path,
        max_model_len=64,
        block_size=BLOCK,
        kv_events_config={"enable_kv_cache_events": True},
    )
    try:
        prompt = list(range(5, 30))

        async def run() -> None:
            async for _ in engine.generate_tokens(prompt, PARAMS):
                pass

        asyncio.run(run())
        batches = engine.take_kv_event_batches()
        assert [b.seq for b in batches] == list(range(len(batches))) and batches
        index = PrefixIndex()
        assert all(index.apply("r", b) for b in batches)
        hashes = prompt_block_hashes(prompt, BLOCK)
        assert index.match(hashes) == {"r": len(hashes)}
        snapshot = engine.kv_snapshot().result(timeout=10)
        assert snapshot.next_seq == len(batches) and len(snapshot.block_hashes) >= len(hashes)
        fresh = PrefixIndex()
        fresh.load_snapshot("r", snapshot)
        assert fresh.match(hashes) == {"r": len(hashes)}
    finally:
        engine.shutdown()


def test_an_engine_s_load_counts_its_queues_and_the_prompt_work_left(hf_refs):
    """What a KV-aware router weighs against cache hits (EngineStats.load, after each step)."""
    from engine.request import Request

    llm = LLM(
        hf_refs["llama_gqa"].path,
        max_model_len=64,
        block_size=BLOCK,
        num_gpu_blocks_override=41,
        max_num_batched_tokens=24,  # a step computes 24 prompt tokens at most: chunks
        kv_events_config={"enable_kv_cache_events": True},
    )
    core = llm.engine
    assert core.stats.load.num_running == core.stats.load.num_waiting == 0
    for i in range(3):  # distinct prompts: no prefix hits between them
        core.add_request(Request(f"r{i}", [i * 50 + t for t in range(1, 21)], PARAMS))
    before = scheduler_stats(core.scheduler).load  # what a step would find before it ran
    assert (before.num_running, before.num_waiting) == (0, 3)
    assert before.queued_prompt_tokens == 60 and before.kv_cache_usage == 0.0
    during = core.step().stats.load  # r0's 20 tokens and 4 of r1's
    assert (during.num_running, during.num_waiting) == (2, 1)
    assert during.queued_prompt_tokens == 60 - 24
    assert during.kv_cache_usage > 0.0
    while core.has_requests():
        core.step()
    after = core.stats.load
    assert (after.num_running, after.num_waiting, after.queued_prompt_tokens) == (0, 0, 0)
