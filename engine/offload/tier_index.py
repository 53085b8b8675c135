"""The scheduler's side of a KV tier: which block hashes the tier holds, in which slots, in LRU
order, and the copies its worker is to make.

A tier is one medium (host memory, or a file), or host memory over a file (a third tier): each
level has its own LRU and slots, and what the upper one evicts moves down to the lower one
(a copy from slot to slot, in order with the others) instead of being dropped.

Stores are write-through at free: when a request lets go of its blocks (it finished, or was
preempted), each cached block the tier lacks is copied down, off the step's critical path (the
worker's thread copies while the next steps compute). The block is held (one more user) until
its copy is done, so it is neither reallocated nor rewritten meanwhile. A prompt whose prefix
runs on past the primary pool's hits into the tier loads those blocks back asynchronously,
waiting as a remote load waits (WAITING_FOR_REMOTE_KVS); a load that does not verify is
recomputed from the first bad block, never used.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from engine.core.block_pool import BlockPool
from engine.core.kv_cache_utils import BlockHash, KVCacheBlock
from engine.core.kv_events import BlockRemoved, BlockStored
from engine.core.sched_output import KVConnectorOutput
from engine.offload.copies import TierCopy, TierReport
from engine.offload.swap_costs import SwapCosts


@dataclass
class TierStats:
    """Counters since the engine began (blocks, unless named otherwise)."""

    stored: int = 0  # copied down (counted as decided)
    loaded: int = 0  # copied back and verified
    swapped_in: int = 0  # of those, a preempted request's own (swap instead of recompute)
    # Preemptions (requests, not blocks) by what their KV did: went down to the tier to come
    # back, or was dropped to be computed again (SwapCosts decides).
    swap_preemptions: int = 0
    recompute_preemptions: int = 0
    hit_tokens: int = 0  # prompt tokens found in the tier (past the primary pool's hits)
    lower_hit_tokens: int = 0  # of those, found in the level below host memory (disk)
    demoted: int = 0  # moved down a level for room (host memory to disk)
    evicted: int = 0  # dropped from the tier (its lowest level) for room
    failed: int = 0  # loads that did not verify (recomputed)
    lent: int = 0  # loaded back to be lent to another engine (a prefix loan)
    copy_us: int = 0  # the worker's time copying and summing
    bytes_copied: int = 0


@dataclass
class _Level:
    """One medium of the tier, its slots [first, first + num_slots) of the worker's."""

    name: str
    first: int
    num_slots: int
    lru: OrderedDict[BlockHash, int] = field(default_factory=OrderedDict)  # oldest first
    free: list[int] = field(default_factory=list)  # popped from the end

    def reset(self) -> None:
        self.lru.clear()
        self.free = list(range(self.first + self.num_slots - 1, self.first - 1, -1))


class TierIndex:
    def __init__(
        self,
        name: str,
        num_slots: int,
        block_size: int,
        pool: BlockPool,
        lower: tuple[str, int] | None = None,
    ) -> None:
        """`lower`: (name, slots) of a level below this one (a file under host memory)."""
        levels = [(name, num_slots), *([lower] if lower is not None else [])]
        if min(slots for _, slots in levels) < 1:
            raise ValueError(f"a KV tier needs at least one slot, got {levels}")
        self._levels: list[_Level] = []
        first = 0  # each level's slots follow the one above's
        for level_name, slots in levels:
            self._levels.append(_Level(level_name, first, slots))
            self._levels[-1].reset()
            first += slots
        self.name = "+".join(level.name for level in self._levels)
        self.num_slots = sum(level.num_slots for level in self._levels)
        self.block_size = block_size
        self._pool = pool
        self._slot_hash: list[BlockHash | None] = [None] * self.num_slots
        self._versions = [0] * self.num_slots
        self._copies: list[TierCopy] = []  # decided, not yet sent to the worker
        self._pending = 0  # sent, not yet reported done
        self._storing: deque[int] = deque()  # blocks held for their stores, in copy order
        self._loading: set[str] = set()
        self._unrecorded: list[BlockHash] = []  # stored by the offer under way (_record_stored)
        # What a loan's early settle heard of other loads: the next step's settle says it.
        self._settled_early: list[KVConnectorOutput] = []
        self.stats = TierStats()
        self.costs = SwapCosts()

    # ------------------------------------------------------------------ scheduler side

    def offer(self, blocks: Sequence[KVCacheBlock], hold: bool = True) -> None:
        """A request is about to let go of `blocks`: copy down each cached one the tier lacks,
        and refresh the others' place in the LRU. `hold`: keep each block (one more user)
        until its copy is done, while the steps go on; else (a preemption, which frees blocks
        because they are needed now) the copies are made before the next step runs."""
        top = self._levels[0]
        for block in blocks:
            block_hash = block.block_hash
            if block_hash is None or block.is_null:
                continue
            if block_hash in top.lru:
                top.lru.move_to_end(block_hash)
                continue
            for level in self._levels[1:]:  # used again: back to the top, from the pool's copy
                if (lower_slot := level.lru.get(block_hash)) is not None:
                    self._forget(level, lower_slot)
            slot = self._take_slot(0, block_hash)
            self._unrecorded.append(block_hash)
            self.stats.stored += 1
            if hold:
                self._pool.touch((block,))
                self._storing.append(block.block_id)
            self._copies.append(TierCopy(block.block_id, slot, self._versions[slot], held=hold))
        self._record_stored()

    def _record_stored(self) -> None:
        """The event of the stores decided since the last: routers count a hash held here
        while the pool or the tier holds it. Recorded before any eviction's, so that a hash
        stored and evicted within one offer is stored, then removed, in the events too."""
        if self._unrecorded:
            name = self._levels[0].name
            self._pool.record_event(BlockStored(self._unrecorded, None, [], self.block_size, name))
            self._unrecorded = []

    def preempt(self, blocks: Sequence[KVCacheBlock], num_computed_tokens: int) -> None:
        """A preempted request lets go of `blocks`: down to the tier (copied before the next
        step runs) where that costs less than computing its tokens again, else dropped."""
        cached = [b for b in blocks if b.block_hash is not None and not b.is_null]
        missing = sum(1 for b in cached if b.block_hash not in self._levels[0].lru)
        if cached and self.costs.swap_pays(missing, len(cached), num_computed_tokens):
            self.stats.swap_preemptions += 1
            self.offer(blocks, hold=False)
        else:
            self.stats.recompute_preemptions += 1

    def match(self, block_hashes: Sequence[BlockHash], first: int, max_blocks: int) -> list[int]:
        """The slots of the run of `block_hashes[first:]` the tier holds (at most
        `max_blocks`), each refreshed in the LRU."""
        slots: list[int] = []
        for block_hash in block_hashes[first : first + max(0, max_blocks)]:
            for level in self._levels:
                slot = level.lru.get(block_hash)
                if slot is not None:
                    level.lru.move_to_end(block_hash)
                    slots.append(slot)
                    break
            else:
                break
        return slots

    def load(
        self,
        request_id: str,
        slots: Sequence[int],
        block_ids: Sequence[int],
        block_hashes: Sequence[BlockHash],
        resumed: bool = False,
        loan: bool = False,
    ) -> None:
        """Copy `slots` (matched for `block_hashes`) into the request's `block_ids` (as many),
        asynchronously; `resumed`: the request was preempted, and this is its own KV coming
        back; `loan`: the blocks are to be lent (counted as `lent` by the caller, not as
        hits). A slot that no longer holds its hash (reused since the match: a pin giving
        way stored into it) is read at an impossible version: it fails the worker's check and
        is recomputed, never used."""
        last = len(slots) - 1
        for index, (slot, block_id) in enumerate(zip(slots, block_ids, strict=True)):
            same = self._slot_hash[slot] == block_hashes[index]
            version = self._versions[slot] if same else -1
            self._copies.append(TierCopy(block_id, slot, version, request_id, index == last))
        self._loading.add(request_id)
        if loan:
            return
        self.stats.hit_tokens += len(slots) * self.block_size
        below = sum(1 for slot in slots if slot >= self._levels[0].num_slots)
        self.stats.lower_hit_tokens += below * self.block_size
        if resumed:
            self.stats.swapped_in += len(slots)

    def is_loading(self, request_id: str) -> bool:
        return request_id in self._loading

    def take_copies(self) -> tuple[list[TierCopy], bool]:
        """This step's copies, for the worker, in the order they were decided, and whether
        they must be done before the step runs (unheld stores among them)."""
        copies, self._copies = self._copies, []
        self._pending += len(copies)
        return copies, not all(copy.held for copy in copies)

    @property
    def busy(self) -> bool:
        """Copies not yet done: the engine keeps stepping to hear of them (held blocks)."""
        return bool(self._copies) or self._pending > 0

    def clear(self) -> None:
        """Forget every entry (the prefix cache was reset); copies in flight still end."""
        for level in self._levels:
            level.reset()
        self._slot_hash = [None] * self.num_slots
        self._versions = [version + 1 for version in self._versions]

    # ------------------------------------------------------------------ the worker's report

    def settle(self, report: TierReport) -> KVConnectorOutput:
        """Let go of the blocks whose stores are done; drop entries that read bad. Returns
        the loads' outcome in the shape a remote load reports it (KVTransferState)."""
        self._pending -= report.num_done
        self.costs.note_copies(report.num_done, report.copy_us / 1e6)
        stats = self.stats
        stats.loaded += report.num_loaded
        stats.copy_us += report.copy_us
        stats.bytes_copied += report.bytes_copied
        if report.stored:
            for block_id in report.stored:  # they end in the order they were offered
                if self._storing.popleft() != block_id:
                    raise AssertionError("the KV tier's stores ended out of order")
            blocks = self._pool.blocks
            self._pool.free_blocks(blocks[block_id] for block_id in report.stored)
        for slot, version in report.bad_slots:
            self._drop(slot, version)
        stats.failed += len(report.invalid_block_ids)
        self._loading -= report.loaded
        problems = dict.fromkeys(report.loaded, "checksum") if report.invalid_block_ids else {}
        output = KVConnectorOutput(
            finished_recving=report.loaded,
            invalid_block_ids=report.invalid_block_ids,
            load_problems=problems,
        )
        for early in self._settled_early:
            output.finished_recving |= early.finished_recving
            output.invalid_block_ids |= early.invalid_block_ids
            output.load_problems.update(early.load_problems)
        self._settled_early = []
        return output

    def settle_loan(self, report: TierReport, loan_id: str, block_ids: Sequence[int]) -> set[int]:
        """settle() between steps, for a loan whose loads are in `report`: returns the loan's
        blocks that did not verify, and keeps what it heard of requests' loads for the next
        step's settle (tier_loans.py)."""
        output = self.settle(report)
        output.finished_recving.discard(loan_id)
        output.load_problems.pop(loan_id, None)
        bad = output.invalid_block_ids & set(block_ids)
        output.invalid_block_ids -= bad
        self._settled_early.append(output)
        return bad

    def block_hashes(self) -> list[BlockHash]:
        """Every hash the tier holds, one per slot (an engine's snapshot for the cluster's
        index)."""
        return [block_hash for level in self._levels for block_hash in level.lru]

    def storing_block_ids(self) -> list[int]:
        """Blocks held until their stores are done (one entry per hold)."""
        return list(self._storing)

    @property
    def num_used_slots(self) -> int:
        return sum(len(level.lru) for level in self._levels)

    def usage(self) -> list[tuple[str, int, int]]:
        """(name, slots, used) of each level, the top first (the step trace's)."""
        return [(level.name, level.num_slots, len(level.lru)) for level in self._levels]

    def holds(self, block_hash: BlockHash) -> bool:
        return any(block_hash in level.lru for level in self._levels)

    def _take_slot(self, depth: int, block_hash: BlockHash) -> int:
        """A slot of level `depth` for `block_hash`: a free one, or the least recently used
        entry's, which moves down a level (or, from the lowest, goes). A copy deciding
        earlier still reading the slot runs first: the worker keeps the copies' order."""
        level = self._levels[depth]
        if level.free:
            slot = level.free.pop()
        else:
            self._record_stored()  # this offer's stores so far come before what it evicts
            old_hash, slot = level.lru.popitem(last=False)
            self._slot_hash[slot] = None
            if depth + 1 < len(self._levels):
                self._demote(depth + 1, old_hash, slot)
            else:
                self.stats.evicted += 1
            self._pool.record_event(BlockRemoved([old_hash], level.name))
        self._versions[slot] += 1
        self._slot_hash[slot] = block_hash
        level.lru[block_hash] = slot
        return slot

    def _demote(self, depth: int, block_hash: BlockHash, from_slot: int) -> None:
        """Move `block_hash` from `from_slot` (about to be reused) down to level `depth`."""
        from_version = self._versions[from_slot]
        slot = self._take_slot(depth, block_hash)
        self._copies.append(
            TierCopy(-1, slot, self._versions[slot], from_slot=from_slot, from_version=from_version)
        )
        self.stats.demoted += 1
        name = self._levels[depth].name
        self._pool.record_event(BlockStored([block_hash], None, [], self.block_size, name))

    def _level_of(self, slot: int) -> _Level:
        return next(level for level in self._levels if slot < level.first + level.num_slots)

    def _drop(self, slot: int, version: int) -> None:
        if self._slot_hash[slot] is None or self._versions[slot] != version:
            return  # reused since: what it holds now was written after the bad read
        self._forget(self._level_of(slot), slot)

    def _forget(self, level: _Level, slot: int) -> None:
        """Free `slot` of `level` and its entry (a bad read, or a block back at the top)."""
        block_hash = self._slot_hash[slot]
        assert block_hash is not None
        del level.lru[block_hash]
        self._slot_hash[slot] = None
        self._versions[slot] += 1
        level.free.append(slot)
        self._pool.record_event(BlockRemoved([block_hash], level.name))
