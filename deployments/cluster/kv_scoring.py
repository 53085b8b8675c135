"""Choosing an engine replica by cache against load: the searches of KV-aware routing over
the cost of deployments/cluster/kv_cost.py (its names are this module's too).

Where the cache tells the candidates apart by nothing (no hits, or every replica holds the
same shared system prompt) the router leaves the choice to Serve's power of two choices,
which balances by queue length (`rank_by_cost` returns None).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from deployments.cluster import cost_search
from deployments.cluster.kv_cost import (
    DEFAULT_WEIGHTS,
    NOTHING_HELD,
    Holding,
    RoutingWeights,
    cache_term,
    load_cost,
    load_key,
    replica_cost,
)
from deployments.cluster.kv_holdings import SMALL_GROUP, HeldGroup, Holdings, as_holdings
from deployments.cluster.once import once

# The names of the cost and of the holdings are this module's too (the routers, the index and
# the tests import them from here).
__all__ = [
    "DEFAULT_WEIGHTS",
    "NOTHING_HELD",
    "SMALL_GROUP",
    "Borrower",
    "CacheSurvey",
    "ClusterCache",
    "HeldGroup",
    "Holding",
    "Holdings",
    "Lender",
    "RoutingWeights",
    "as_holdings",
    "cache_term",
    "cheapest",
    "cheapest_held",
    "decode_holder",
    "lender_worth_borrowing",
    "load_cost",
    "load_key",
    "rank_by_cost",
    "replica_cost",
    "survey",
]


class _Search:
    """One prompt's costs on `holdings`: a loan's `lent_blocks` reach every replica; `ongoing`
    (the router's requests in flight, by replica) counts where given. (A plain class: a
    frozen dataclass took a microsecond and a half to build, four times per decision.)"""

    __slots__ = ("block_size", "holdings", "lent_blocks", "ongoing", "prompt_tokens", "weights")

    def __init__(
        self,
        holdings: Holdings,
        prompt_tokens: int,
        block_size: int,
        weights: RoutingWeights,
        lent_blocks: int = 0,
        ongoing: Mapping[str, int] | None = None,
    ) -> None:
        self.holdings, self.prompt_tokens, self.block_size = holdings, prompt_tokens, block_size
        self.weights, self.lent_blocks, self.ongoing = weights, lent_blocks, ongoing

    def cost(self, replica: str, holding: Holding, term: float | None = None) -> float:
        """`term`: the holding's cache term, where known (then only its load is read)."""
        if term is None:
            term = self.term(holding.cached_blocks, holding.tier_blocks)
        busy = self.ongoing.get(replica, 0) if self.ongoing is not None else 0
        return term + load_cost(self.prompt_tokens, holding, busy, self.weights)

    def term(self, cached_blocks: int, tier_blocks: int) -> float:
        p, bs, w, lent = self.prompt_tokens, self.block_size, self.weights, self.lent_blocks
        return cache_term(p, bs, cached_blocks, tier_blocks, w, lent)

    def reference(
        self, eligible: int, unheard: Iterable[str] = (), one: bool = False
    ) -> tuple[dict[str, float], float]:
        """The costs of the replicas of the `eligible` mask that may cost least, and the least
        cost of a walked one (inf for none; with `one`, of any). Every member of a small group
        is evaluated; the walked ones (of big groups, holding nothing, and the `unheard`
        replicas the index does not know) by load, until no later one can cost less than the
        least of them, two of them at least where they tie (Serve chooses between them by
        queue length, as its power of two choices does) — or, with `one`, until none can cost
        less than the least of all (the cheapest is then in the costs)."""
        found = self.holdings
        costs: dict[str, float] = {}
        for group in found.groups:
            if group.members and group.mask & eligible:
                term = self.term(group.cached_blocks, group.tier_blocks)
                for replica in found.members_in(group, eligible):
                    costs[replica] = self.cost(replica, found.replicas[replica], term)
        walk = _Walk(self, costs, ties=1 if one else 2)
        if one and costs:  # the cheapest member of a small group: only a cheaper one counts
            walk.least, walk.at_least = min(costs.values()), 1
        nothing = self.term(0, 0)
        for replica in unheard:
            walk.evaluate(replica, NOTHING_HELD, nothing)
        # A replica's term is its group's, else that of holding nothing. (Not always the
        # most: a loan that covers a group's blocks leaves it their tier's copies to pay.)
        kinds = [(self.term(g.cached_blocks, g.tier_blocks), g.mask) for g in found.big]
        kinds.append((nothing, ~found.held_mask))
        kinds.sort(key=lambda kind: kind[0])
        walk.along(found, eligible & found.known & ~found.small_mask, kinds)
        return costs, walk.least


class _Walk:
    """The replicas not in a small group, least loaded first, evaluated until the next can
    cost no less than the least found so far (`ties`: or, where it costs as much, once that
    many replicas cost the least)."""

    __slots__ = ("at_least", "costs", "least", "search", "ties")

    def __init__(self, search: _Search, costs: dict[str, float], ties: int) -> None:
        self.search, self.costs, self.ties = search, costs, ties
        self.least = math.inf  # the least cost of a walked replica
        self.at_least = 0  # walked replicas costing `least`

    def evaluate(self, replica: str, holding: Holding, term: float) -> None:
        cost = self.costs[replica] = self.search.cost(replica, holding, term)
        if cost < self.least:
            self.least, self.at_least = cost, 1
        elif cost == self.least:
            self.at_least += 1

    def along(self, found: Holdings, alive: int, kinds: list[tuple[float, int]]) -> None:
        """Walk the load board over the `alive` mask: a replica costs its kind's term (of
        `kinds`, (term, mask) by rising term, the one whose mask holds its bit: the masks are
        disjoint) plus its load. A kind whose next member can cost no less than the least is
        done: those after it are loaded more. The walk ends when every kind is, or no replica
        left can cost less. (A replica costing at least `floor` is left out where floor >
        least, or floor == least and `ties` replicas cost the least already: inline, the
        hottest loop of routing.)"""
        if not alive:
            return
        lowest, least, enough = kinds[0][0], self.least, self.at_least >= self.ties
        for key, replica, bit in found.board_of(alive):
            floor = key + lowest
            if floor > least or (floor == least and enough):
                return
            if not bit & alive:
                continue
            for kind in kinds:  # (holding nothing's mask holds every bit no group does)
                if bit & kind[1]:
                    break
            term, mask = kind
            floor = key + term
            if floor > least or (floor == least and enough):
                kinds = [kind for kind in kinds if kind[1] != mask]
                alive &= ~mask
                if not alive:
                    return
                lowest = kinds[0][0]
                continue
            self.evaluate(replica, found.replicas[replica], term)
            least, enough = self.least, self.at_least >= self.ties
            alive &= ~bit
            if not alive:
                return


def rank_by_cost(
    candidates: Sequence[str],
    holdings: Mapping[str, Holding],
    prompt_tokens: int,
    block_size: int,
    ongoing: Mapping[str, int],
    weights: RoutingWeights = DEFAULT_WEIGHTS,
    lent_blocks: int = 0,
) -> list[list[str]] | None:
    """Candidates in ranks of equal cost, cheapest first (Serve takes the first rank with
    room); None when the cache does not tell them apart and load alone should decide (a
    loan of `lent_blocks` brings every candidate those blocks).

    The ranks are exact up to the cheapest candidates that are not in a small group of
    holders (two of them where they tie: `_Search.reference`); every other one (costlier,
    or costing as much as those) is in one last rank: if the ranks before it are full, Serve
    chooses there by queue length, as it would among any replicas."""
    found = as_holdings(holdings, weights)
    numbers = (prompt_tokens, block_size, lent_blocks)
    ranks = cost_search.rank(candidates, found, ongoing, numbers, weights)
    if ranks is not NotImplemented:
        return ranks
    return _ranks(found, candidates, prompt_tokens, block_size, ongoing, weights, lent_blocks)


def _ranks(
    found: Holdings,
    candidates: Sequence[str],
    prompt_tokens: int,
    block_size: int,
    ongoing: Mapping[str, int],
    weights: RoutingWeights,
    lent_blocks: int,
) -> list[list[str]] | None:
    """`rank_by_cost` in Python: the reference, where the C module does not build."""
    wanted = set(candidates)
    unheard = wanted.difference(found.replicas)
    # The candidates' bits (of replicas of the answer: another role's are unheard).
    eligible = sum(map(found.bits.get, wanted, itertools.repeat(0))) & found.known
    if not _tells_apart(found, eligible, bool(unheard), lent_blocks):
        return None
    search = _Search(found, prompt_tokens, block_size, weights, lent_blocks, ongoing)
    costs, least = search.reference(eligible, unheard)
    by_cost: dict[float, list[str]] = {}
    for replica, cost in costs.items():
        if cost <= least:
            by_cost.setdefault(cost, []).append(replica)
    ranks = [sorted(by_cost[cost]) for cost in sorted(by_cost)]
    ranked = {r for rank in ranks for r in rank}
    rest = list(itertools.filterfalse(ranked.__contains__, candidates))
    return [*ranks, rest] if rest else ranks


def _tells_apart(holdings: Holdings, eligible: int, unheard: bool, lent_blocks: int) -> bool:
    """Whether the cache tells the candidates apart (`eligible`: their bits; `unheard`: some
    are unknown to the index): one holds more than a loan brings, and they do not all hold
    alike (a shared system prompt)."""
    held = [g for g in holdings.groups if g.mask & eligible]
    deepest = max((g.cached_blocks for g in held), default=0)
    if deepest <= lent_blocks:
        return False
    if unheard or eligible & ~holdings.held_mask:
        return True  # one holds nothing, another more than the loan
    return len(held) > 1  # (a group: the replicas holding alike)


def _most_held(holdings: Holdings) -> tuple[int, str] | None:
    """(blocks, replica) of the replica that can lend holding the most of the prompt (of
    equals, the least loaded by its report, then the first by name); None where none
    holds any. In C where it builds (`_most_held_in_python` is the reference)."""
    found = cost_search.most_held(holdings)
    return _most_held_in_python(holdings) if found is NotImplemented else found


def _most_held_in_python(holdings: Holdings) -> tuple[int, str] | None:
    deepest: dict[int, list[HeldGroup]] = {}
    for group in holdings.groups:
        deepest.setdefault(group.cached_blocks, []).append(group)
    for blocks in sorted(deepest, reverse=True):
        lenders = [_least_lender(holdings, group) for group in deepest[blocks]]
        least = min((lender for lender in lenders if lender is not None), default=None)
        if least is not None:
            return blocks, least[1]
    return None


def _least_lender(holdings: Holdings, group: HeldGroup) -> tuple[float, str] | None:
    """(load_key, replica) of the group's least loaded member with a side channel."""
    replicas = holdings.replicas
    if not group.members:  # a big group: the first on the board
        mask = group.mask
        return next(
            ((k, r) for k, r, bit in holdings.board if bit & mask and replicas[r].side_channel),
            None,
        )
    weights = holdings.weights
    lenders = (r for r in group.members if replicas[r].side_channel)
    return min(((load_key(replicas[r].load, weights), r) for r in lenders), default=None)


def cheapest(
    holdings: Mapping[str, Holding],
    prompt_tokens: int,
    block_size: int,
    weights: RoutingWeights = DEFAULT_WEIGHTS,
    role: str | None = None,
) -> tuple[str, int] | None:
    """The replica of `holdings` (of `role`, or any) that would serve the prompt cheapest, and
    how many of its tokens it holds; None when it holds none (cache-aware disaggregation asks
    this of the decode replicas)."""
    found = cheapest_held(holdings, prompt_tokens, block_size, weights, role=role)
    return found if found is not None and found[1] else None


def cheapest_held(
    holdings: Mapping[str, Holding],
    prompt_tokens: int,
    block_size: int,
    weights: RoutingWeights = DEFAULT_WEIGHTS,
    lent_blocks: int = 0,
    role: str | None = None,
) -> tuple[str, int] | None:
    """The replica of `holdings` (of `role`, or any) that would serve the prompt cheapest by
    its own reported load (of equals found, the first by name), cached or not, and the prompt
    tokens it holds itself; a loan's `lent_blocks` reach every one (the survey's borrower);
    None for no replica."""
    found = as_holdings(holdings, weights)
    eligible = found.role_mask(role)
    numbers = (prompt_tokens, block_size, lent_blocks)
    best = cost_search.cheapest(found, eligible, numbers, weights)
    if best is NotImplemented:
        search = _Search(found, prompt_tokens, block_size, weights, lent_blocks)
        costs, _ = search.reference(eligible, one=True)
        best = min((cost, replica) for replica, cost in costs.items())[1] if costs else None
    if best is None:
        return None
    return best, min(prompt_tokens, found[best].cached_blocks * block_size)


@dataclass(frozen=True)
class Lender:
    """A replica that may lend a prompt's leading blocks to the prefill leg."""

    replica: str
    side_channel: str
    tokens: int  # prompt tokens its blocks hold


@dataclass(frozen=True)
class CacheSurvey:
    """What the cluster's caches hold of one prompt, for the Router's choices. The choices
    that need a search are made when first asked for (`decode_holder`, `borrower`): a prompt
    no decode replica holds enough of never asks for the first."""

    block_hashes: list[bytes]  # the prompt's, as the engines hash it (a loan asks by them)
    lender: Lender | None  # the replica holding the most, any role, where it can lend
    # Every replica's holding (the index's answer): each leg's request router ranks its own
    # role's replicas by it instead of asking the index again.
    holdings: Holdings
    prompt_tokens: int
    block_size: int
    weights: RoutingWeights = DEFAULT_WEIGHTS
    lent_blocks: int = 0  # the lender's blocks of the prompt

    @once
    def decode_holder(self) -> tuple[str, int] | None:
        """The cheapest decode replica, and the prompt tokens it holds (None: it holds none)."""
        p, bs, w = self.prompt_tokens, self.block_size, self.weights
        return cheapest(self.holdings, p, bs, w, "decode")

    @once
    def borrower(self) -> tuple[str, int] | None:
        """The prefill replica that would compute the prompt cheapest given the lender's
        blocks (by the engines' loads: the leg's router, knowing its own requests in flight,
        then chooses), and the tokens it holds itself; None without a prefill replica or a
        lender. (It computes what follows the longer of its own run and the loan.)"""
        if self.lender is None:
            return None
        p, bs, w, lent = self.prompt_tokens, self.block_size, self.weights, self.lent_blocks
        return cheapest_held(self.holdings, p, bs, w, lent, "prefill")

    def holds(self, role: str, tokens: int) -> bool:
        """Whether a replica of `role` holds at least `tokens` of the prompt."""
        found, bs = self.holdings, self.block_size
        mask = found.role_mask(role)
        return any(g.mask & mask and g.cached_blocks * bs >= tokens for g in found.groups)


def survey(
    holdings: Mapping[str, Holding],
    block_hashes: list[bytes],
    prompt_tokens: int,
    block_size: int,
    weights: RoutingWeights = DEFAULT_WEIGHTS,
) -> CacheSurvey:
    """`holdings`: every replica's, whatever its role (`KVIndexServer.lookup`)."""
    found = as_holdings(holdings, weights)
    # A loan lends the lender's pool's run and then its tier's (offload/tier_loans.py). Any
    # engine lends: a prefill replica holding a prompt the load sends elsewhere too.
    lender, blocks = None, 0
    most = _most_held(found)
    if most is not None:
        blocks, replica = most
        tokens = min(prompt_tokens, blocks * block_size)
        lender = Lender(replica, found[replica].side_channel, tokens)
    return CacheSurvey(block_hashes, lender, found, prompt_tokens, block_size, weights, blocks)


def lender_worth_borrowing(survey: CacheSurvey | None, min_tokens: int) -> Lender | None:
    """Prefix loans: the lender whose blocks spare the borrower (the prefill replica the leg
    then goes to) at least `min_tokens` more than it holds itself (0: never); None where
    none does (routing then finds the prompt on a prefill replica, or nobody holds it)."""
    if survey is None or survey.lender is None or min_tokens <= 0:
        return None
    if survey.lender.tokens < min_tokens or survey.borrower is None:
        return None  # (spares no borrower enough, whatever it holds)
    lender, (borrower, held) = survey.lender, survey.borrower
    if borrower == lender.replica:
        return None
    return lender if lender.tokens - held >= min_tokens else None


def decode_holder(survey: CacheSurvey | None, prompt_tokens: int, limit: int) -> str:
    """Cache-aware disaggregation: the decode replica to send the prompt to without a prefill
    leg ("" for none) — one holding all but at most `limit` of its tokens (0: never)."""
    if survey is None or limit <= 0:
        return ""
    if prompt_tokens > limit and not survey.holds("decode", prompt_tokens - limit):
        return ""  # none holds enough: no need to find the cheapest
    found = survey.decode_holder
    if found is None:
        return ""
    return found[0] if prompt_tokens - found[1] <= limit else ""


class ClusterCache(Protocol):
    """What the engines' prefix caches hold of a prompt (the Router asks the app's KV index:
    kv_index.IndexedClusterCache)."""

    async def survey(
        self, prompt_token_ids: list[int], cache_salt: str | None
    ) -> CacheSurvey | None:
        """None when the prompt has no full block or nobody knows."""


class Borrower(Protocol):
    """Borrows a prompt's cached blocks for its prefill leg (kv_leases.PrefixBorrower)."""

    async def borrow(
        self, prompt: list[int], survey: CacheSurvey | None
    ) -> dict[str, Any] | None: ...
