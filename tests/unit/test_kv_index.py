"""The cluster KV index over numbered event batches: matching, gaps, restarts, snapshots."""

from __future__ import annotations

from deployments.kv_index import PrefixIndex
from engine.core.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    KVSnapshot,
)


def stored(*hashes: bytes) -> BlockStored:
    return BlockStored(
        block_hashes=list(hashes), parent_block_hash=None, token_ids=[], block_size=4
    )


def batch(seq: int, *events, epoch: str = "e1") -> KVEventBatch:
    return KVEventBatch(epoch, seq, tuple(events))


def test_a_prompt_matches_the_leading_run_of_its_blocks_each_replica_holds():
    index = PrefixIndex()
    assert index.apply("a", batch(0, stored(b"1", b"2", b"3")))
    assert index.apply("b", batch(0, stored(b"1"), stored(b"9")))
    assert index.match([b"1", b"2", b"3", b"4"]) == {"a": 3, "b": 1}
    # A hole stops the run: the engine's lookup stops at the first block it lacks.
    assert index.apply("a", batch(1, BlockRemoved([b"2"])))
    assert index.match([b"1", b"2", b"3"]) == {"a": 1, "b": 1}
    assert index.apply("b", batch(1, AllBlocksCleared(), stored(b"1", b"2")))
    assert index.match([b"1", b"2", b"3"]) == {"a": 1, "b": 2}


def test_a_hash_two_blocks_hold_stays_until_both_are_removed():
    index = PrefixIndex()
    index.apply("a", batch(0, stored(b"1"), stored(b"1")))
    index.apply("a", batch(1, BlockRemoved([b"1"])))
    assert index.match([b"1"]) == {"a": 1}
    index.apply("a", batch(2, BlockRemoved([b"1"])))
    assert index.match([b"1"]) == {"a": 0}


def test_lost_events_make_a_replica_stale_until_a_snapshot():
    index = PrefixIndex()
    index.apply("a", batch(0, stored(b"1", b"2")))
    # Batch 1 was lost: what follows cannot be trusted.
    assert not index.apply("a", batch(2, stored(b"3")))
    assert not index.is_current("a") and index.match([b"1"]) == {"a": 0}
    assert not index.apply("a", batch(3, stored(b"4")))  # still stale
    index.load_snapshot("a", KVSnapshot("e1", 4, (b"1", b"2", b"3", b"4")))
    assert index.is_current("a")
    # Late batches the snapshot covers are ignored; the next one applies.
    assert index.apply("a", batch(2, stored(b"3")))
    assert index.apply("a", batch(4, BlockRemoved([b"4"])))
    assert index.match([b"1", b"2", b"3", b"4"]) == {"a": 3}


def test_a_restarted_replica_starts_over():
    index = PrefixIndex()
    index.apply("a", batch(0, stored(b"1", b"2")))
    # The same replica id, a new engine: its first batch replaces everything.
    assert index.apply("a", batch(0, stored(b"7"), epoch="e2"))
    assert index.match([b"1"]) == {"a": 0} and index.match([b"7"]) == {"a": 1}
    # A new epoch seen mid-way (its first batches lost): stale until a snapshot.
    assert not index.apply("a", batch(5, stored(b"8"), epoch="e3"))
    assert index.match([b"7"]) == {"a": 0}
    index.load_snapshot("a", KVSnapshot("e3", 6, (b"8",)))
    assert index.match([b"8"]) == {"a": 1}


def test_replicas_that_stopped_running_are_forgotten():
    index = PrefixIndex()
    for replica in ("a", "b", "c"):
        index.apply(replica, batch(0, stored(b"1")))
    index.retain(["a", "c"])
    assert sorted(index.replicas) == ["a", "c"]
    index.forget("c")
    assert index.match([b"1"]) == {"a": 1}


def test_ranking_puts_the_replicas_holding_most_first_and_stays_out_of_ties():
    from deployments.kv_index import rank_by_cache

    candidates = ["a", "b", "c"]
    assert rank_by_cache(candidates, {"a": 2, "b": 5, "c": 5}) == [["b", "c"], ["a"]]
    assert rank_by_cache(candidates, {"a": 1}) == [["a"], ["b", "c"]]
    # Nothing cached, or everyone holding the same (a shared system prompt): load decides.
    assert rank_by_cache(candidates, {}) is None
    assert rank_by_cache(candidates, {"a": 3, "b": 3, "c": 3}) is None
    # Replicas the index knows but Serve does not offer are not candidates.
    assert rank_by_cache(["a", "b"], {"a": 1, "z": 9}) == [["a"], ["b"]]
