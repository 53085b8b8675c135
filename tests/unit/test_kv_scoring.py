"""The routing searches (kv_scoring) against an exhaustive evaluation of every replica.

The searches evaluate the members of small holder groups and walk the rest by load until no
later replica can cost less (`pdserve bench router-sim`: a few evaluations per decision at 128
replicas instead of all). Random clusters — big groups holding a shared prompt, replicas in a
tier, loans, nearly full pools, replicas the index does not know, the router's own counts of
requests in flight — check that they find what evaluating everyone finds, on plain mappings
and on the index's own answers (its holder groups and load board)."""

from __future__ import annotations

import pickle
import random

import pytest

from deployments.cluster.kv_index import KVIndexServer
from deployments.cluster.kv_scoring import (
    DEFAULT_WEIGHTS,
    NOTHING_HELD,
    SMALL_GROUP,
    Holding,
    Holdings,
    Lender,
    cheapest_held,
    decode_holder,
    lender_worth_borrowing,
    rank_by_cost,
    replica_cost,
    survey,
)
from engine.core.kv_events import EngineLoad, KVSnapshot

ROLES = ("prefill", "decode")


def random_load(rng: random.Random) -> EngineLoad | None:
    if rng.random() < 0.1:
        return None
    return EngineLoad(
        num_running=rng.choice([0, 0, 1, 2, 5]),
        num_waiting=rng.choice([0, 0, 1]),
        queued_prompt_tokens=rng.choice([0, 0, 16, 100, 333]),
        kv_cache_usage=rng.choice([0.1, 0.5, 0.95]),
    )


def random_cluster(rng: random.Random) -> dict[str, Holding]:
    """Replicas holding nothing, a shared prefix (a big group) or runs of their own."""
    shared = rng.randint(1, 6)
    holdings = {}
    for i in range(rng.randint(1, 30)):
        kind = rng.random()
        cached = 0 if kind < 0.4 else shared if kind < 0.8 else rng.randint(1, 12)
        tier = rng.randint(0, cached) if cached and rng.random() < 0.2 else 0
        role = rng.choice(ROLES)
        holdings[f"r{i}"] = Holding(cached, random_load(rng), role, f"h:{i}", tier)
    return holdings


def cost(holdings, replica, prompt, block_size, ongoing, lent) -> float:
    holding = holdings.get(replica, NOTHING_HELD)
    busy = ongoing.get(replica, 0)
    return replica_cost(prompt, block_size, holding, busy, DEFAULT_WEIGHTS, lent)


def check_cheapest(holdings, prompt, block_size, lent, role) -> None:
    eligible = [r for r, h in holdings.items() if role is None or h.role == role]
    found = cheapest_held(holdings, prompt, block_size, lent_blocks=lent, role=role)
    if not eligible:
        assert found is None
        return
    least = min(cost(holdings, r, prompt, block_size, {}, lent) for r in eligible)
    assert found is not None and found[0] in eligible
    assert cost(holdings, found[0], prompt, block_size, {}, lent) == least
    assert found[1] == min(prompt, holdings[found[0]].cached_blocks * block_size)


def check_ranks(holdings, candidates, prompt, block_size, ongoing, lent) -> None:
    ranks = rank_by_cost(candidates, holdings, prompt, block_size, ongoing, lent_blocks=lent)
    chosen = [holdings.get(c, NOTHING_HELD) for c in candidates]
    alike = len({(h.cached_blocks, h.tier_blocks) for h in chosen}) == 1
    if max(h.cached_blocks for h in chosen) <= lent or alike:
        assert ranks is None
        return
    assert ranks is not None
    assert sorted(r for rank in ranks for r in rank) == sorted(candidates)  # each once
    costs = {c: cost(holdings, c, prompt, block_size, ongoing, lent) for c in candidates}
    # Every rank but the last holds one cost, rising; the last costs no less than those.
    exact = [{costs[r] for r in rank} for rank in ranks[:-1]]
    assert all(len(rank) == 1 for rank in exact)
    levels = [rank.pop() for rank in exact]
    assert levels == sorted(set(levels))
    assert min(costs[r] for r in ranks[-1]) >= (levels[-1] if levels else -1)
    assert min(costs[r] for r in ranks[0]) == min(costs.values())


@pytest.mark.parametrize("seed", range(300))
def test_the_searches_find_what_evaluating_every_replica_finds(seed: int) -> None:
    rng = random.Random(seed)
    holdings = random_cluster(rng)
    prompt, block_size = rng.randint(1, 200), rng.choice([4, 16])
    lent = rng.choice([0, 0, 0, rng.randint(1, 12)])
    ongoing = {r: rng.randint(0, 6) for r in holdings if rng.random() < 0.3}
    candidates = [r for r in holdings if rng.random() < 0.7] + ["unknown"] * rng.randint(0, 1)
    index_answer = lookup_from_an_index(holdings, rng)
    assert dict(index_answer) == holdings
    for found in (holdings, index_answer):
        for role in (None, *ROLES):
            check_cheapest(found, prompt, block_size, lent, role)
        if candidates:
            check_ranks(found, candidates, prompt, block_size, ongoing, lent)


def lookup_from_an_index(holdings: dict[str, Holding], rng: random.Random) -> Holdings:
    """The index's answer for the same cluster: each replica's run of a 12-block prompt as a
    snapshot (tier blocks as in a tier), its role, side channel and load."""
    prompt = [bytes([i]) for i in range(12)]
    server = KVIndexServer()
    names = list(holdings)
    rng.shuffle(names)  # announcement order: the answer must not depend on it
    for replica in names:
        held = holdings[replica]
        run = prompt[: held.cached_blocks]
        tier = run[held.cached_blocks - held.tier_blocks :] if held.tier_blocks else ()
        pool = tuple(h for h in run if h not in tier)
        snapshot = KVSnapshot(replica, 0, (*pool, *tier), tier_block_hashes=tuple(tier))
        server.load_snapshot(replica, snapshot, held.role, held.load, held.side_channel)
    return server.lookup(prompt)


def test_the_index_answers_with_holder_groups_and_every_replica_by_load() -> None:
    """Holders grouped by what they hold (a big group as a mask, named least loaded first),
    every replica on the load board, through a load change and a forget; and the answer
    crosses Ray's actor boundary (pickle) whole."""
    server = KVIndexServer()
    prompt = [b"1", b"2", b"3"]
    loads = {f"d{i}": EngineLoad(i % 3, 0, 10 * i, 0.1) for i in range(8)}
    for i, (replica, load) in enumerate(loads.items()):
        held = prompt[: 1 if i < SMALL_GROUP + 2 else 3]
        server.load_snapshot(replica, KVSnapshot(replica, 0, tuple(held)), "decode", load)
    found = server.lookup(prompt)
    big, small = sorted(found.groups, key=lambda g: g.mask.bit_count(), reverse=True)
    assert big.members == () and big.cached_blocks == 1  # not named in the answer
    members = found.members(big)
    assert len(members) == SMALL_GROUP + 2 and {found[r].cached_blocks for r in members} == {1}
    assert sorted(small.members) == ["d6", "d7"]
    assert {found[r].cached_blocks for r in small.members} == {3}
    keys = [key for key, _, _ in found.board]
    assert keys == sorted(keys) and {r for _, r, _ in found.board} == set(loads)
    assert [found[r].load for r in members] == sorted(
        (found[r].load for r in members), key=load_order
    )
    assert dict(found) == {r: found[r] for r in loads}  # every replica, holder or not
    server.apply("d0", [], EngineLoad(9, 0, 900, 0.1))  # now the busiest
    server.forget(["d7"])
    found = server.lookup(prompt)
    assert found.board[-1][1] == "d0" and "d7" not in {r for _, r, _ in found.board}
    assert "d7" not in found and "d7" not in found.bits
    copy = pickle.loads(pickle.dumps(found))
    assert (copy, copy.groups, copy.board) == (found, found.groups, found.board)
    assert survey(copy, prompt, 48, 16).decode_holder == ("d6", 48)


def load_order(load: EngineLoad) -> float:
    return load.queued_prompt_tokens + DEFAULT_WEIGHTS.request_tokens * load.num_running


def test_equally_cheap_replicas_leave_serve_a_choice():
    """Idle replicas holding nothing cost alike: two of them share the first rank (Serve takes
    the one with the shorter queue, as its power of two choices does), the rest come last."""
    idle = EngineLoad(0, 0, 0, 0.1)
    holdings = {f"d{i}": Holding(0, idle, "decode") for i in range(8)}
    holdings["h"] = Holding(2, EngineLoad(9, 0, 0, 0.1), "decode")
    ranks = rank_by_cost(list(holdings), holdings, 100, 16, {})
    assert ranks is not None and len(ranks[0]) == 2 and len(ranks) == 2
    assert {*ranks[0], *ranks[1]} == set(holdings) and "h" in ranks[1]


def test_the_survey_searches_only_for_what_the_router_asks_for():
    """A prompt no decode replica holds all but `limit` tokens of needs no search for the
    cheapest decode holder, and a lender holding less than a loan's minimum none for a
    borrower (the searches run when first asked for: `CacheSurvey.__dict__` says which ran)."""
    idle = EngineLoad(0, 0, 0, 0.1)
    holdings = {
        "p1": Holding(2, idle, "prefill", "h:1"),
        "d1": Holding(3, idle, "decode", "h:2"),
        "d2": Holding(0, idle, "decode", "h:3"),
    }
    found = survey(holdings, [], 100, 16)  # d1 holds 48 of 100 tokens
    assert decode_holder(found, 100, 16) == "" and "decode_holder" not in found.__dict__
    assert decode_holder(found, 100, 52) == "d1" and found.__dict__["decode_holder"] == ("d1", 48)
    assert lender_worth_borrowing(found, 49) is None and "borrower" not in found.__dict__
    assert lender_worth_borrowing(found, 16) == found.lender == Lender("d1", "h:2", 48)
    assert found.__dict__["borrower"] == ("p1", 32)


def test_of_equal_holders_the_least_loaded_lends():
    busy, idle = EngineLoad(4, 0, 100, 0.1), EngineLoad(0, 0, 0, 0.1)
    small = {"a": Holding(3, busy, "decode", "h:a"), "b": Holding(3, idle, "decode", "h:b")}
    assert survey(small, [], 100, 16).lender == Lender("b", "h:b", 48)
    # A big group (walked by load, not named): the least loaded member with a side channel.
    big = {f"d{i}": Holding(3, EngineLoad(i, 0, 0, 0.1), "decode", f"h:{i}") for i in range(8)}
    big["d0"] = Holding(3, idle, "decode", "")  # the least loaded cannot lend
    assert survey(big, [], 100, 16).lender == Lender("d1", "h:1", 48)


def test_an_answer_outlives_changes_to_the_index():
    """A lookup's answer is the index as it was: a replica forgotten or a load changed later
    leaves it whole (the index hands out its tables and bits, and never changes them)."""
    server = KVIndexServer()
    prompt = [b"1", b"2"]
    for i in range(SMALL_GROUP + 2):
        snapshot = KVSnapshot(f"d{i}", 0, tuple(prompt))
        server.load_snapshot(f"d{i}", snapshot, "decode", EngineLoad(i, 0, 0, 0.1))
    before = server.lookup(prompt)
    assert before.groups[0].members == ()  # a big group
    server.forget(["d0"])
    server.apply("d1", [], EngineLoad(9, 0, 0, 0.1))
    assert before["d0"].cached_blocks == 2 and before["d1"].load == EngineLoad(1, 0, 0, 0.1)
    after = server.lookup(prompt)
    assert "d0" not in after and after["d1"].load == EngineLoad(9, 0, 0, 0.1)
    assert after.members(after.groups[0])[-1] == "d1"  # now the busiest


def test_a_loan_can_leave_holders_dearer_than_replicas_holding_nothing():
    """A loan of all a big group holds, in a tier only: the group pays the tier's copies on
    top of what the loan spares everyone, and costs more than a replica holding nothing
    (the searches must not stop at the group's term)."""
    idle = EngineLoad(0, 0, 0, 0.1)
    holdings = {f"g{i}": Holding(6, idle, "prefill", "", 6) for i in range(SMALL_GROUP + 1)}
    holdings["n"] = Holding(0, EngineLoad(0, 0, 5, 0.1), "prefill")
    holdings["d"] = Holding(7, EngineLoad(0, 0, 90, 0.1), "prefill")  # more than the loan
    for found in (holdings, lookup_from_an_index(holdings, random.Random(0))):
        # n: 4 tokens to compute + 5 queued; each g: 4 + 9.6 copied back from the tier.
        assert cheapest_held(found, 100, 16, lent_blocks=6, role="prefill") == ("n", 0)
        ranks = rank_by_cost(list(holdings), found, 100, 16, {}, lent_blocks=6)
        assert ranks is not None and ranks[0] == ["n"]
