"""The KV tier below the primary pool (engine/offload/): the scheduler's index (slots, LRU,
held blocks) and the worker's copies (host memory and a file), verified on the way back."""

from __future__ import annotations

import pytest
import torch

from deployments.cluster.prefix_index import PrefixIndex
from engine.core.block_pool import BlockPool
from engine.core.kv_events import BlockRemoved, BlockStored, KVEventBatch
from engine.offload.copies import TierCopy, TierReport
from engine.offload.stores import DiskStore, HostStore, StackedStore
from engine.offload.swap_costs import SwapCosts
from engine.offload.tier_index import TierIndex
from engine.offload.tier_worker import TierWorker
from tests.unit.sched_utils import cached_blocks
from tests.waiting import wait_until


def report_of(copies: list[TierCopy]) -> TierReport:
    """What a worker reports for `copies` when every one succeeds."""
    report = TierReport(num_done=len(copies))
    for copy in copies:
        if copy.load_of:
            report.num_loaded += 1
            if copy.last:
                report.loaded.add(copy.load_of)
        else:
            report.stored.append(copy.block_id)
    return report


def test_offered_blocks_are_stored_once_and_held_until_their_copy_is_done():
    pool = BlockPool(8, enable_caching=True)
    tier = TierIndex("cpu", 4, 16, pool)
    blocks = cached_blocks(pool, [b"a", b"b"])
    tier.offer(blocks)
    assert [b.ref_cnt for b in blocks] == [2, 2]  # the request's, and the store's
    copies = tier.take_copies()[0]
    assert [(c.block_id, c.load_of) for c in copies] == [(b.block_id, "") for b in blocks]
    assert tier.busy
    tier.offer(blocks)  # already in the tier: nothing copied twice
    assert tier.take_copies()[0] == []
    pool.free_blocks(blocks)  # the request lets go; the stores still hold them
    assert pool.get_num_free_blocks() == 5
    tier.settle(report_of(copies))
    assert pool.get_num_free_blocks() == 7 and not tier.busy
    assert tier.stats.stored == 2 and tier.storing_block_ids() == []
    pool.check_integrity()


def test_a_preempted_requests_blocks_are_not_held_but_copied_before_the_next_step():
    pool = BlockPool(8, enable_caching=True)
    tier = TierIndex("cpu", 4, 16, pool)
    blocks = cached_blocks(pool, [b"a", b"b"])
    tier.offer(blocks, hold=False)
    assert [b.ref_cnt for b in blocks] == [1, 1]  # free for the preemption's needs at once
    copies, first = tier.take_copies()
    assert first and not any(copy.held for copy in copies)
    assert tier.take_copies() == ([], False)
    tier.offer(cached_blocks(pool, [b"c"]))
    assert tier.take_copies()[1] is False  # held stores need not hold the step back


def test_the_least_recently_used_entry_makes_room_and_matches_stop_at_a_gap():
    pool = BlockPool(8, enable_caching=True)
    tier = TierIndex("cpu", 2, 16, pool)
    tier.offer(cached_blocks(pool, [b"a", b"b"]))
    assert tier.match([b"a"], 0, 1) == [0]  # "a" is now the most recent
    tier.offer(cached_blocks(pool, [b"c"]))
    assert tier.stats.evicted == 1
    assert not tier.holds(b"b") and tier.holds(b"a") and tier.holds(b"c")
    assert len(tier.match([b"a", b"c"], 0, 5)) == 2
    assert tier.match([b"a", b"b", b"c"], 0, 5) == tier.match([b"a"], 0, 5)
    assert tier.match([b"x", b"a"], 1, 1) == tier.match([b"a"], 0, 1)
    assert tier.match([b"a", b"c"], 0, 1) == tier.match([b"a"], 0, 1)  # at most max_blocks


def test_a_slot_reused_between_its_match_and_its_load_is_never_trusted():
    """Admission matches the tier, then a pin giving way may store into the matched slot
    before the load is decided: the load is then made at an impossible version, which the
    worker's check fails (the block is recomputed), never at the new occupant's."""
    pool = BlockPool(8, enable_caching=True)
    tier = TierIndex("cpu", 1, 16, pool)
    tier.offer(cached_blocks(pool, [b"a"]))
    [slot] = tier.match([b"a"], 0, 1)
    tier.offer(cached_blocks(pool, [b"b"]))  # "a" goes; its slot now holds "b"
    tier.take_copies()
    tier.load("r", [slot], [5], [b"a"])
    [read] = tier.take_copies()[0]
    assert (read.slot, read.version) == (slot, -1)  # not the version "b" was stored at


def test_an_offer_larger_than_the_tier_records_each_store_before_its_eviction():
    """A hash stored and evicted within one offer: stored, then removed, in the events (the
    cluster index would otherwise count it held in the tier)."""
    pool = BlockPool(8, enable_caching=True, enable_kv_cache_events=True)
    tier = TierIndex("cpu", 1, 16, pool)
    tier.offer(cached_blocks(pool, [b"a", b"b"]))
    assert pool.take_events() == [
        BlockStored([b"a"], None, [], 16, "cpu"),
        BlockRemoved([b"a"], "cpu"),
        BlockStored([b"b"], None, [], 16, "cpu"),
    ]


def test_a_bad_read_drops_the_entry_it_read_but_not_a_newer_one_in_its_slot():
    pool = BlockPool(8, enable_caching=True)
    tier = TierIndex("cpu", 1, 16, pool)
    tier.offer(cached_blocks(pool, [b"a"]))
    stored = tier.take_copies()[0]
    [slot] = tier.match([b"a"], 0, 1)
    tier.load("r1", [slot], [5], [b"a"])
    read = tier.take_copies()[0][0]
    tier.offer(cached_blocks(pool, [b"b"]))  # evicts "a": the slot now holds "b"
    tier.take_copies()[0]
    outcome = tier.settle(
        TierReport(
            num_done=2,
            stored=[stored[0].block_id],
            loaded={"r1"},
            invalid_block_ids={5},
            bad_slots=[(read.slot, read.version)],
        )
    )
    assert outcome.finished_recving == {"r1"} and outcome.invalid_block_ids == {5}
    assert outcome.load_problems == {"r1": "checksum"}
    assert tier.holds(b"b")  # written after the bad read: kept
    [slot] = tier.match([b"b"], 0, 1)
    tier.load("r2", [slot], [6], [b"b"])
    read = tier.take_copies()[0][0]
    tier.settle(TierReport(num_done=1, loaded={"r2"}, bad_slots=[(read.slot, read.version)]))
    assert not tier.holds(b"b") and tier.num_used_slots == 0


def test_what_host_memory_evicts_moves_down_to_the_disk_level_and_comes_back_up():
    """A third tier: host memory (1 slot) over a file (2 slots). Host memory's LRU entry
    moves down (a slot-to-slot copy decided before the store that reuses its slot); disk's
    goes; a hit on disk is found as one on host memory is; a block stored again from the
    pool goes back to the top and leaves its disk slot."""
    pool = BlockPool(8, enable_caching=True, enable_kv_cache_events=True)
    tier = TierIndex("cpu", 1, 16, pool, lower=("disk", 2))
    assert tier.name == "cpu+disk" and tier.num_slots == 3
    tier.offer(cached_blocks(pool, [b"a"]))
    pool.take_events()
    tier.offer(cached_blocks(pool, [b"b"]))
    moved, stored = tier.take_copies()[0][-2:]
    assert (moved.from_slot, moved.slot, moved.block_id) == (0, 1, -1)  # "a": cpu 0 -> disk 1
    assert (stored.slot, stored.from_slot) == (0, -1)  # then "b" into the slot "a" left
    assert pool.take_events() == [
        BlockStored([b"a"], None, [], 16, "disk"),
        BlockRemoved([b"a"], "cpu"),
        BlockStored([b"b"], None, [], 16, "cpu"),
    ]
    assert tier.match([b"a", b"b"], 0, 5) == [1, 0] and tier.stats.demoted == 1
    tier.load("r", [1], [5], [b"a"])
    assert tier.stats.lower_hit_tokens == 16
    tier.offer(cached_blocks(pool, [b"c"]))  # "b" down to disk slot 2
    tier.offer(cached_blocks(pool, [b"d"]))  # "c" down; disk is full: its oldest ("a") goes
    assert tier.stats.demoted == 3 and tier.stats.evicted == 1
    assert [h for h in (b"a", b"b", b"c", b"d") if tier.holds(h)] == [b"b", b"c", b"d"]
    assert tier.usage() == [("cpu", 1, 1), ("disk", 2, 2)]
    tier.take_copies()
    pool.take_events()
    tier.offer(cached_blocks(pool, [b"b"]))  # used again: back to the top
    assert tier.match([b"b"], 0, 1) == [0] and tier.usage() == [("cpu", 1, 1), ("disk", 2, 2)]
    assert BlockRemoved([b"b"], "disk") in pool.take_events()


def test_the_worker_carries_a_block_s_sum_down_a_level(tmp_path):
    """The move keeps the sum the block left the pool with: a load from disk is checked
    against it, and a bit flipped on disk is caught."""
    cache = torch.randn(6, 2, 2, 4, 2, 8)
    block_bytes = cache[0].nbytes
    store = StackedStore(HostStore(1, block_bytes), 1, DiskStore(2, block_bytes, tmp_path))
    worker = TierWorker(store, [cache], 3)
    try:
        original = cache[1].clone()
        worker.submit([TierCopy(1, 0, 1), TierCopy(-1, 1, 1, from_slot=0, from_version=1)])
        worker.submit([TierCopy(2, 0, 2)])  # slot 0 reused at once
        assert collect(worker, 3).stored == [1, 2]
        cache[1] = 0.0
        worker.submit([TierCopy(4, 1, 1, "r", True)])
        report = collect(worker, 1)
        assert report.num_loaded == 1 and torch.equal(cache[4], original)
        worker.corrupt_slot(1)
        worker.submit([TierCopy(4, 1, 1, "s", True)])
        assert collect(worker, 1).invalid_block_ids == {4}
        # A move of a slot whose store did not happen (another version): never trusted.
        worker.submit(
            [TierCopy(-1, 2, 1, from_slot=0, from_version=7), TierCopy(3, 2, 1, "t", True)]
        )
        assert collect(worker, 2).invalid_block_ids == {3}
    finally:
        worker.close()


@pytest.mark.parametrize("medium", ["cpu", "disk"])
def test_the_worker_brings_blocks_back_bit_for_bit_and_catches_corrupted_ones(medium, tmp_path):
    cache = torch.randn(6, 2, 2, 4, 2, 8)  # [blocks, layers, K/V, tokens, heads, dim]
    block_bytes = cache[0].nbytes
    store = HostStore(3, block_bytes) if medium == "cpu" else DiskStore(3, block_bytes, tmp_path)
    worker = TierWorker(store, [cache], 3)
    try:
        original = cache[1].clone(), cache[2].clone()
        worker.submit([TierCopy(1, 0, 1), TierCopy(2, 2, 1, held=False)], wait=True)
        report = worker.report()  # made before submit returned
        assert report.num_done == 2 and report.stored == [1]  # an unheld block: none to free
        cache[1:3] = 0.0  # their blocks reused in the pool
        worker.submit([TierCopy(4, 0, 1, "r", False), TierCopy(5, 2, 1, "r", True)])
        report = collect(worker, 2)
        assert report.loaded == {"r"} and report.num_loaded == 2
        assert report.invalid_block_ids == set()
        assert torch.equal(cache[4], original[0]) and torch.equal(cache[5], original[1])
        assert report.bytes_copied == 2 * block_bytes
        worker.corrupt_slot(2)  # one bit, at rest in the tier
        worker.submit([TierCopy(3, 0, 1, "s", False), TierCopy(4, 2, 1, "s", True)])
        report = collect(worker, 2)
        assert report.loaded == {"s"} and report.num_loaded == 1
        assert report.invalid_block_ids == {4} and report.bad_slots == [(2, 1)]
        worker.submit([TierCopy(0, 1, 1, "t", True)])  # a slot never stored: never trusted
        assert collect(worker, 1).invalid_block_ids == {0}
        # A load of the slot's earlier occupant (version 0) after it was rewritten (version 1):
        # bytes that are sound, but not the ones asked for.
        worker.submit([TierCopy(3, 0, 0, "u", True)])
        assert collect(worker, 1).invalid_block_ids == {3}
    finally:
        worker.close()


@pytest.mark.parametrize("medium", ["cpu", "disk", "cpu+disk"])
def test_a_slot_holds_a_block_of_every_ranks_cache_each_part_checked(medium, tmp_path):
    """Ranks with a cache each (here of 2 and 1 heads: the parts need not be alike): a slot
    holds a block of each, one after the other, moved down a level whole; a bit flipped in
    any part is caught."""
    caches = [torch.randn(6, 2, 2, 4, 2, 8), torch.randn(6, 2, 2, 4, 1, 8)]
    block_bytes = sum(c[0].nbytes for c in caches)
    stores = {
        "cpu": lambda: HostStore(3, block_bytes),
        "disk": lambda: DiskStore(3, block_bytes, tmp_path),
        "cpu+disk": lambda: StackedStore(
            HostStore(1, block_bytes), 1, DiskStore(2, block_bytes, tmp_path)
        ),
    }
    worker = TierWorker(stores[medium](), caches, 3)
    try:
        assert worker.slot_bytes == block_bytes
        original = [c[1].clone() for c in caches]
        moved = [TierCopy(-1, 1, 1, from_slot=0, from_version=1)] if medium == "cpu+disk" else []
        worker.submit([TierCopy(1, 0, 1), *moved], wait=True)
        assert worker.report().num_done == 1 + len(moved)
        slot = 1 if moved else 0
        for cache in caches:
            cache[1] = 0.0
        worker.submit([TierCopy(4, slot, 1, "r", True)])
        assert collect(worker, 1).num_loaded == 1
        assert all(torch.equal(c[4], o) for c, o in zip(caches, original, strict=True))
        for part, request in ((0, "s"), (1, "t")):
            worker.submit([TierCopy(1, 2, 2)], wait=True)  # a fresh slot of block 1's bytes
            assert worker.report().stored == [1]
            worker.corrupt_slot(2, part)
            worker.submit([TierCopy(5, 2, 2, request, True)])
            assert collect(worker, 1).invalid_block_ids == {5}, part
    finally:
        worker.close()


def collect(worker: TierWorker, num_copies: int) -> TierReport:
    """The worker's reports until `num_copies` copies are done, merged."""
    merged = TierReport()

    def done() -> bool:
        merged.add(worker.report())
        return merged.num_done >= num_copies

    assert wait_until(done, timeout_s=30)
    return merged


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ({"kv_offloading_size": -1}, "kv_offloading_size must be"),
        ({"kv_offloading_size": 1, "kv_offloading_backend": "ssd"}, "kv_offloading_backend"),
        ({"kv_offloading_size": 1, "kv_offloading_path": "/tmp"}, "kv_offloading_path is for"),
        ({"kv_offloading_size": 1, "enable_prefix_caching": False}, "enable_prefix_caching"),
        ({"kv_offloading_size": 1e-9}, "holds no KV block"),
        ({"kv_offloading_disk_size": 1}, "kv_offloading_disk_size is a disk tier below"),
        (
            {
                "kv_offloading_size": 1,
                "kv_offloading_backend": "disk",
                "kv_offloading_disk_size": 1,
            },
            "kv_offloading_disk_size is a disk tier below",
        ),
        ({"kv_offloading_size": 1, "kv_offloading_disk_size": 1e-9}, "holds no KV block"),
    ],
)
def test_tier_settings_the_engine_cannot_use_are_refused(args, message):
    from engine.llm import LLM

    with pytest.raises(ValueError, match=message):
        LLM("tiny", max_model_len=64, num_gpu_blocks_override=32, **args)


def test_swap_or_recompute_follows_the_measured_costs():
    costs = SwapCosts()
    assert costs.swap_pays(100, 100, 1)  # nothing measured yet: a copy is memory speed
    costs.note_copies(10, 0.010)  # 1 ms a block
    costs.note_step(4, 1.0)  # a decode step: says nothing of prefill speed
    assert costs.token_s is None
    costs.note_step(1000, 0.1)  # 0.1 ms a token
    assert not costs.swap_pays(10, 10, 100)  # 20 ms of copies against 10 ms of compute
    assert costs.swap_pays(10, 10, 1000)


def test_a_preemption_swaps_only_where_the_costs_say_so():
    pool = BlockPool(8, enable_caching=True)
    tier = TierIndex("cpu", 4, 16, pool)
    tier.costs.note_copies(1, 0.001)
    tier.costs.note_step(1000, 0.1)
    tier.preempt(cached_blocks(pool, [b"a", b"b"]), num_computed_tokens=32)  # 4 ms vs 3.2 ms
    assert tier.take_copies() == ([], False) and tier.stats.recompute_preemptions == 1
    tier.preempt(cached_blocks(pool, [b"c", b"d"]), num_computed_tokens=64)
    copies, first = tier.take_copies()
    assert len(copies) == 2 and first and tier.stats.swap_preemptions == 1


def test_the_tier_reports_what_it_holds_so_an_index_counts_it_held():
    pool = BlockPool(8, enable_caching=True, enable_kv_cache_events=True)
    tier = TierIndex("cpu", 1, 16, pool)
    tier.offer(cached_blocks(pool, [b"a"]))
    tier.offer(cached_blocks(pool, [b"b"]))  # one slot: "a" goes
    events = pool.take_events()
    assert events == [
        BlockStored([b"a"], None, [], 16, "cpu"),
        BlockRemoved([b"a"], "cpu"),
        BlockStored([b"b"], None, [], 16, "cpu"),
    ]
    index = PrefixIndex()
    index.apply("engine", KVEventBatch("epoch", 0, (BlockStored([b"b"], None, [], 16),)))
    index.apply("engine", KVEventBatch("epoch", 1, tuple(events)))
    assert index.tier_only_blocks("engine", [b"b"]) == 0  # the pool has it too
    index.apply("engine", KVEventBatch("epoch", 2, (BlockRemoved([b"b"]),)))  # the pool's
    assert index.match([b"b"]) == {"engine": 1}  # the tier still holds it
    assert index.tier_only_blocks("engine", [b"b"]) == 1  # routing credits it less
    assert index.match([b"a"]) == {"engine": 0}
    assert tier.block_hashes() == [b"b"]


def test_a_worker_whose_thread_failed_says_so_instead_of_hanging():
    cache = torch.zeros(2, 1, 2, 4, 1, 8)
    worker = TierWorker(HostStore(1, cache[0].nbytes), [cache], 1)

    def lost(copies: list[TierCopy]) -> None:
        raise RuntimeError("device lost")

    worker._copy = lost  # type: ignore[method-assign]
    with pytest.raises(RuntimeError, match="device lost"):
        worker.submit([TierCopy(1, 0, 1, held=False)], wait=True)
    with pytest.raises(RuntimeError, match="KV tier's worker failed"):
        worker.report()
    worker.close()
