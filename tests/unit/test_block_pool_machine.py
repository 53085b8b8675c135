"""BlockPool against a model of it (hypothesis' stateful testing): requests allocate, share,
cache, touch and free blocks in any order; ref counts, cached hashes, the free queue's order,
events and block generations always match the model."""

from __future__ import annotations

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from engine.core.block_pool import BlockPool
from engine.core.kv_cache_utils import KVCacheBlock
from engine.core.kv_events import AllBlocksCleared, BlockRemoved, BlockStored
from engine.request import Request, SamplingParams
from tests.unit.test_block_pool import BLOCK_SIZE, free_ids, ids

NUM_BLOCKS = 12
HASHES = [bytes([i]) * 32 for i in range(3)]


class BlockPoolMachine(RuleBasedStateMachine):
    """Requests hold lists of blocks; the model mirrors ref counts and cached hashes."""

    def __init__(self) -> None:
        super().__init__()
        self.pool = BlockPool(NUM_BLOCKS, enable_caching=True, enable_kv_cache_events=True)
        # Each held list: [(block, obtained_by_touch)], as one request would hold them.
        self.held: list[list[tuple[KVCacheBlock, bool]]] = []
        self.model_hash: dict[int, bytes] = {}  # block_id -> hash the model expects
        self.model_generation: dict[int, int] = {}  # block_id -> one more per time freed

    def _ref_counts(self) -> dict[int, int]:
        counts: dict[int, int] = {}
        for entry in self.held:
            for block, _ in entry:
                counts[block.block_id] = counts.get(block.block_id, 0) + 1
        return counts

    @rule(n=st.integers(1, 4))
    def allocate(self, n: int) -> None:
        free_before = free_ids(self.pool)
        if n > len(free_before):
            return
        ref_before = {b.block_id: b.ref_cnt for b in self.pool.blocks}
        blocks = self.pool.get_new_blocks(n)
        assert ids(blocks) == free_before[:n]
        evicted = []
        for block in blocks:
            assert not block.is_null and block.block_id != 0
            assert ref_before[block.block_id] == 0
            assert block.ref_cnt == 1
            if block.block_id in self.model_hash:
                evicted.append(BlockRemoved(block_hashes=[self.model_hash.pop(block.block_id)]))
        assert self.pool.take_events() == evicted
        self.held.append([(b, False) for b in blocks])

    @precondition(lambda self: self.held)
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        entry = self.held.pop(data.draw(st.integers(0, len(self.held) - 1)))
        ordered = [block for block, _ in reversed(entry)]
        remaining = self._ref_counts()
        newly_free = [b.block_id for b in ordered if remaining.get(b.block_id, 0) == 0]
        self.pool.free_blocks(ordered)
        for block_id in newly_free:
            self.model_generation[block_id] = self.model_generation.get(block_id, 0) + 1
        if newly_free:
            assert free_ids(self.pool)[-len(newly_free) :] == newly_free

    @precondition(lambda self: self.held)
    @rule(data=st.data(), block_hash=st.sampled_from(HASHES))
    def cache(self, data: st.DataObject, block_hash: bytes) -> None:
        candidates = [b for entry in self.held for b, _ in entry if b.block_hash is None]
        if not candidates:
            return
        block = data.draw(st.sampled_from(candidates))
        req = Request("c", [1] * BLOCK_SIZE, SamplingParams())
        req.block_hashes = [block_hash]
        self.pool.cache_full_blocks(req, [block], 0, 1, BLOCK_SIZE)
        self.model_hash[block.block_id] = block_hash
        assert self.pool.take_events() == [
            BlockStored(
                block_hashes=[block_hash],
                parent_block_hash=None,
                token_ids=[1] * BLOCK_SIZE,
                block_size=BLOCK_SIZE,
            )
        ]

    @rule(block_hash=st.sampled_from(HASHES))
    def touch(self, block_hash: bytes) -> None:
        block = self.pool.get_cached_block(block_hash)
        expected_ids = {bid for bid, h in self.model_hash.items() if h == block_hash}
        if block is None:
            assert not expected_ids
            return
        assert block.block_id in expected_ids
        was_free = block.ref_cnt == 0
        num_free = self.pool.get_num_free_blocks()
        self.pool.touch([block])
        assert self.pool.get_num_free_blocks() == num_free - was_free
        self.held.append([(block, True)])

    @rule()
    def reset(self) -> None:
        ok = self.pool.reset_prefix_cache()
        assert ok == (not self.held)
        if ok:
            self.model_hash.clear()
            assert self.pool.take_events() == [AllBlocksCleared()]
            assert all(self.pool.get_cached_block(h) is None for h in HASHES)
        else:
            assert self.pool.take_events() == []

    @invariant()
    def pool_is_consistent(self) -> None:
        self.pool.check_integrity()

    @invariant()
    def free_plus_held_is_all_usable(self) -> None:
        distinct = {b.block_id for entry in self.held for b, _ in entry}
        assert 0 not in distinct
        assert self.pool.get_num_free_blocks() + len(distinct) == NUM_BLOCKS - 1

    @invariant()
    def sharing_only_through_touch(self) -> None:
        allocated: dict[int, int] = {}
        for entry in self.held:
            for block, by_touch in entry:
                if not by_touch:
                    allocated[block.block_id] = allocated.get(block.block_id, 0) + 1
        assert all(count == 1 for count in allocated.values())

    @invariant()
    def generations_move_only_when_freed(self) -> None:
        """What fencing relies on: a held block's generation does not move (so a lease that
        saw it sees it again), and each free moves it once. (Eviction in place, which moves
        it too, is test_block_pool.py's.)"""
        for block in self.pool.blocks:
            assert block.generation == self.model_generation.get(block.block_id, 0)

    @invariant()
    def ref_counts_and_hashes_match_model(self) -> None:
        counts = self._ref_counts()
        for block in self.pool.blocks[1:]:
            assert block.ref_cnt == counts.get(block.block_id, 0)
            assert block.block_hash == self.model_hash.get(block.block_id)


BlockPoolMachine.TestCase.settings = settings(
    max_examples=200, stateful_step_count=50, deadline=None
)
TestBlockPoolMachine = BlockPoolMachine.TestCase
