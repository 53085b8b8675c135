"""BlockPool and BlockHashToBlockMap: exact block ids, eviction order, events, integrity."""

from __future__ import annotations

import pytest

from engine.core.block_pool import BlockHashToBlockMap, BlockPool
from engine.core.kv_cache_utils import KVCacheBlock, make_block_hasher, sha256_digest
from engine.core.kv_events import AllBlocksCleared, BlockRemoved, BlockStored
from engine.request import Request, SamplingParams

BLOCK_SIZE = 4


def hashed_request(tokens: list[int], request_id: str = "r") -> Request:
    req = Request(request_id, tokens, SamplingParams())
    req.set_block_hasher(make_block_hasher(BLOCK_SIZE, sha256_digest), BLOCK_SIZE)
    return req


def ids(blocks: list[KVCacheBlock]) -> list[int]:
    return [b.block_id for b in blocks]


def free_ids(pool: BlockPool) -> list[int]:
    return ids(pool.free_block_queue.get_all_free_blocks())


def cache_one(pool: BlockPool, block: KVCacheBlock, tokens: list[int]) -> bytes:
    """Cache `block` as the single full block of a request with `tokens`; return its hash."""
    req = hashed_request(tokens)
    pool.cache_full_blocks(req, [block], 0, 1, BLOCK_SIZE)
    return req.block_hashes[0]


def test_null_block_is_block_zero_and_never_handed_out() -> None:
    pool = BlockPool(5, enable_caching=True)
    assert pool.null_block is pool.blocks[0]
    assert pool.null_block.is_null
    assert not any(b.is_null for b in pool.blocks[1:])
    assert pool.get_num_free_blocks() == 4
    assert free_ids(pool) == [1, 2, 3, 4]
    assert ids(pool.get_new_blocks(4)) == [1, 2, 3, 4]
    with pytest.raises(ValueError):
        pool.get_new_blocks(1)
    pool.check_integrity()


@pytest.mark.parametrize("enable_caching", [True, False])
def test_get_new_blocks_in_lru_order_with_ref_cnt_one(enable_caching: bool) -> None:
    pool = BlockPool(8, enable_caching=enable_caching)
    first = pool.get_new_blocks(3)
    second = pool.get_new_blocks(2)
    assert ids(first) == [1, 2, 3]
    assert ids(second) == [4, 5]
    assert all(b.ref_cnt == 1 for b in first + second)
    assert free_ids(pool) == [6, 7]
    assert pool.get_num_free_blocks() == 2
    pool.check_integrity()


def test_get_new_blocks_more_than_free_raises_and_changes_nothing() -> None:
    pool = BlockPool(4, enable_caching=True)
    with pytest.raises(ValueError):
        pool.get_new_blocks(4)
    assert free_ids(pool) == [1, 2, 3]
    pool.check_integrity()


def test_free_blocks_appends_in_given_order() -> None:
    pool = BlockPool(8, enable_caching=True)
    a = pool.get_new_blocks(3)  # 1 2 3
    b = pool.get_new_blocks(2)  # 4 5
    pool.free_blocks(reversed(a))
    assert free_ids(pool) == [6, 7, 3, 2, 1]
    pool.free_blocks([b[1], b[0]])
    assert free_ids(pool) == [6, 7, 3, 2, 1, 5, 4]
    assert all(blk.ref_cnt == 0 for blk in a + b)
    pool.check_integrity()
    assert ids(pool.get_new_blocks(7)) == [6, 7, 3, 2, 1, 5, 4]


def test_shared_block_returns_to_queue_only_when_last_user_frees() -> None:
    pool = BlockPool(4, enable_caching=True)
    block = pool.get_new_blocks(1)[0]
    pool.touch([block])  # a second request shares it
    assert block.ref_cnt == 2
    assert pool.get_num_free_blocks() == 2
    pool.free_blocks([block])
    assert block.ref_cnt == 1
    assert free_ids(pool) == [2, 3]
    pool.check_integrity()
    pool.free_blocks([block])
    assert block.ref_cnt == 0
    assert free_ids(pool) == [2, 3, 1]
    pool.check_integrity()


def test_generation_moves_when_a_block_is_freed_or_evicted_never_while_held() -> None:
    """The fence a lease reads (connector/leases.py): a block's generation is unchanged for as
    long as someone holds it, and moves once nobody does (it may be rewritten from then on)
    or when its KV is evicted in place; the null block's never moves."""
    pool = BlockPool(4, enable_caching=True)
    block = pool.get_new_blocks(1)[0]
    first = pool.generation_of(block.block_id)
    pool.touch([block])  # shared: one user leaving changes nothing
    pool.free_blocks([block])
    assert pool.generation_of(block.block_id) == first
    cache_one(pool, block, [1, 2, 3, 4])
    pool.free_blocks([block])  # the last user: free, though still cached
    freed = pool.generation_of(block.block_id)
    assert freed == first + 1
    pool.touch([block])  # a prefix hit takes it back as it is
    assert pool.generation_of(block.block_id) == freed
    pool.evict_blocks([block])  # its KV was bad: rewritten in place
    assert pool.generation_of(block.block_id) == freed + 1
    pool.free_blocks([pool.null_block])
    pool.evict_blocks([pool.null_block])
    assert pool.generation_of(0) == 0
    pool.check_integrity()


def test_freed_cached_block_stays_findable_until_reallocated() -> None:
    pool = BlockPool(5, enable_caching=True, enable_kv_cache_events=True)
    block = pool.get_new_blocks(1)[0]
    assert block.block_id == 1
    block_hash = cache_one(pool, block, [1, 2, 3, 4])
    pool.free_blocks([block])
    assert pool.get_cached_block(block_hash) is block
    assert block.block_hash == block_hash
    pool.check_integrity()
    assert ids(pool.get_new_blocks(3)) == [2, 3, 4]  # the cached block is at the back
    assert pool.get_cached_block(block_hash) is block
    stored = pool.take_events()
    assert [type(e) for e in stored] == [BlockStored]
    assert ids(pool.get_new_blocks(1)) == [1]  # now it is evicted
    assert pool.get_cached_block(block_hash) is None
    assert block.block_hash is None
    assert block.ref_cnt == 1
    assert pool.take_events() == [BlockRemoved(block_hashes=[block_hash])]
    pool.check_integrity()


def test_touch_cached_free_block_removes_it_from_free_queue() -> None:
    pool = BlockPool(5, enable_caching=True)
    block = pool.get_new_blocks(1)[0]
    block_hash = cache_one(pool, block, [7, 7, 7, 7])
    pool.free_blocks([block])
    assert free_ids(pool) == [2, 3, 4, 1]
    hit = pool.get_cached_block(block_hash)
    assert hit is block and hit.ref_cnt == 0
    pool.touch([hit])
    assert block.ref_cnt == 1
    assert pool.get_num_free_blocks() == 3
    assert free_ids(pool) == [2, 3, 4]
    assert pool.get_cached_block(block_hash) is block  # still cached while in use
    pool.check_integrity()
    assert ids(pool.get_new_blocks(3)) == [2, 3, 4]
    assert pool.get_cached_block(block_hash) is block


def test_duplicate_hash_blocks_both_cached_and_evicted_independently() -> None:
    pool = BlockPool(4, enable_caching=True, enable_kv_cache_events=True)
    a, b = pool.get_new_blocks(2)
    tokens = [5, 6, 7, 8]
    hash_a = cache_one(pool, a, tokens)
    hash_b = cache_one(pool, b, tokens)
    assert hash_a == hash_b
    assert pool.cached_block_hash_to_block.num_blocks() == 2
    assert len(pool.cached_block_hash_to_block) == 1
    assert pool.get_cached_block(hash_a) in (a, b)
    pool.check_integrity()
    pool.free_blocks([a, b])  # queue: 3, 1, 2
    pool.take_events()
    assert ids(pool.get_new_blocks(2)) == [3, 1]  # evicts a only
    assert pool.get_cached_block(hash_a) is b
    assert b.block_hash == hash_a
    assert pool.take_events() == [BlockRemoved(block_hashes=[hash_a])]
    pool.check_integrity()
    assert ids(pool.get_new_blocks(1)) == [2]
    assert pool.get_cached_block(hash_a) is None
    assert pool.cached_block_hash_to_block.num_blocks() == 0
    pool.check_integrity()


def test_hash_map_duplicates_direct() -> None:
    cache = BlockHashToBlockMap()
    a, b, c = KVCacheBlock(1), KVCacheBlock(2), KVCacheBlock(3)
    key, other = b"k" * 32, b"o" * 32
    assert cache.get_one_block(key) is None
    cache.insert(key, a)
    assert cache.get_one_block(key) is a
    assert cache.pop(key, 2) is None  # wrong block id: the entry stays
    assert cache.get_one_block(key) is a
    cache.insert(key, b)
    cache.insert(key, c)
    cache.insert(other, b)
    assert (len(cache), cache.num_blocks()) == (2, 4)
    assert cache.pop(key, 2) is b
    assert cache.get_one_block(key) in (a, c)
    assert cache.pop(key, 9) is None
    assert cache.num_blocks() == 3
    assert cache.pop(key, 1) is a
    assert cache.get_one_block(key) is c
    assert cache.pop(key, 3) is c
    assert cache.get_one_block(key) is None
    assert cache.pop(key, 3) is None
    assert cache.get_one_block(other) is b
    assert (len(cache), cache.num_blocks()) == (1, 1)


def test_cache_full_blocks_emits_block_stored() -> None:
    pool = BlockPool(6, enable_caching=True, enable_kv_cache_events=True)
    tokens = list(range(10, 20))  # 10 tokens: 2 full blocks
    req = hashed_request(tokens)
    blocks = pool.get_new_blocks(3)
    pool.cache_full_blocks(req, blocks, 0, 2, BLOCK_SIZE)
    h0, h1 = req.block_hashes
    assert (blocks[0].block_hash, blocks[1].block_hash, blocks[2].block_hash) == (h0, h1, None)
    assert pool.take_events() == [
        BlockStored(
            block_hashes=[h0, h1], parent_block_hash=None, token_ids=tokens[:8], block_size=4
        )
    ]
    pool.cache_full_blocks(req, blocks, 2, 2, BLOCK_SIZE)  # nothing new is full
    assert pool.take_events() == []
    req.append_output_token_ids(20)
    req.append_output_token_ids(21)
    h2 = req.block_hashes[2]
    pool.cache_full_blocks(req, blocks, 2, 3, BLOCK_SIZE)
    assert pool.get_cached_block(h2) is blocks[2]
    assert pool.take_events() == [
        BlockStored(
            block_hashes=[h2], parent_block_hash=h1, token_ids=[18, 19, 20, 21], block_size=4
        )
    ]
    pool.check_integrity()


def test_cached_hashes_are_listed_in_the_order_they_were_cached() -> None:
    """A snapshot lists a prompt's blocks as its events did, whatever their block ids (the
    KV index lays its entries out in that order); a duplicate's hash once per block."""
    pool = BlockPool(10, enable_caching=True)
    pool.free_blocks(list(reversed(pool.get_new_blocks(9))))  # the queue: ids 9 .. 1
    first, second = hashed_request(list(range(12)), "a"), hashed_request(list(range(50, 58)))
    blocks = pool.get_new_blocks(3)
    assert ids(blocks) == [9, 8, 7]  # prompt order is not id order
    pool.cache_full_blocks(first, blocks, 0, 3, BLOCK_SIZE)
    pool.cache_full_blocks(second, pool.get_new_blocks(2), 0, 2, BLOCK_SIZE)
    twin = pool.get_new_blocks(1)
    pool.cache_full_blocks(hashed_request(list(range(4))), twin, 0, 1, BLOCK_SIZE)
    expected = [*first.block_hashes, *second.block_hashes]
    expected.insert(1, first.block_hashes[0])  # the duplicate, beside its first block
    assert pool.cached_block_hashes() == expected
    assert sorted(pool.cached_block_hashes()) == sorted(
        b.block_hash for b in pool.blocks if b.block_hash is not None
    )


def test_cache_full_blocks_without_events_records_none() -> None:
    pool = BlockPool(4, enable_caching=True, enable_kv_cache_events=False)
    block = pool.get_new_blocks(1)[0]
    block_hash = cache_one(pool, block, [1, 2, 3, 4])
    assert pool.get_cached_block(block_hash) is block
    pool.free_blocks([block])
    pool.get_new_blocks(3)
    assert pool.get_cached_block(block_hash) is None
    assert pool.take_events() == []


def test_reset_prefix_cache_refused_while_in_use_then_clears() -> None:
    pool = BlockPool(5, enable_caching=True, enable_kv_cache_events=True)
    blocks = pool.get_new_blocks(2)
    req = hashed_request(list(range(8)))
    pool.cache_full_blocks(req, blocks, 0, 2, BLOCK_SIZE)
    pool.take_events()
    pool.free_blocks(blocks[:1])
    assert pool.reset_prefix_cache() is False
    assert pool.get_cached_block(req.block_hashes[1]) is blocks[1]
    assert pool.take_events() == []
    pool.check_integrity()
    pool.free_blocks(blocks[1:])
    assert pool.reset_prefix_cache() is True
    assert all(pool.get_cached_block(h) is None for h in req.block_hashes)
    assert all(b.block_hash is None for b in pool.blocks)
    assert pool.cached_block_hash_to_block.num_blocks() == 0
    assert pool.take_events() == [AllBlocksCleared()]
    assert free_ids(pool) == [3, 4, 1, 2]  # resetting does not reorder the queue
    pool.check_integrity()
    pool.get_new_blocks(4)
    assert pool.take_events() == []  # nothing left to evict


def test_take_events_drains() -> None:
    pool = BlockPool(4, enable_caching=True, enable_kv_cache_events=True)
    block = pool.get_new_blocks(1)[0]
    cache_one(pool, block, [1, 1, 1, 1])
    pool.free_blocks([block])
    assert pool.reset_prefix_cache()
    events = pool.take_events()
    assert [type(e) for e in events] == [BlockStored, AllBlocksCleared]
    assert pool.take_events() == []


def test_get_usage() -> None:
    pool = BlockPool(5, enable_caching=True)
    assert pool.get_usage() == 0.0
    a = pool.get_new_blocks(1)
    assert pool.get_usage() == pytest.approx(0.25)
    b = pool.get_new_blocks(3)
    assert pool.get_usage() == 1.0
    cache_one(pool, a[0], [1, 2, 3, 4])
    pool.free_blocks(a)  # cached but free counts as free
    assert pool.get_usage() == pytest.approx(0.75)
    pool.free_blocks(b)
    assert pool.get_usage() == 0.0


@pytest.mark.parametrize(
    "corrupt",
    [
        lambda pool: setattr(pool.blocks[4], "ref_cnt", 1),  # free block claims a user
        lambda pool: setattr(pool.blocks[2], "ref_cnt", 0),  # held block claims to be free
        lambda pool: setattr(pool.blocks[2], "block_hash", b"x" * 32),  # hash not in the map
        lambda pool: setattr(pool.blocks[1], "block_hash", None),  # map entry lost its hash
        lambda pool: setattr(pool.free_block_queue, "num_free_blocks", 3),  # miscount
        lambda pool: pool.free_block_queue.append(pool.null_block),
    ],
    ids=["free-ref1", "held-ref0", "hash-not-mapped", "map-stale", "miscount", "null-free"],
)
def test_check_integrity_detects_corruption(corrupt) -> None:
    pool = BlockPool(5, enable_caching=True)
    held = pool.get_new_blocks(2)  # blocks 1, 2 held; 3, 4 free
    cache_one(pool, held[0], [1, 2, 3, 4])
    pool.check_integrity()
    corrupt(pool)
    with pytest.raises(AssertionError):
        pool.check_integrity()
