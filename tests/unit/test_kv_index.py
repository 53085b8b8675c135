"""The cluster KV index over numbered event batches: matching, gaps, restarts, snapshots."""

from __future__ import annotations

import pytest

from deployments.cluster.prefix_index import PrefixIndex
from engine.core.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EngineLoad,
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
    index.forget("b")
    assert sorted(index.replicas) == ["a", "c"]
    index.forget("c")
    assert index.match([b"1"]) == {"a": 1}


def test_the_index_actor_answers_per_role_with_each_replica_s_load():
    from deployments.cluster.kv_index import KVIndexServer
    from deployments.cluster.kv_scoring import Holding

    server = KVIndexServer()
    busy = EngineLoad(num_running=3, num_waiting=1, queued_prompt_tokens=200, kv_cache_usage=0.5)
    # A replica the index has not heard announce itself (with its role) must send a snapshot:
    # after an index restart, an idle replica's heartbeat is how it learns of it.
    assert not server.apply("p1", [batch(0, stored(b"1"))], busy)
    server.load_snapshot("p1", KVSnapshot("e1", 1, (b"1", b"2")), "prefill", busy, "h:1")
    server.load_snapshot("d1", KVSnapshot("e1", 0, (b"1",)), "decode", None, "h:2")
    assert server.apply("d1", [batch(0, stored(b"2"))], None)
    assert server.lookup([b"1", b"2"], "prefill") == {"p1": Holding(2, busy, "prefill", "h:1")}
    assert server.lookup([b"1", b"2"], "decode") == {"d1": Holding(2, None, "decode", "h:2")}
    assert set(server.lookup([b"1"])) == {"p1", "d1"}
    # A replica holding none of the prompt is there too, at 0, with its latest load.
    idle = EngineLoad(num_running=0, num_waiting=0, queued_prompt_tokens=0, kv_cache_usage=0.0)
    assert server.apply("d1", [], idle)
    assert server.lookup([b"9"], "decode") == {"d1": Holding(0, idle, "decode", "h:2")}
    assert server.lookup([b"9"]) == {
        "p1": Holding(0, busy, "prefill", "h:1"),
        "d1": Holding(0, idle, "decode", "h:2"),
    }
    server.forget(["p1"])
    assert server.lookup([b"1"], "prefill") == {}
    assert set(server.lookup([b"9"])) == {"d1"}
    assert not server.apply("p1", [], busy)  # forgotten: announce again


def test_each_role_s_answer_follows_its_replicas_as_they_switch_and_announce():
    """The index makes each role's view at the change (not per lookup): a role looked up
    before it has a replica, a switch out of one role into another, and a replica announcing
    no role at all are each seen by the next lookup of every role they touch."""
    from deployments.cluster.kv_index import KVIndexServer

    index = KVIndexServer()
    assert dict(index.lookup([b"1"], "prefill")) == {}  # no prefill replica yet
    index.load_snapshot("x", KVSnapshot("e", 0, (b"1",)), "decode", load(1))
    index.load_snapshot("p", KVSnapshot("e", 0, ()), "prefill", load(0))
    assert set(index.lookup([b"1"], "prefill")) == {"p"}
    assert set(index.lookup([b"1"], "decode")) == {"x"}
    index.load_snapshot("x", KVSnapshot("e", 1, (b"1",)), "prefill", load(2))  # a switch
    decode = index.lookup([b"1"], "decode")
    assert dict(decode) == {} and decode.known == 0 and len(decode.board) == 0
    prefill = index.lookup([b"1"], "prefill")
    assert set(prefill) == {"x", "p"} and {n for _, n, _ in prefill.board} == {"x", "p"}
    assert prefill["x"].cached_blocks == 1
    assert index.lookup([b"1"]).roles["decode"][0] == 0
    index.load_snapshot("n", KVSnapshot("e", 0, (b"1",)))  # no role (and no order pending)
    assert index.lookup([b"1"])["n"].cached_blocks == 1
    assert "n" not in index.lookup([b"1"], "prefill")


def load(running: int = 0, queued: int = 0, usage: float = 0.1) -> EngineLoad:
    return EngineLoad(
        num_running=running, num_waiting=0, queued_prompt_tokens=queued, kv_cache_usage=usage
    )


def test_cost_ranking_weighs_cached_blocks_against_queued_work():
    from deployments.cluster.kv_scoring import Holding, rank_by_cost

    idle = {"a": Holding(4, load()), "b": Holding(0, load()), "c": Holding(1, load())}
    # 100-token prompt, 16-token blocks: a computes 36, c 84, b 100.
    assert rank_by_cost(["a", "b", "c"], idle, 100, 16, {}) == [["a"], ["c"], ["b"]]
    # The holder's queue outweighs what its cache saves (64 tokens): recompute elsewhere.
    queued = {**idle, "a": Holding(4, load(queued=80))}
    assert rank_by_cost(["a", "b", "c"], queued, 100, 16, {}) == [["c"], ["b"], ["a"]]
    # Ongoing requests count too, the router's own count or the engine's, whichever is more.
    assert rank_by_cost(["a", "b"], idle, 100, 16, {"a": 3})[0] == ["b"]
    running = {**idle, "a": Holding(4, load(running=3))}
    assert rank_by_cost(["a", "b"], running, 100, 16, {})[0] == ["b"]
    # A replica about to run out of KV blocks would evict what made it attractive.
    hot = {**idle, "a": Holding(4, load(usage=0.95))}
    assert rank_by_cost(["a", "b"], hot, 100, 16, {})[0] == ["b"]


def test_a_prefix_loan_counts_as_cached_on_every_candidate():
    """A prefill leg bringing a loan reads those blocks wherever it goes: only what a replica
    holds beyond the loan, and its load, tell the candidates apart."""
    from deployments.cluster.kv_scoring import Holding, rank_by_cost

    holdings = {"b": Holding(0, load()), "c": Holding(8, load(running=2))}
    # 160 tokens: c computes 32 (+64 for its two requests), b all 160.
    assert rank_by_cost(["b", "c"], holdings, 160, 16, {}) == [["c"], ["b"]]
    # A 6-block loan: b computes 64, c still 32 + 64.
    assert rank_by_cost(["b", "c"], holdings, 160, 16, {}, lent_blocks=6) == [["b"], ["c"]]
    # A loan of all c holds: the cache tells them apart by nothing (load decides).
    assert rank_by_cost(["b", "c"], holdings, 160, 16, {}, lent_blocks=8) is None


def test_the_index_tells_blocks_held_in_a_tier_only_from_the_pool_s():
    """A tier's blocks (medium "cpu") count in the match, and are counted apart where the
    pool does not hold them too: through events, a snapshot and a restart alike."""
    index = PrefixIndex()
    tier_stored = BlockStored([b"1", b"2", b"3"], None, [], 4, "cpu")
    index.apply("a", batch(0, stored(b"1", b"2", b"3"), tier_stored))
    hashes = [b"1", b"2", b"3"]
    assert index.match(hashes) == {"a": 3} and index.tier_only_blocks("a", hashes) == 0
    index.apply("a", batch(1, BlockRemoved([b"2", b"3"])))  # evicted from the pool
    assert index.match(hashes) == {"a": 3} and index.tier_only_blocks("a", hashes) == 2
    index.apply("a", batch(2, stored(b"2")))  # loaded back
    assert index.tier_only_blocks("a", hashes) == 1
    index.apply("a", batch(3, BlockRemoved([b"3"], "cpu")))  # gone from the tier too
    assert index.match(hashes) == {"a": 2} and index.tier_only_blocks("a", hashes) == 0
    index.load_snapshot("b", KVSnapshot("e2", 0, (b"1", b"2", b"2"), tier_block_hashes=(b"2",)))
    assert index.match(hashes) == {"a": 2, "b": 2}
    assert index.tier_only_blocks("b", hashes) == 0  # the pool holds "2" as well
    index.load_snapshot("b", KVSnapshot("e2", 1, (b"1", b"2"), tier_block_hashes=(b"2",)))
    assert index.tier_only_blocks("b", hashes) == 1
    index.forget("b")
    assert index._tier_only == {}  # nothing left behind


def test_cost_ranking_credits_a_tier_s_blocks_below_the_pool_s():
    from deployments.cluster.kv_scoring import Holding, rank_by_cost

    # 100-token prompt, 16-token blocks, 4 blocks held by each: a in its pool, b in a tier.
    holdings = {"a": Holding(4, load()), "b": Holding(4, load(), tier_blocks=4)}
    assert rank_by_cost(["a", "b", "c"], holdings, 100, 16, {}) == [["a"], ["b"], ["c"]]
    # A tier's blocks still beat computing the prompt, until the holder's queue outweighs them.
    tier_only = {"b": Holding(4, load(), tier_blocks=4), "c": Holding(0, load())}
    assert rank_by_cost(["b", "c"], tier_only, 100, 16, {}) == [["b"], ["c"]]
    tier_only["b"] = Holding(4, load(queued=60), tier_blocks=4)
    assert rank_by_cost(["b", "c"], tier_only, 100, 16, {}) == [["c"], ["b"]]


def test_cost_ranking_leaves_the_choice_to_load_where_the_cache_tells_nothing():
    from deployments.cluster.kv_scoring import Holding, rank_by_cost

    assert rank_by_cost(["a", "b"], {}, 100, 16, {}) is None
    nothing = {"a": Holding(0, load()), "b": Holding(0, load(queued=500))}
    assert rank_by_cost(["a", "b"], nothing, 100, 16, {}) is None
    # Every candidate holds the same shared system prompt.
    shared = {"a": Holding(2, load()), "b": Holding(2, load())}
    assert rank_by_cost(["a", "b"], shared, 100, 16, {}) is None
    # Replicas the index knows but Serve does not offer are no candidates; candidates the
    # index has not heard of hold nothing (and are ranked, not dropped).
    partial = {"a": Holding(1, None), "z": Holding(9, None)}
    assert rank_by_cost(["a", "b"], partial, 100, 16, {}) == [["a"], ["b"]]


def test_the_cheapest_holder_and_how_much_of_the_prompt_it_holds():
    from deployments.cluster.kv_scoring import Holding, cheapest

    assert cheapest({}, 100, 16) is None
    assert cheapest({"a": Holding(0, load())}, 100, 16) is None
    holdings = {"a": Holding(3, load()), "b": Holding(5, load(queued=200))}
    assert cheapest(holdings, 100, 16) == ("a", 48)
    # A prompt all in cached blocks: never more tokens than the prompt has.
    assert cheapest({"a": Holding(7, None)}, 100, 16) == ("a", 100)


def test_a_survey_names_the_decode_holder_and_a_lender_worth_borrowing_from():
    from deployments.cluster.kv_scoring import Holding, Lender, lender_worth_borrowing, survey

    holdings = {
        "p1": Holding(2, load(), "prefill", "h:1"),
        "d1": Holding(6, load(), "decode", "h:2"),
        "d2": Holding(1, load(), "decode", "h:3"),
    }
    found = survey(holdings, [], 100, 16)
    assert found.decode_holder == ("d1", 96)
    assert found.lender == Lender("d1", "h:2", 96)
    assert found.borrower == ("p1", 32)  # the one prefill replica, holding 2 blocks itself
    assert lender_worth_borrowing(found, 64) == found.lender  # spares it 64 tokens
    assert lender_worth_borrowing(found, 65) is None
    # A replica that cannot lend (no side channel) is no lender: the most of the rest is the
    # prefill replica itself, which needs no loan from itself.
    no_channel = {**holdings, "d1": Holding(6, load(), "decode", "")}
    found = survey(no_channel, [], 100, 16)
    assert found.lender == Lender("p1", "h:1", 32) and found.borrower == ("p1", 32)
    assert lender_worth_borrowing(found, 16) is None
    # A loan lends the tier's blocks too (loaded back first): they count.
    in_tier = {**holdings, "d1": Holding(6, load(), "decode", "h:2", tier_blocks=4)}
    assert survey(in_tier, [], 100, 16).lender == Lender("d1", "h:2", 96)
    # A prefill replica lends too: the load sends the leg to the idle one, which borrows
    # what the busy one holds instead of computing it.
    busy = {
        "p1": Holding(6, load(running=8, queued=400), "prefill", "h:1"),
        "p2": Holding(0, load(), "prefill", "h:2"),
    }
    found = survey(busy, [], 100, 16)
    assert found.lender == Lender("p1", "h:1", 96) and found.borrower == ("p2", 0)
    assert lender_worth_borrowing(found, 64) == found.lender
    assert found.decode_holder is None


def holder_table(storage: str):
    """The C holder table (built here) or its Python twin."""
    from deployments.cluster.holders import DictHolders
    from deployments.cluster.native import load

    return load("holder_table").HolderTable() if storage == "c" else DictHolders()


@pytest.mark.parametrize("storage", ["c", "python"])
def test_matching_by_holders_equals_a_walk_of_each_replicas_blocks(storage: str):
    """Random stores, removals, clears, gaps, snapshots and forgets over 6 replicas and
    80-block chains: every match equals each replica's own walk of the prompt over its
    blocks (the index before holders per hash), and the holders index nothing else."""
    import random
    from collections import Counter

    rng = random.Random(7)
    index = PrefixIndex(holder_table(storage))
    truth: dict[str, Counter[bytes]] = {}  # current replicas' blocks
    seqs: dict[str, int] = {}
    chains = [[bytes([c, i]) for i in range(80)] for c in range(4)]
    for turn in range(3000):
        replica = f"r{rng.randrange(6)}"
        action = rng.random()
        seq = seqs.get(replica, 0)
        if action < 0.02:  # forgotten (stopped running)
            index.forget(replica)
            truth.pop(replica, None)
            seqs.pop(replica, None)
            continue
        if action < 0.05:  # a snapshot of what it holds (or held)
            held = truth.get(replica, Counter())
            index.load_snapshot(replica, KVSnapshot("e", seq, tuple(held.elements())))
            truth[replica] = Counter(held)
            continue
        if action < 0.07 and replica in truth:  # a lost batch: stale until a snapshot
            assert not index.apply(replica, batch(seq + 1, stored(b"x")))
            truth[replica] = Counter()  # matches nothing now
            seqs[replica] = seq
            continue
        chain = rng.choice(chains)
        cut = rng.randrange(1, len(chain) + 1)
        if action < 0.6:
            event = stored(*chain[:cut])
        elif action < 0.97:
            event = BlockRemoved(chain[rng.randrange(cut) : cut])
        else:
            event = AllBlocksCleared()
        if index.apply(replica, batch(seq, event, epoch="e")):
            blocks = truth.setdefault(replica, Counter())
            if isinstance(event, BlockStored):
                blocks.update(event.block_hashes)
            elif isinstance(event, BlockRemoved):
                blocks.subtract(h for h in event.block_hashes if blocks[h] > 0)
                blocks += Counter()  # drop what reached 0
            else:
                blocks.clear()
            seqs[replica] = seq + 1
        prompt = rng.choice(chains)[: rng.randrange(1, 81)]
        expected = {}
        for name in index.replicas:
            held = truth.get(name, Counter()) if index.is_current(name) else Counter()
            run = 0
            while run < len(prompt) and held[prompt[run]] > 0:
                run += 1
            expected[name] = run
        assert index.match(prompt) == expected, turn
    current = [truth.get(r, Counter()) for r in index.replicas if index.is_current(r)]
    assert index.num_entries() == sum(len(+c) for c in current)


def test_bench_index_measures_lookups_and_size():
    from pdserve.bench.index import IndexBenchConfig, run

    report = run(IndexBenchConfig(replicas=8, chains=4, chain_blocks=50, lookups=20))
    assert report["entries"] > 0 and report["bytes_per_entry"] > 0
    assert report["match_us"]["p50"] > 0
