"""KVCacheManager: prefix hits, allocate_slots layout and failure, frees, stats. Exact ids."""

from __future__ import annotations

import pytest

from engine.config import CacheConfig
from engine.core.kv_cache_manager import KVCacheManager
from engine.request import Request, SamplingParams

BLOCK = 4


def make_manager(num_blocks: int = 11, caching: bool = True, **cache) -> KVCacheManager:
    config = CacheConfig(
        block_size=BLOCK, num_blocks=num_blocks, enable_prefix_caching=caching, **cache
    )
    return KVCacheManager(config, max_model_len=256)


def make_req(manager: KVCacheManager, req_id: str, tokens: list[int], salt=None) -> Request:
    request = Request(req_id, tokens, SamplingParams(), cache_salt=salt)
    request.set_block_hasher(manager.block_hasher, BLOCK)
    return request


def schedule_prefill(manager: KVCacheManager, request: Request) -> list[int]:
    """What the scheduler does for a new request: lookup, allocate, advance."""
    hits, num_hit = manager.get_computed_blocks(request)
    num_new = request.num_tokens - num_hit
    blocks = manager.allocate_slots(request, num_new, num_hit, hits)
    assert blocks is not None
    request.num_computed_tokens = num_hit + num_new
    return manager.get_block_ids(request.request_id)


def test_prefill_allocates_blocks_in_order_and_caches_full_ones():
    manager = make_manager()
    request = make_req(manager, "a", list(range(10)))  # 2 full blocks + 2 tokens
    assert schedule_prefill(manager, request) == [1, 2, 3]
    pool = manager.block_pool
    assert [pool.blocks[i].block_hash for i in (1, 2)] == request.block_hashes
    assert pool.blocks[3].block_hash is None  # partial block is never cached
    assert pool.get_num_free_blocks() == 10 - 3


def test_prefix_hit_reuses_the_same_physical_blocks():
    manager = make_manager()
    first = make_req(manager, "a", list(range(10)))
    schedule_prefill(manager, first)
    second = make_req(manager, "b", [*list(range(8)), 50, 51, 52])
    hits, num_hit = manager.get_computed_blocks(second)
    assert [b.block_id for b in hits] == [1, 2]
    assert num_hit == 8
    assert schedule_prefill(manager, second) == [1, 2, 4]
    assert [manager.block_pool.blocks[i].ref_cnt for i in (1, 2, 3, 4)] == [2, 2, 1, 1]
    manager.check_integrity()


def test_hit_is_capped_below_the_whole_prompt():
    manager = make_manager()
    first = make_req(manager, "a", list(range(8)))
    schedule_prefill(manager, first)
    same = make_req(manager, "b", list(range(8)))
    # Both blocks are cached, but the last token must be recomputed for logits.
    hits, num_hit = manager.get_computed_blocks(same)
    assert [b.block_id for b in hits] == [1]
    assert num_hit == 4


def test_cache_salt_separates_namespaces():
    manager = make_manager()
    schedule_prefill(manager, make_req(manager, "a", list(range(9)), salt="tenant-1"))
    assert manager.get_computed_blocks(make_req(manager, "b", list(range(9))))[1] == 0
    other = make_req(manager, "c", list(range(9)), salt="tenant-2")
    assert manager.get_computed_blocks(other)[1] == 0
    same = make_req(manager, "d", list(range(9)), salt="tenant-1")
    assert manager.get_computed_blocks(same)[1] == 8


def test_free_releases_tail_first_so_tails_are_evicted_first():
    manager = make_manager(num_blocks=5)  # 4 usable blocks
    request = make_req(manager, "a", list(range(12)))
    assert schedule_prefill(manager, request) == [1, 2, 3]
    manager.free(request)
    queue = manager.block_pool.free_block_queue.get_all_free_blocks()
    assert [b.block_id for b in queue] == [4, 3, 2, 1]
    # A new 8-token request takes the LRU blocks: 4 (never used) then 3 (the old tail),
    # so the old prefix blocks 1 and 2 survive in the cache.
    other = make_req(manager, "b", [90 + i for i in range(8)])
    assert schedule_prefill(manager, other) == [4, 3]
    again = make_req(manager, "c", list(range(12)))
    assert [b.block_id for b in manager.get_computed_blocks(again)[0]] == [1, 2]


def test_evicted_block_is_no_longer_a_hit():
    manager = make_manager(num_blocks=3)  # 2 usable blocks
    first = make_req(manager, "a", list(range(8)))
    schedule_prefill(manager, first)
    manager.free(first)
    second = make_req(manager, "b", [70 + i for i in range(8)])
    assert schedule_prefill(manager, second) == [2, 1]
    third = make_req(manager, "c", list(range(8)))
    assert manager.get_computed_blocks(third)[1] == 0


def test_allocate_slots_returns_none_and_changes_nothing_when_full():
    manager = make_manager(num_blocks=4)  # 3 usable
    first = make_req(manager, "a", list(range(8)))
    schedule_prefill(manager, first)
    manager.free(first)  # blocks 1, 2 cached and free
    big = make_req(manager, "b", list(range(4)) + [60 + i for i in range(12)])
    hits, num_hit = manager.get_computed_blocks(big)
    assert num_hit == 4
    # 16 tokens = 4 blocks: 1 hit + 3 new, but only 2 remain after touching the hit.
    assert manager.allocate_slots(big, 12, num_hit, hits) is None
    assert manager.get_block_ids("b") == []
    assert manager.block_pool.get_num_free_blocks() == 3
    assert manager.block_pool.blocks[1].ref_cnt == 0
    manager.check_integrity()


def test_decode_allocates_a_block_only_at_a_block_boundary():
    manager = make_manager()
    request = make_req(manager, "a", list(range(7)))
    schedule_prefill(manager, request)
    assert manager.get_block_ids("a") == [1, 2]
    for token, expect_new in [(7, False), (8, True)]:
        request.append_output_token_ids(token)
        new = manager.allocate_slots(request, 1)
        assert new is not None and bool(new) == expect_new
        request.num_computed_tokens += 1
    assert manager.get_block_ids("a") == [1, 2, 3]
    # block 2 became full when token 7 was computed: now cached under its hash
    assert manager.block_pool.blocks[2].block_hash == request.block_hashes[1]


def test_lookahead_slots_are_allocated_but_not_cached():
    manager = make_manager()
    request = make_req(manager, "a", list(range(4)))
    blocks = manager.allocate_slots(request, 4, num_lookahead_tokens=5)
    assert [b.block_id for b in blocks] == [1, 2, 3]
    assert manager.block_pool.blocks[1].block_hash == request.block_hashes[0]
    assert manager.block_pool.blocks[2].block_hash is None


def test_external_tokens_get_slots_and_delay_caching():
    manager = make_manager()
    request = make_req(manager, "a", list(range(13)))
    blocks = manager.allocate_slots(
        request, 0, num_external_computed_tokens=12, delay_cache_blocks=True
    )
    assert [b.block_id for b in blocks] == [1, 2, 3]
    assert all(manager.block_pool.blocks[i].block_hash is None for i in (1, 2, 3))
    manager.cache_blocks(request, 12)
    assert [manager.block_pool.blocks[i].block_hash for i in (1, 2, 3)] == request.block_hashes


def test_caching_disabled_never_hits():
    manager = make_manager(caching=False)
    schedule_prefill(manager, make_req(manager, "a", list(range(9))))
    assert manager.get_computed_blocks(make_req(manager, "b", list(range(9)))) == ([], 0)
    assert all(b.block_hash is None for b in manager.block_pool.blocks)


def test_prefix_cache_stats_count_tokens():
    manager = make_manager()
    schedule_prefill(manager, make_req(manager, "a", list(range(9))))
    schedule_prefill(manager, make_req(manager, "b", list(range(9))))
    stats = manager.prefix_cache_stats
    assert (stats.requests, stats.queries, stats.hits) == (2, 18, 8)
    assert stats.hit_rate == pytest.approx(8 / 18)
    schedule_prefill(manager, make_req(manager, "c", list(range(9))))  # counters run on
    assert (stats.requests, stats.queries, stats.hits) == (3, 27, 16)


def test_usage_counts_held_blocks():
    manager = make_manager(num_blocks=11)
    request = make_req(manager, "a", list(range(20)))
    schedule_prefill(manager, request)
    assert manager.usage == pytest.approx(5 / 10)
    manager.free(request)
    assert manager.usage == 0.0


def test_missing_num_blocks_is_a_clear_error():
    with pytest.raises(ValueError, match="num_blocks"):
        KVCacheManager(CacheConfig(block_size=4), max_model_len=16)


def test_sliding_window_frees_blocks_outside_the_window():
    manager = make_manager(num_blocks=20, sliding_window=8)
    request = make_req(manager, "a", list(range(16)))
    schedule_prefill(manager, request)
    assert manager.get_block_ids("a") == [1, 2, 3, 4]
    request.append_output_token_ids(16)
    manager.allocate_slots(request, 1)
    # The next token (position 16) reads positions 9..16: blocks 0 and 1 are never read again.
    assert manager.get_block_ids("a") == [0, 0, 3, 4, 5]
    assert manager.block_pool.blocks[1].ref_cnt == 0
    manager.check_integrity()


def test_sliding_window_hit_needs_only_the_window():
    manager = make_manager(num_blocks=20, sliding_window=8)
    first = make_req(manager, "a", list(range(20)))
    schedule_prefill(manager, first)
    assert manager.get_block_ids("a") == [1, 2, 3, 4, 5]
    manager.free(first)
    manager.evict_blocks([1])  # a hole at the start of the cached prefix
    again = make_req(manager, "b", [*list(range(20)), 99])
    hits, num_hit = manager.get_computed_blocks(again)
    # Position 20 reads positions 13..20, so cached blocks 4 and 5 (tokens 12..19) suffice;
    # the positions before them are never read and map to the null block.
    assert num_hit == 20
    assert [b.block_id for b in hits] == [0, 0, 0, 4, 5]


def test_full_attention_hit_stops_at_the_first_hole():
    manager = make_manager(num_blocks=20)
    first = make_req(manager, "a", list(range(20)))
    schedule_prefill(manager, first)
    manager.free(first)
    manager.evict_blocks([2])
    again = make_req(manager, "b", [*list(range(20)), 99])
    hits, num_hit = manager.get_computed_blocks(again)
    assert [b.block_id for b in hits] == [1]
    assert num_hit == 4
