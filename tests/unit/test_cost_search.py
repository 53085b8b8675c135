"""The routing searches in C (deployments/cluster/csrc/cost_search.c, built on first use)
against the Python reference (`_Search.reference`, `_ranks`, `_most_held_in_python` and
`cheapest_held`'s of kv_scoring.py), result for result, on random clusters past 64 and 128
replicas: small and big holder groups, tiers, loans, the router's requests in flight,
replicas the index does not know, either search (`one`), loads read by position (EngineLoad)
and by name (any other type); and the fallbacks (an input the C code does not take, no
compiler)."""

from __future__ import annotations

import random
import threading
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import NamedTuple

import pytest

from deployments.cluster import cost_search, kv_scoring
from deployments.cluster.kv_scoring import DEFAULT_WEIGHTS, Holding, Holdings, RoutingWeights
from engine.core.kv_events import EngineLoad
from tests.unit.test_kv_scoring import ROLES, check_ranks, lookup_from_an_index, random_load

NUMBERS = (100, 16, 0, 32.0, 0.9, 0.1)  # prompt, block size, loan, the weights


def big_cluster(rng: random.Random) -> dict[str, Holding]:
    """Up to 300 replicas: most hold nothing or one shared prefix (big groups), a few runs of
    their own (small groups; in some clusters none, so the shared prefix is the most held),
    some of it in a tier."""
    shared, own = rng.randint(1, 6), rng.choice([0.0, 0.1])
    holdings = {}
    for i in range(rng.choice([3, 40, 70, 140, 300])):
        kind = rng.random()
        cached = 0 if kind < 0.5 else shared if kind < 1 - own else rng.randint(1, 12)
        tier = rng.randint(0, cached) if cached and rng.random() < 0.1 else 0
        role = rng.choice(ROLES)
        channel = f"h:{i}" if rng.random() < 0.8 else ""  # ("": cannot lend)
        holdings[f"replica-{i}"] = Holding(cached, random_load(rng), role, channel, tier)
    return holdings


def native():  # type: ignore[no-untyped-def]
    c = cost_search.native()
    assert c is not None  # a compiler is here
    return c


def both(search: kv_scoring._Search, eligible: int, unheard: tuple[str, ...], one: bool) -> None:
    """The C search answers (not NotImplemented) as the reference does."""
    w = search.weights
    numbers = (search.prompt_tokens, search.block_size, search.lent_blocks)
    weights = (w.request_tokens, w.hot_kv_usage, w.tier_token_cost)
    args = (search.holdings, search.ongoing, eligible, unheard, one, *numbers, *weights)
    assert native().up_to_least(*args) == search.reference(eligible, unheard, one)


@pytest.mark.parametrize("seed", range(60))
def test_the_c_search_answers_as_the_python_one(seed: int) -> None:
    rng = random.Random(seed)
    holdings = big_cluster(rng)
    prompt, block_size = rng.randint(1, 200), rng.choice([4, 16])
    lent = rng.choice([0, 0, rng.randint(1, 12)])
    weights = rng.choice([DEFAULT_WEIGHTS, RoutingWeights(request_tokens=8.0)])
    ongoing = {r: rng.randint(0, 6) for r in holdings if rng.random() < 0.3}
    laid_out = Holdings.of(holdings, weights.request_tokens)
    for found in (laid_out, lookup_from_an_index(holdings, rng)):
        w = weights if found is laid_out else DEFAULT_WEIGHTS  # (the index's board's)
        search = kv_scoring._Search(found, prompt, block_size, w, lent, ongoing)
        unheard = tuple(f"unknown-{i}" for i in range(rng.choice([0, 0, 2])))
        for role in (None, *ROLES):
            both(search, found.role_mask(role), unheard, one=False)
            both(search, found.role_mask(role), (), one=True)
            alone = kv_scoring._Search(found, prompt, block_size, w, lent)  # (engines' loads)
            costs, _ = alone.reference(found.role_mask(role), one=True)
            cheapest = min((cost, r) for r, cost in costs.items())[1] if costs else None
            numbers = (prompt, block_size, lent)
            assert cost_search.cheapest(found, found.role_mask(role), numbers, w) == cheapest
        lender = native().most_held(found, found.request_tokens)
        assert lender == kv_scoring._most_held_in_python(found)
        some = sum(bit for bit in found.bits.values() if rng.random() < 0.5)
        both(search, some & found.known, unheard, one=False)
        candidates = [r for r in holdings if rng.random() < 0.7] + list(unheard)
        candidates += rng.sample(candidates, min(2, len(candidates)))  # (twice: once each)
        rng.shuffle(candidates)
        ranks = kv_scoring.rank_by_cost(candidates, found, prompt, block_size, ongoing, w, lent)
        args = (prompt, block_size, ongoing, w, lent)
        assert ranks == kv_scoring._ranks(found, candidates, *args)
        once = list(dict.fromkeys(candidates))
        if once:
            check_ranks(found, once, prompt, block_size, ongoing, lent)


@dataclass(frozen=True)
class NamedLoad:
    """A load that is not a tuple: the C search reads it by name."""

    num_running: int
    num_waiting: int
    queued_prompt_tokens: int
    kv_cache_usage: float


class ReorderedLoad(NamedTuple):
    """A tuple of other fields first: read by name too (only EngineLoad by position)."""

    kv_cache_usage: float
    queued_prompt_tokens: int
    num_waiting: int
    num_running: int


def test_the_c_search_reads_an_engine_load_by_position() -> None:
    native()
    assert EngineLoad._fields[:4] == cost_search.LOAD_FIELDS  # (its order, as C reads it)


@pytest.mark.parametrize("kind", [NamedLoad, ReorderedLoad])
@pytest.mark.parametrize("seed", range(4))
def test_loads_of_other_types_are_read_by_name(seed: int, kind: type) -> None:
    rng = random.Random(seed)
    holdings = {}
    for r, h in big_cluster(rng).items():
        load = h.load
        if load is not None:
            load = kind(**{f: getattr(load, f) for f in cost_search.LOAD_FIELDS})
        holdings[r] = h._replace(load=load)
    assert any(isinstance(h.load, kind) for h in holdings.values())
    found = Holdings.of(holdings, DEFAULT_WEIGHTS.request_tokens)
    ongoing = {r: rng.randint(0, 6) for r in holdings if rng.random() < 0.3}
    search = kv_scoring._Search(found, 150, 16, DEFAULT_WEIGHTS, 0, ongoing)
    for role in (None, *ROLES):
        both(search, found.role_mask(role), ("unknown-0",), one=False)
        both(search, found.role_mask(role), (), one=True)


class Counts(Mapping[str, int]):
    """The router's requests in flight as a mapping that is not a dict."""

    def __init__(self, counts: dict[str, int]) -> None:
        self._counts = counts

    def __getitem__(self, key: str) -> int:
        return self._counts[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._counts)

    def __len__(self) -> int:
        return len(self._counts)


def test_inputs_the_c_search_does_not_take_go_to_the_reference() -> None:
    """A mapping that is not a dict (ongoing, bits) and a mask past 4,096 replicas: the C
    search declines (NotImplemented) and the reference answers."""
    rng = random.Random(5)
    holdings = big_cluster(rng)
    found = Holdings.of(holdings, DEFAULT_WEIGHTS.request_tokens)
    c, names = native(), list(holdings)
    ongoing = Counts({r: 2 for r in holdings})
    assert c.rank(names, found, ongoing, *NUMBERS) is NotImplemented
    assert c.up_to_least(found, ongoing, found.known, (), False, *NUMBERS) is NotImplemented
    ranks = kv_scoring.rank_by_cost(names, found, 100, 16, ongoing)
    assert ranks == kv_scoring._ranks(found, names, 100, 16, ongoing, DEFAULT_WEIGHTS, 0)
    parts = (found.replicas, found.groups, found.board, MappingProxyType(dict(found.bits)))
    proxied = Holdings(*parts, found.known, found.roles, {})
    assert c.rank(names, proxied, {}, *NUMBERS) is NotImplemented
    wide = Holdings({}, (), (), {}, 1 << 5000, {}, {})
    assert c.up_to_least(wide, None, 1, (), False, *NUMBERS) is NotImplemented


def test_the_c_search_refuses_what_is_not_a_holding() -> None:
    c = native()
    board = ((0.0, "a", 1),)
    bad = Holdings({"a": "not a holding"}, (), board, {"a": 1}, 1, {}, {})  # type: ignore[dict-item]
    with pytest.raises(TypeError):
        c.up_to_least(bad, None, 1, (), False, *NUMBERS)
    with pytest.raises(TypeError):
        c.up_to_least(bad, None, 1)
    with pytest.raises(TypeError):
        c.rank(["a"], bad, None, *NUMBERS[:2])
    unlisted = Holdings({}, (), board, {"a": 1}, 1, {}, {})
    with pytest.raises(KeyError):  # on the board, not in the answer
        c.up_to_least(unlisted, None, 1, (), False, *NUMBERS)


def test_without_the_c_module_the_searches_run_in_python(monkeypatch) -> None:
    monkeypatch.setattr(cost_search, "native", lambda: None)
    rng = random.Random(9)
    for _ in range(20):
        holdings = big_cluster(rng)
        candidates = [r for r in holdings if rng.random() < 0.7]
        if candidates:
            check_ranks(holdings, candidates, rng.randint(1, 200), 16, {}, 0)


def test_the_module_reports_a_failed_build_and_falls_back(monkeypatch, caplog) -> None:
    from deployments.cluster import native as builds

    def fail(name: str) -> None:
        raise builds.NativeBuildError("no C compiler here")

    monkeypatch.setattr(builds, "load", fail)
    cost_search.native.cache_clear()
    try:
        with caplog.at_level("WARNING"):
            assert cost_search.native() is None
        assert "run in Python: no C compiler here" in caplog.text
    finally:
        cost_search.native.cache_clear()


def test_a_routing_process_builds_the_module_as_it_starts(monkeypatch) -> None:
    """The Router's cluster cache asks for the C module off its thread when made (its first
    request must not wait for the compiler)."""
    from deployments.cluster.kv_index import IndexedClusterCache

    asked = threading.Event()
    monkeypatch.setattr(cost_search, "native", asked.set)
    IndexedClusterCache("app", 16)
    assert asked.wait(timeout=10)
