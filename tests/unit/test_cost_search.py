"""The routing searches' inner loop in C (deployments/cluster/csrc/cost_search.c, built on
first use) against the Python reference (`_Search.reference` of kv_scoring.py), result for
result, on random clusters past 64 and 128 replicas: small and big holder groups, tiers,
loans, the router's requests in flight, replicas the index does not know, either search
(`one`); and the fallbacks (an input the C code does not take, no compiler)."""

from __future__ import annotations

import random
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

import pytest

from deployments.cluster import cost_search, kv_scoring
from deployments.cluster.kv_scoring import DEFAULT_WEIGHTS, Holding, Holdings, RoutingWeights
from tests.unit.test_kv_scoring import ROLES, check_ranks, lookup_from_an_index, random_load


def big_cluster(rng: random.Random) -> dict[str, Holding]:
    """Up to 300 replicas: most hold nothing or one shared prefix (big groups), a few runs of
    their own (small groups), some of it in a tier."""
    shared = rng.randint(1, 6)
    holdings = {}
    for i in range(rng.choice([3, 40, 70, 140, 300])):
        kind = rng.random()
        cached = 0 if kind < 0.5 else shared if kind < 0.9 else rng.randint(1, 12)
        tier = rng.randint(0, cached) if cached and rng.random() < 0.1 else 0
        role = rng.choice(ROLES)
        holdings[f"replica-{i}"] = Holding(cached, random_load(rng), role, f"h:{i}", tier)
    return holdings


def both(search: Any, eligible: int, unheard: tuple[str, ...], one: bool) -> None:
    """The C search answers as the reference does, and it was the C search that answered."""
    answer = search.up_to_least(eligible, unheard, one)
    assert answer is not NotImplemented
    assert answer == search.reference(eligible, unheard, one)


@pytest.mark.parametrize("seed", range(60))
def test_the_c_search_answers_as_the_python_one(seed: int, monkeypatch) -> None:
    rng = random.Random(seed)
    holdings = big_cluster(rng)
    prompt, block_size = rng.randint(1, 200), rng.choice([4, 16])
    lent = rng.choice([0, 0, rng.randint(1, 12)])
    weights = rng.choice([DEFAULT_WEIGHTS, RoutingWeights(request_tokens=8.0)])
    ongoing = {r: rng.randint(0, 6) for r in holdings if rng.random() < 0.3}
    c = cost_search.native()
    assert c is not None  # a compiler is here
    calls = []
    monkeypatch.setattr(cost_search, "native", lambda: calls.append(1) or c)
    laid_out = Holdings.of(holdings, weights.request_tokens)
    for found in (laid_out, lookup_from_an_index(holdings, rng)):
        if found.request_tokens != weights.request_tokens:
            continue  # (the index's board is of the default weights)
        search = kv_scoring._Search(found, prompt, block_size, weights, lent, ongoing)
        unheard = tuple(f"unknown-{i}" for i in range(rng.choice([0, 0, 2])))
        for role in (None, *ROLES):
            both(search, found.role_mask(role), unheard, one=False)
            both(search, found.role_mask(role), (), one=True)
        some = sum(bit for bit in found.bits.values() if rng.random() < 0.5)
        both(search, some & found.known, unheard, one=False)
        candidates = [r for r in holdings if rng.random() < 0.7] + list(unheard)
        if candidates:
            check_ranks(found, candidates, prompt, block_size, ongoing, lent)
    assert calls  # the C module was asked (and `both` saw it answer)


@pytest.mark.parametrize("seed", range(20))
def test_the_candidates_mask_is_the_python_one(seed: int, monkeypatch) -> None:
    rng = random.Random(seed)
    holdings = big_cluster(rng)
    found = Holdings.of(holdings, DEFAULT_WEIGHTS.request_tokens)
    candidates = [r for r in holdings if rng.random() < 0.6] + ["unknown", "unknown", "x"]
    rng.shuffle(candidates)
    mask, unheard = kv_scoring._candidates(found, candidates)
    assert unheard == ["unknown", "x"] or unheard == ["x", "unknown"]
    monkeypatch.setattr(cost_search, "native", lambda: None)
    assert (mask, set(unheard)) == kv_scoring._candidates(found, candidates)


class Counts(Mapping[str, int]):
    """The router's requests in flight as a mapping that is not a dict."""

    def __init__(self, counts: dict[str, int]) -> None:
        self._counts = counts

    def __getitem__(self, key: str) -> int:
        return self._counts[key]

    def __iter__(self):  # type: ignore[no-untyped-def]
        return iter(self._counts)

    def __len__(self) -> int:
        return len(self._counts)


def test_inputs_the_c_search_does_not_take_go_to_the_reference(monkeypatch) -> None:
    """A mapping that is not a dict (ongoing, bits) and a mask past 4,096 replicas: the C
    search declines (NotImplemented) and the reference answers."""
    rng = random.Random(5)
    holdings = big_cluster(rng)
    found = Holdings.of(holdings, DEFAULT_WEIGHTS.request_tokens)
    c = cost_search.native()
    assert c is not None
    referred = []
    reference = kv_scoring._Search.reference

    def counted(self, *args):  # type: ignore[no-untyped-def]
        referred.append(1)
        return reference(self, *args)

    monkeypatch.setattr(kv_scoring._Search, "reference", counted)
    ongoing = Counts({r: 2 for r in holdings})
    search = kv_scoring._Search(found, 100, 16, DEFAULT_WEIGHTS, 0, ongoing)
    assert search.up_to_least(found.known) == reference(search, found.known)
    assert referred == [1]
    proxied = Holdings(
        found.replicas,
        found.groups,
        found.board,
        MappingProxyType(dict(found.bits)),
        found.known,
        found.roles,
        {r: found[r] for g in found.groups for r in g.members},
    )
    assert c.candidates_mask(["a"], proxied.bits, proxied.replicas) is NotImplemented
    search = kv_scoring._Search(proxied, 100, 16, DEFAULT_WEIGHTS)
    assert search.up_to_least(found.known) == reference(search, found.known)
    assert referred == [1, 1]
    wide = 1 << 5000
    args = ((), (), (), {}, {}, None, wide, 0, 0, (), False, 1, 16, 0, 32.0, 0.9, 0.1)
    assert c.up_to_least(*args) is NotImplemented


def test_the_c_search_refuses_what_is_not_a_holding() -> None:
    c = cost_search.native()
    assert c is not None
    board = ((0.0, "a", 1),)
    args = [(), (), board, {"a": "not a holding"}, {"a": 1}, None, 1, 1, 0, (), False]
    with pytest.raises(TypeError):
        c.up_to_least(*args, 1, 16, 0, 32.0, 0.9, 0.1)
    with pytest.raises(TypeError):
        c.up_to_least(*args[:5])
    with pytest.raises(KeyError):
        c.up_to_least(
            (), (), board, {}, {"a": 1}, None, 1, 1, 0, (), False, 1, 16, 0, 1.0, 1.0, 0.1
        )


def test_without_the_c_module_the_searches_run_in_python(monkeypatch) -> None:
    monkeypatch.setattr(cost_search, "native", lambda: None)
    rng = random.Random(9)
    for _ in range(20):
        holdings = big_cluster(rng)
        candidates = [r for r in holdings if rng.random() < 0.7]
        if candidates:
            check_ranks(holdings, candidates, rng.randint(1, 200), 16, {}, 0)


def test_the_module_reports_a_failed_build_and_falls_back(monkeypatch, caplog) -> None:
    from deployments.cluster import native

    def fail(name: str) -> None:
        raise native.NativeBuildError("no C compiler here")

    monkeypatch.setattr(native, "load", fail)
    cost_search.native.cache_clear()
    try:
        with caplog.at_level("WARNING"):
            assert cost_search.native() is None
        assert "run in Python: no C compiler here" in caplog.text
    finally:
        cost_search.native.cache_clear()
