"""BlockPool: owns every KVCacheBlock, the free queue and the prefix-cache hash map."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from engine.core.kv_cache_utils import BlockHash, FreeKVCacheBlockQueue, KVCacheBlock
from engine.core.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent
from engine.request import Request


class BlockHashToBlockMap:
    """hash -> cached block(s).

    Two requests that compute the same prefix in the same step end up with two physical blocks
    of one hash; both stay cached. The common single-block case stores the block itself, and
    only a duplicate upgrades the entry to a {block_id: block} dict (no dict per entry).
    """

    def __init__(self) -> None:
        self._cache: dict[BlockHash, KVCacheBlock | dict[int, KVCacheBlock]] = {}

    def get_one_block(self, key: BlockHash) -> KVCacheBlock | None:
        entry = self._cache.get(key)
        if entry is None or isinstance(entry, KVCacheBlock):
            return entry
        return next(iter(entry.values()))

    def insert(self, key: BlockHash, block: KVCacheBlock) -> None:
        entry = self._cache.get(key)
        if entry is None:
            self._cache[key] = block
        elif isinstance(entry, KVCacheBlock):
            self._cache[key] = {entry.block_id: entry, block.block_id: block}
        else:
            entry[block.block_id] = block

    def pop(self, key: BlockHash, block_id: int) -> KVCacheBlock | None:
        """Drop the entry of `block_id` under `key`; the other duplicates stay."""
        entry = self._cache.get(key)
        if entry is None:
            return None
        if isinstance(entry, KVCacheBlock):
            if entry.block_id != block_id:
                return None
            del self._cache[key]
            return entry
        block = entry.pop(block_id, None)
        if len(entry) == 1:
            self._cache[key] = next(iter(entry.values()))
        return block

    def block_hashes(self) -> list[BlockHash]:
        """Each cached block's hash (a duplicate's once per block), in the order the hashes
        were first cached."""
        hashes: list[BlockHash] = []
        for key, entry in self._cache.items():
            if isinstance(entry, KVCacheBlock):
                hashes.append(key)
            else:
                hashes.extend([key] * len(entry))
        return hashes

    def num_blocks(self) -> int:
        return sum(1 if isinstance(e, KVCacheBlock) else len(e) for e in self._cache.values())

    def __len__(self) -> int:
        return len(self._cache)


# The null block's id: a block table's entry for positions its attention type never reads
# (left of a sliding window), and what padding slots write to; never holds anyone's KV.
NULL_BLOCK_ID = 0


class BlockPool:
    """All KV blocks of one engine. Block 0 is the null block: never allocated, never freed."""

    def __init__(
        self, num_blocks: int, enable_caching: bool, enable_kv_cache_events: bool = False
    ) -> None:
        if num_blocks < 2:
            raise ValueError(f"num_blocks must be >= 2 (null block + 1), got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.free_block_queue = FreeKVCacheBlockQueue(self.blocks)
        self.cached_block_hash_to_block = BlockHashToBlockMap()
        self.null_block = self.free_block_queue.popleft()
        assert self.null_block.block_id == NULL_BLOCK_ID
        self.null_block.is_null = True
        self.enable_kv_cache_events = enable_kv_cache_events
        self._events: list[KVCacheEvent] = []

    def get_cached_block(self, block_hash: BlockHash) -> KVCacheBlock | None:
        return self.cached_block_hash_to_block.get_one_block(block_hash)

    def cache_full_blocks(
        self,
        request: Request,
        blocks: Sequence[KVCacheBlock],
        num_cached_blocks: int,
        num_full_blocks: int,
        block_size: int,
    ) -> None:
        """Give `blocks[num_cached_blocks:num_full_blocks]` their hashes and index them."""
        if num_cached_blocks >= num_full_blocks:
            return
        hashes = request.block_hashes
        stored: list[BlockHash] = []
        for i in range(num_cached_blocks, num_full_blocks):
            block = blocks[i]
            if block.is_null or block.block_hash is not None:
                continue  # a prefix hit: already cached under this very hash
            block.block_hash = hashes[i]
            self.cached_block_hash_to_block.insert(hashes[i], block)
            stored.append(hashes[i])
        if self.enable_kv_cache_events and stored:
            first = num_cached_blocks
            self._events.append(
                BlockStored(
                    block_hashes=stored,
                    parent_block_hash=hashes[first - 1] if first > 0 else None,
                    token_ids=request.all_token_ids[
                        first * block_size : num_full_blocks * block_size
                    ],
                    block_size=block_size,
                )
            )

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Take `num_blocks` from the LRU end, evicting their old cache entries."""
        if num_blocks > self.free_block_queue.num_free_blocks:
            raise ValueError(
                f"cannot allocate {num_blocks} blocks, "
                f"{self.free_block_queue.num_free_blocks} are free"
            )
        blocks = self.free_block_queue.popleft_n(num_blocks)
        if self.enable_caching:
            for block in blocks:
                if block.block_hash is not None:
                    self._evict_cached_block(block)
                block.ref_cnt = 1
        else:
            for block in blocks:
                block.ref_cnt = 1
        return blocks

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """A prefix hit: one more user; a block nobody used leaves the free queue."""
        for block in blocks:
            if block.ref_cnt == 0 and not block.is_null:
                self.free_block_queue.remove(block)
            block.ref_cnt += 1

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """One user fewer; blocks nobody uses go to the back of the queue in the given order."""
        to_free = []
        for block in ordered_blocks:
            block.ref_cnt -= 1
            if block.ref_cnt == 0 and not block.is_null:
                block.generation += 1
                to_free.append(block)
        self.free_block_queue.append_n(to_free)

    def evict_blocks(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Drop cache entries whose KV must not be reused (e.g. a failed remote load)."""
        for block in blocks:
            if block.is_null:
                continue
            block.generation += 1  # held, and about to be rewritten
            if block.block_hash is not None:
                self._evict_cached_block(block)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash. Refused (False) while any request holds blocks."""
        if self.get_num_free_blocks() != self.num_blocks - 1:
            return False
        self.cached_block_hash_to_block = BlockHashToBlockMap()
        for block in self.blocks:
            block.block_hash = None
        if self.enable_kv_cache_events:
            self._events.append(AllBlocksCleared())
        return True

    def generation_of(self, block_id: int) -> int:
        """The block's generation (KVCacheBlock.generation); any thread may ask (the side
        channel's do, to fence reads): an int read is atomic."""
        return self.blocks[block_id].generation

    def get_num_free_blocks(self) -> int:
        return self.free_block_queue.num_free_blocks

    def get_usage(self) -> float:
        """Fraction of usable blocks held by requests (cached-but-free blocks count as free)."""
        usable = self.num_blocks - 1
        return 1.0 - self.get_num_free_blocks() / usable

    def cached_block_hashes(self) -> list[BlockHash]:
        """The hash of every cached block (one entry per block), in the order they were cached:
        a request's blocks one after another in prompt order, as its events listed them (the
        KV index lays its entries out in the order it learns of them, and a walk over blocks
        side by side is fast: deployments/cluster/csrc/holder_store.h). By block id, as the
        pool holds them, a long-running engine's snapshot lists a prompt's blocks scattered."""
        return self.cached_block_hash_to_block.block_hashes()

    def record_event(self, event: KVCacheEvent) -> None:
        """An event of a tier below this pool, in order with the pool's own."""
        if self.enable_kv_cache_events:
            self._events.append(event)

    def take_events(self) -> list[KVCacheEvent]:
        events, self._events = self._events, []
        return events

    def check_integrity(self) -> None:
        """Raise AssertionError if the pool's invariants do not hold. O(num_blocks)."""
        free = self.free_block_queue.get_all_free_blocks()
        free_ids = {b.block_id for b in free}
        if len(free_ids) != len(free) or len(free) != self.get_num_free_blocks():
            raise AssertionError("free queue holds duplicates or miscounts its blocks")
        if 0 in free_ids:
            raise AssertionError("the null block is in the free queue")
        for block in self.blocks[1:]:
            in_free = block.block_id in free_ids
            if in_free != (block.ref_cnt == 0):
                raise AssertionError(f"{block} is free={in_free} but ref_cnt={block.ref_cnt}")
            if block.ref_cnt < 0:
                raise AssertionError(f"{block} has a negative ref_cnt")
            if block.block_hash is not None:
                cached = self.cached_block_hash_to_block._cache.get(block.block_hash)
                ok = cached is block or (
                    isinstance(cached, dict) and cached.get(block.block_id) is block
                )
                if not ok:
                    raise AssertionError(f"{block} has a hash but is not in the hash map")
        if self.cached_block_hash_to_block.num_blocks() != sum(
            b.block_hash is not None for b in self.blocks
        ):
            raise AssertionError("the hash map holds blocks that lost their hash")

    def _evict_cached_block(self, block: KVCacheBlock) -> None:
        block_hash = block.block_hash
        assert block_hash is not None
        self.cached_block_hash_to_block.pop(block_hash, block.block_id)
        block.block_hash = None
        if self.enable_kv_cache_events:
            self._events.append(BlockRemoved(block_hashes=[block_hash]))
