"""Per-attention-type block bookkeeping: which blocks each request holds and what hits."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence

from engine.core.block_pool import BlockPool
from engine.core.kv_cache_utils import BlockHash, KVCacheBlock, cdiv
from engine.request import Request


class SingleTypeKVCacheManager(ABC):
    """Blocks of one attention type. Subclasses decide what a cache hit is and which blocks
    a request may drop while it runs (full attention: none; sliding window: old ones)."""

    # Whether remove_skipped_blocks can ever free anything (lets callers skip the call).
    drops_blocks = False

    def __init__(self, block_pool: BlockPool, block_size: int) -> None:
        self.block_pool = block_pool
        self.block_size = block_size
        # Append-only per request: a block's index in the list is its position in the sequence.
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        # How many leading blocks of a request are already in the prefix cache.
        self.num_cached_block: dict[str, int] = {}

    def get_num_blocks_to_allocate(
        self, request_id: str, num_tokens: int, new_computed_blocks: Sequence[KVCacheBlock]
    ) -> int:
        """Blocks the free queue must give up to hold `num_tokens` slots for the request."""
        num_held = len(self.req_to_blocks.get(request_id, ()))
        num_new = cdiv(num_tokens, self.block_size) - len(new_computed_blocks) - num_held
        if not new_computed_blocks:
            return max(num_new, 0)
        # A hit on a cached block nobody uses also takes it out of the free queue.
        num_evictable_hits = sum(1 for b in new_computed_blocks if b.ref_cnt == 0 and not b.is_null)
        return max(num_new, 0) + num_evictable_hits

    def save_new_computed_blocks(
        self, request_id: str, new_computed_blocks: Sequence[KVCacheBlock]
    ) -> None:
        """Attach prefix hits to a request that holds no blocks yet."""
        if not new_computed_blocks:
            return
        self.block_pool.touch(new_computed_blocks)
        blocks = self.req_to_blocks.setdefault(request_id, [])
        if blocks:
            raise RuntimeError(f"prefix hits for {request_id!r}, which already holds blocks")
        blocks.extend(new_computed_blocks)
        self.num_cached_block[request_id] = len(new_computed_blocks)

    def allocate_new_blocks(self, request_id: str, num_tokens: int) -> list[KVCacheBlock]:
        blocks = self.req_to_blocks.setdefault(request_id, [])
        num_new = cdiv(num_tokens, self.block_size) - len(blocks)
        if num_new <= 0:
            return []
        new_blocks = self.block_pool.get_new_blocks(num_new)
        blocks.extend(new_blocks)
        return new_blocks

    def cache_blocks(self, request: Request, num_tokens: int) -> None:
        """Index every full block among the first `num_tokens` tokens in the prefix cache."""
        request_id = request.request_id
        num_full = num_tokens // self.block_size
        num_cached = self.num_cached_block.get(request_id, 0)
        if num_full <= num_cached:
            return  # the common case on a decode step: the last block is still filling
        self.block_pool.cache_full_blocks(
            request, self.req_to_blocks[request_id], num_cached, num_full, self.block_size
        )
        self.num_cached_block[request_id] = num_full

    def uncache_from(self, request_id: str, first_block: int) -> None:
        """Take the request's blocks from `first_block` on out of the prefix cache."""
        num_cached = self.num_cached_block.get(request_id, 0)
        if num_cached <= first_block:
            return
        self.block_pool.evict_blocks(self.req_to_blocks[request_id][first_block:num_cached])
        self.num_cached_block[request_id] = first_block

    def free(self, request_id: str) -> None:
        """Release a request's blocks, the last ones first: the tail of a sequence is the
        least likely to be shared, so it should be the first to be evicted."""
        blocks = self.req_to_blocks.pop(request_id, [])
        self.num_cached_block.pop(request_id, None)
        self.block_pool.free_blocks(reversed(blocks))

    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        """Free blocks the request will never read again. None, for full attention."""
        return

    @abstractmethod
    def find_longest_cache_hit(
        self, block_hashes: Sequence[BlockHash], max_length: int
    ) -> list[KVCacheBlock]:
        """The cached blocks that cover the longest reusable prefix of `max_length` tokens
        at most (null blocks stand for positions the attention type never reads)."""


class FullAttentionManager(SingleTypeKVCacheManager):
    def find_longest_cache_hit(
        self, block_hashes: Sequence[BlockHash], max_length: int
    ) -> list[KVCacheBlock]:
        hits: list[KVCacheBlock] = []
        get_cached_block = self.block_pool.get_cached_block
        for block_hash in block_hashes[: max_length // self.block_size]:
            block = get_cached_block(block_hash)
            if block is None:
                break  # hashes are chained: one miss means every later block misses too
            hits.append(block)
        return hits


class SlidingWindowManager(SingleTypeKVCacheManager):
    """Attention over the last `sliding_window` tokens only.

    A hit needs just the blocks inside the window before the hit's end, so the scan runs from
    the right; blocks left of the window are replaced by the null block and freed early.
    """

    drops_blocks = True

    def __init__(self, block_pool: BlockPool, block_size: int, sliding_window: int) -> None:
        super().__init__(block_pool, block_size)
        self.sliding_window = sliding_window
        # Blocks a token at the window's right edge may read, the current one excluded.
        self._num_contiguous_blocks = cdiv(sliding_window - 1, block_size)

    def find_longest_cache_hit(
        self, block_hashes: Sequence[BlockHash], max_length: int
    ) -> list[KVCacheBlock]:
        max_num_blocks = max_length // self.block_size
        null = self.block_pool.null_block
        hits: list[KVCacheBlock] = [null] * max_num_blocks
        run = 0
        for i in range(max_num_blocks - 1, -1, -1):
            block = self.block_pool.get_cached_block(block_hashes[i])
            if block is None:
                run = 0
                continue
            hits[i] = block
            run += 1
            if run >= self._num_contiguous_blocks:
                # blocks [i, i + run) are enough; everything after them is dropped.
                return hits[: i + run]
        # Reaching the sequence start with a shorter run is a hit too: nothing precedes it.
        return hits[:run]

    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        # Tokens before `first_needed` are outside the window of every future token.
        first_needed = max(0, num_computed_tokens - self.sliding_window + 1)
        blocks = self.req_to_blocks.get(request_id)
        if not blocks:
            return
        null = self.block_pool.null_block
        dropped = []
        for i in range(first_needed // self.block_size - 1, -1, -1):
            if blocks[i] is null:
                break  # everything before was replaced on an earlier step
            dropped.append(blocks[i])
            blocks[i] = null
        self.block_pool.free_blocks(dropped)
