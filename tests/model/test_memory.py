"""1,000 requests one after another: no growth in RSS, no leaked state, KV within budget."""

from __future__ import annotations

import gc
import os

from engine.llm import LLM
from engine.request import SamplingParams

BUDGET = 8 * 1024 * 1024


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_thousand_sequential_requests_do_not_grow_rss():
    llm = LLM("tiny", max_model_len=128, kv_cache_memory_bytes=BUDGET, max_num_seqs=4)
    params = SamplingParams(temperature=0.8, seed=1, max_tokens=2, ignore_eos=True)

    def serve(n: int, offset: int) -> None:
        for i in range(n):
            prompt = [(offset + i) % 1000 + 10, 11, 12, (i * 7) % 500 + 20]
            (out,) = llm.generate([prompt], params)
            assert len(out.outputs[0].token_ids) == 2

    serve(50, 0)  # warm-up: allocator pools, caches, lazily built tables
    gc.collect()
    before = rss_bytes()
    serve(1000, 100)
    gc.collect()
    growth = rss_bytes() - before
    assert growth < 50 * 1024 * 1024, f"RSS grew by {growth / 2**20:.1f} MiB"

    engine = llm.engine
    assert engine.runner.kv_cache is not None
    kv_bytes = engine.runner.kv_cache.numel() * engine.runner.kv_cache.element_size()
    assert kv_bytes <= BUDGET
    assert engine.scheduler.requests == {}
    assert engine.runner.requests == {}
    assert engine.runner.input_batch.num_reqs == 0
    pool = engine.scheduler.kv_cache_manager.block_pool
    assert pool.get_num_free_blocks() == engine.num_blocks - 1
