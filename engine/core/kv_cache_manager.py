"""KVCacheManager: the scheduler's one door to KV blocks (lookup, allocate, cache, free)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from engine.config import CacheConfig
from engine.core.block_pool import BlockPool
from engine.core.kv_cache_utils import (
    HASH_FUNCTIONS,
    BlockHash,
    KVCacheBlock,
    make_block_hasher,
)
from engine.core.kv_events import KVCacheEvent
from engine.core.pins import KVPins
from engine.core.single_type_kv_cache_manager import (
    FullAttentionManager,
    SingleTypeKVCacheManager,
    SlidingWindowManager,
)
from engine.offload.tier_index import TierIndex
from engine.request import Request


@dataclass
class PrefixCacheStats:
    """Counts since the engine began; tokens, not blocks."""

    requests: int = 0
    queries: int = 0
    hits: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


class KVCacheManager:
    def __init__(self, cache_config: CacheConfig, max_model_len: int) -> None:
        if cache_config.num_blocks is None:
            raise ValueError("CacheConfig.num_blocks must be set before building the KV cache")
        self.block_size = cache_config.block_size
        self.max_model_len = max_model_len
        self.enable_caching = cache_config.enable_prefix_caching
        self.block_pool = BlockPool(
            cache_config.num_blocks, self.enable_caching, cache_config.enable_kv_cache_events
        )
        self.manager = _make_single_type_manager(cache_config, self.block_pool)
        # The manager's own tables, read on every decode step (allocate_running_slots).
        self._req_to_blocks = self.manager.req_to_blocks
        self._num_cached_block = self.manager.num_cached_block
        self._drops_blocks = self.manager.drops_blocks
        # Per running request: the computed tokens it may reach with nothing to allocate nor
        # cache. The scheduler reads it on every decode step and calls allocate_running_slots
        # only past it (read-only outside; an entry is dropped when its blocks are freed).
        self.running_room: dict[str, int] = {}
        self.block_hasher = make_block_hasher(
            self.block_size, HASH_FUNCTIONS[cache_config.prefix_caching_hash_algo]
        )
        self.prefix_cache_stats = PrefixCacheStats()
        # Prefix blocks lent to other engines, by loan (lease) id.
        self._loans: dict[str, list[KVCacheBlock]] = {}
        # Finished turns' pins (engine/core/pins.py; the scheduler's), counted as users.
        self.pins: KVPins | None = None
        # The tier below this pool (engine/offload/), where one is configured.
        self.tier: TierIndex | None = None
        if cache_config.num_tier_blocks:
            lower = cache_config.num_disk_tier_blocks
            self.tier = TierIndex(
                cache_config.kv_offloading_backend,
                cache_config.num_tier_blocks,
                self.block_size,
                self.block_pool,
                lower=("disk", lower) if lower else None,
            )

    @property
    def usage(self) -> float:
        return self.block_pool.get_usage()

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """Longest cached prefix of a request as (blocks, num_tokens).

        Capped at `num_tokens - 1`: the last token must run through the model so that there
        are logits to sample from, even when the whole prompt is cached.
        """
        if not self.enable_caching:
            return [], 0
        blocks = self.manager.find_longest_cache_hit(request.block_hashes, request.num_tokens - 1)
        num_hit_tokens = len(blocks) * self.block_size
        stats = self.prefix_cache_stats
        stats.requests += 1
        stats.queries += request.num_tokens
        stats.hits += num_hit_tokens
        return blocks, num_hit_tokens

    def lend_prefix(self, block_hashes: Sequence[BlockHash], loan_id: str) -> list[KVCacheBlock]:
        """The cached blocks of the leading run of `block_hashes`, each taken as one more user
        (kept from eviction) for another engine to read, until `return_loan(loan_id)`. Nothing
        for sliding-window models (their early blocks may be gone)."""
        if not self.enable_caching or self.manager.drops_blocks:
            return []
        max_tokens = len(block_hashes) * self.block_size
        blocks = self.manager.find_longest_cache_hit(block_hashes, max_tokens)
        if blocks:
            self.block_pool.touch(blocks)
            self._loans[loan_id] = blocks
        return blocks

    def extend_loan(self, loan_id: str, blocks: list[KVCacheBlock]) -> None:
        """Lend `blocks` (each held by its caller: offload/tier_loans.py) under `loan_id` too,
        after those lend_prefix lent."""
        if blocks:
            self._loans.setdefault(loan_id, []).extend(blocks)

    def return_loan(self, loan_id: str) -> bool:
        """The borrower is done (or its lease expired): False when `loan_id` is no loan."""
        blocks = self._loans.pop(loan_id, None)
        if blocks is None:
            return False
        self.block_pool.free_blocks(reversed(blocks))  # tail first, as requests free
        return True

    @property
    def num_lent_blocks(self) -> int:
        return sum(len(blocks) for blocks in self._loans.values())

    def allocate_running_slots(
        self, request: Request, num_new_tokens: int, num_lookahead_tokens: int = 0
    ) -> list[KVCacheBlock] | None:
        """allocate_slots for a running request (no prefix hits, no remote KV), called when
        its computed tokens would pass its `running_room` or it needs lookahead slots: usually
        its last block fills up (cache it) or it needs another."""
        need = request.num_computed_tokens + num_new_tokens
        new_blocks = self._grow_running(request, num_new_tokens, need, num_lookahead_tokens)
        if new_blocks is not None and not self._drops_blocks:
            self._note_room(request)
        return new_blocks

    def _grow_running(
        self, request: Request, num_new_tokens: int, need: int, num_lookahead_tokens: int
    ) -> list[KVCacheBlock] | None:
        held = self._req_to_blocks.get(request.request_id)
        if (
            held is None
            or num_lookahead_tokens
            or len(held) * self.block_size < need
            or self._drops_blocks
        ):
            return self.allocate_slots(
                request, num_new_tokens, num_lookahead_tokens=num_lookahead_tokens
            )
        # No cap at max_model_len: an unfinished request's tokens, drafts and samples in
        # flight never pass it. Only verified tokens are cached.
        if self.enable_caching:
            self.manager.cache_blocks(request, min(need, len(request.all_token_ids)))
        return []

    def _note_room(self, request: Request) -> None:
        """The most tokens `request` may have computed with nothing to do: within its held
        slots, short of filling its first block not yet cached. Only grows until freed."""
        block_size = self.block_size
        room = len(self._req_to_blocks[request.request_id]) * block_size
        if self.enable_caching:
            num_cached = self._num_cached_block.get(request.request_id, 0)
            room = min(room, (num_cached + 1) * block_size - 1)
        self.running_room[request.request_id] = room

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: Sequence[KVCacheBlock] = (),
        num_lookahead_tokens: int = 0,
        num_external_computed_tokens: int = 0,
        delay_cache_blocks: bool = False,
    ) -> list[KVCacheBlock] | None:
        """Make room for the tokens a step will compute; None if the pool cannot.

        Slots of a request, left to right:
        | computed | new computed (local hits) | external (connector) | new | lookahead |
                                               |<------------- allocated ------------->|
        Nothing is changed before the capacity check passes, so None leaves no trace.
        Returns the newly allocated blocks (possibly empty).
        """
        if num_new_tokens < 0:
            raise ValueError(f"num_new_tokens must be >= 0, got {num_new_tokens}")
        num_local_computed = request.num_computed_tokens + num_new_computed_tokens
        num_computed = min(num_local_computed + num_external_computed_tokens, self.max_model_len)
        num_tokens_need_slot = min(
            num_computed + num_new_tokens + num_lookahead_tokens, self.max_model_len
        )
        manager = self.manager
        manager.remove_skipped_blocks(request.request_id, request.num_computed_tokens)
        num_to_allocate = manager.get_num_blocks_to_allocate(
            request.request_id, num_tokens_need_slot, new_computed_blocks
        )
        if num_to_allocate > self.block_pool.get_num_free_blocks():
            return None
        if new_computed_blocks:
            manager.save_new_computed_blocks(request.request_id, new_computed_blocks)
        new_blocks = manager.allocate_new_blocks(request.request_id, num_tokens_need_slot)
        if self.enable_caching and not delay_cache_blocks:
            # Only verified tokens are cached: lookahead slots hold nothing yet.
            manager.cache_blocks(request, min(num_computed + num_new_tokens, request.num_tokens))
        return new_blocks

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        """Cache blocks whose caching was delayed (e.g. until a remote load finished)."""
        if self.enable_caching:
            self.manager.cache_blocks(request, num_computed_tokens)

    def uncache_unwritten(self, request: Request) -> None:
        """Take the request's blocks past its computed tokens out of the prefix cache. They were
        indexed when this step granted it slots, for the KV the step would write; a request
        unscheduled in the same step (a later one preempted it) never has it written, and a
        prefix hit on them would read whatever the blocks held before."""
        if self.enable_caching:
            self.manager.uncache_from(
                request.request_id, request.num_computed_tokens // self.block_size
            )

    def free(self, request: Request, preempted: bool = False) -> None:
        """Let go of the request's blocks. With a tier, its cached ones go down, tail first:
        held until copied while steps go on, or, for a preempted request (its blocks are
        needed now), copied before the next step runs where swapping pays."""
        if self.tier is not None:
            tail_first = self.manager.req_to_blocks.get(request.request_id, [])[::-1]
            if preempted:
                self.tier.preempt(tail_first, request.num_computed_tokens)
            else:
                self.tier.offer(tail_first)
        self.manager.free(request.request_id)
        self.running_room.pop(request.request_id, None)

    def release_oldest_pin(self) -> bool:
        """Let go of the oldest pin early, for a request that needs its blocks now: into the
        tier below where there is one (copied before the next step runs). False: no pin."""
        oldest = self.pins.oldest_freeing() if self.pins is not None else None
        if oldest is None or self.pins is None:
            return False
        key, blocks = oldest
        if self.tier is not None:
            self.tier.offer(blocks[::-1], hold=False)
            self.pins.stats.moved_down += 1
        else:
            self.pins.stats.gave_way += 1
        self.pins.release(key)
        return True

    def evict_blocks(self, block_ids: Sequence[int]) -> None:
        """Remove blocks from the prefix cache (their KV is not to be trusted)."""
        blocks = self.block_pool.blocks
        self.block_pool.evict_blocks(blocks[i] for i in block_ids)

    def get_blocks(self, request_id: str) -> list[KVCacheBlock]:
        return self.manager.req_to_blocks.get(request_id, [])

    def get_block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.manager.req_to_blocks.get(request_id, ())]

    def reset_prefix_cache(self) -> bool:
        if self.pins is not None:  # the KV they keep is no longer to be reused
            self.pins.release_all()
        if not self.block_pool.reset_prefix_cache():
            return False
        if self.tier is not None:
            self.tier.clear()
        return True

    def cached_block_hashes(self) -> list[BlockHash]:
        """Every hash this engine can serve a prefix from: the pool's (one per block) and its
        tier's (loaded back before use)."""
        hashes = self.block_pool.cached_block_hashes()
        return hashes if self.tier is None else [*hashes, *self.tier.block_hashes()]

    def tier_block_hashes(self) -> list[BlockHash]:
        """Those of cached_block_hashes that the tier holds, one per slot (the pool may hold
        the same hash too: stores are copies)."""
        return [] if self.tier is None else self.tier.block_hashes()

    def take_events(self) -> list[KVCacheEvent]:
        return self.block_pool.take_events()

    def check_integrity(self) -> None:
        """The pool's invariants, plus: every block a request, a loan or a store to the tier
        holds is counted in its ref_cnt."""
        self.block_pool.check_integrity()
        users: dict[int, int] = {}
        for blocks in [*self.manager.req_to_blocks.values(), *self._loans.values()]:
            for block in blocks:
                if not block.is_null:
                    users[block.block_id] = users.get(block.block_id, 0) + 1
        for block_id in self.tier.storing_block_ids() if self.tier is not None else ():
            users[block_id] = users.get(block_id, 0) + 1
        for block_id in self.pins.pinned_block_ids() if self.pins is not None else ():
            users[block_id] = users.get(block_id, 0) + 1
        for block in self.block_pool.blocks[1:]:
            if block.ref_cnt != users.get(block.block_id, 0):
                raise AssertionError(
                    f"{block}: ref_cnt {block.ref_cnt} but held by "
                    f"{users.get(block.block_id, 0)} requests, loans, tier stores and pins"
                )


def _make_single_type_manager(config: CacheConfig, pool: BlockPool) -> SingleTypeKVCacheManager:
    if config.sliding_window is not None:
        return SlidingWindowManager(pool, config.block_size, config.sliding_window)
    return FullAttentionManager(pool, config.block_size)
