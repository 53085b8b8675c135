"""Choosing an engine replica by cache against load: the searches of KV-aware routing over
the cost of deployments/cluster/kv_cost.py (its names are this module's too).

Where the cache tells the candidates apart by nothing (no hits, or every replica holds the
same shared system prompt) the router leaves the choice to Serve's power of two choices,
which balances by queue length (`rank_by_cost` returns None).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

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

# The cost's names are this module's too (the routers, the index and the tests import them
# from here).
__all__ = [
    "DEFAULT_WEIGHTS",
    "NOTHING_HELD",
    "SMALL_GROUP",
    "Borrower",
    "CacheSurvey",
    "ClusterCache",
    "Holding",
    "Holdings",
    "Lender",
    "RoutingWeights",
    "as_holdings",
    "cache_term",
    "cheapest",
    "cheapest_held",
    "decode_holder",
    "in_walk_order",
    "lender_worth_borrowing",
    "load_cost",
    "load_key",
    "rank_by_cost",
    "replica_cost",
    "survey",
]


class Holdings(dict[str, Holding]):
    """Every replica's holding of one prompt (`KVIndexServer.lookup`'s answer), with what lets
    a search skip most replicas: `groups`, the replicas holding some of it by equal
    (cached_blocks, tier_blocks), those of a group of more than SMALL_GROUP least loaded
    first, and `by_load`, every replica the index knows as
    (`load_key`, replica), least first (it may name replicas of roles a per-role answer
    leaves out: searches skip them).

    Replicas of one group, or holding nothing, differ in load only. A search evaluates the
    members of small groups, and walks the others of each kind along `by_load` until no later
    one can cost less (`_Search.up_to_least`): at 128 replicas it evaluates a few of them
    instead of all."""

    def __init__(
        self,
        holdings: Mapping[str, Holding] | Iterable[tuple[str, Holding]] = (),
        groups: tuple[tuple[str, ...], ...] | None = None,
        by_load: tuple[tuple[float, str], ...] | None = None,
        request_tokens: float = DEFAULT_WEIGHTS.request_tokens,
    ) -> None:
        """Without `groups` or `by_load`, they are worked out from the holdings."""
        super().__init__(holdings)
        self.request_tokens = request_tokens  # the weight `by_load`'s keys were taken with
        weights = RoutingWeights(request_tokens=request_tokens)
        if groups is None:
            alike: dict[tuple[int, int], list[str]] = {}
            for r, h in self.items():
                if h.cached_blocks:
                    alike.setdefault(_alike(h), []).append(r)
            keys = {r: load_key(h.load, weights) for r, h in self.items()}
            groups = tuple(in_walk_order(g, keys.__getitem__) for g in alike.values())
        self.groups = groups
        if by_load is None:
            by_load = tuple(sorted((load_key(h.load, weights), r) for r, h in self.items()))
        self.by_load = by_load

    def __reduce__(self) -> tuple[Any, ...]:  # crosses Ray's actor boundary
        return (Holdings, (dict(self), self.groups, self.by_load, self.request_tokens))

    def unheld_by_load(self) -> Iterator[tuple[str, Holding]]:
        """The replicas holding none of the prompt, least loaded first."""
        for _, replica in self.by_load:
            holding = self.get(replica)
            if holding is not None and not holding.cached_blocks:
                yield replica, holding


def _alike(holding: Holding) -> tuple[int, int]:
    """Holdings alike cost alike for any prompt, at equal load."""
    return holding.cached_blocks, holding.tier_blocks


def as_holdings(holdings: Mapping[str, Holding], weights: RoutingWeights) -> Holdings:
    """`holdings` with its groups and load order (a plain mapping's worked out once)."""
    if isinstance(holdings, Holdings) and holdings.request_tokens == weights.request_tokens:
        return holdings
    return Holdings(holdings, request_tokens=weights.request_tokens)


# Holders of one (cached_blocks, tier_blocks) evaluated one by one; a bigger group (everyone
# holding a shared system prompt) is walked by load with those holding nothing.
SMALL_GROUP = 4


def in_walk_order(group: Iterable[str], key: Callable[[str], float]) -> tuple[str, ...]:
    """A holder group as searches take it: a big one least loaded first (by `key`, then
    name), a small one as it is."""
    members = tuple(group)
    if len(members) <= SMALL_GROUP:
        return members
    return tuple(sorted(members, key=lambda r: (key(r), r)))


@dataclass(frozen=True)
class _Search:
    """One prompt's costs on `holdings`: a loan's `lent_blocks` reach every replica; `ongoing`
    (the router's requests in flight, by replica) counts where given."""

    holdings: Holdings
    prompt_tokens: int
    block_size: int
    weights: RoutingWeights
    lent_blocks: int = 0
    ongoing: Mapping[str, int] | None = None

    def cost(self, replica: str, holding: Holding, term: float | None = None) -> float:
        """`term`: the holding's cache term, where known."""
        if term is None:
            term = self.term(holding)
        busy = self.ongoing.get(replica, 0) if self.ongoing is not None else 0
        return term + load_cost(self.prompt_tokens, holding, busy, self.weights)

    def term(self, holding: Holding) -> float:
        p, bs, w, lent = self.prompt_tokens, self.block_size, self.weights, self.lent_blocks
        return cache_term(p, bs, holding, w, lent)

    def up_to_least(
        self,
        eligible: Callable[[str, Holding], bool],
        unheard: Iterable[str] = (),
        one: bool = False,
    ) -> tuple[dict[str, float], float]:
        """The costs of the eligible replicas that may cost least, and the least cost of a
        walked one (inf for none). Every member of a small group is evaluated; the walked
        ones (of big groups, holding nothing, and the `unheard` replicas the index does not
        know) by load, each kind until its next can cost no less than the least of them, two
        of them at least where they tie (Serve chooses between them by queue length, as its
        power of two choices does) — or, with `one`, until none can cost less than the least
        of all (the cheapest is then in the costs)."""
        found = self.holdings
        costs: dict[str, float] = {}
        walks: list[tuple[float, tuple[str, ...]]] = []  # cache term, members by load
        for group in found.groups:
            if len(group) > SMALL_GROUP:
                walks.append((self.term(found[group[0]]), group))
                continue
            for replica in group:
                if eligible(replica, found[replica]):
                    costs[replica] = self.cost(replica, found[replica])
        bound = min(costs.values(), default=math.inf) if one else math.inf
        walk = _Walk(self, eligible, costs, bound, ties=1 if one else 2)
        nothing = self.term(NOTHING_HELD)
        for replica in unheard:
            walk.evaluate(replica, NOTHING_HELD, nothing)
        # The deepest group first: its least cost ends the others soonest.
        for term, members in sorted(walks, key=lambda w: w[0]):
            walk.along(term, ((r, found[r]) for r in members))
        walk.along(nothing, found.unheld_by_load())
        return costs, walk.least


@dataclass
class _Walk:
    """Replicas of one cache term, least loaded first, evaluated until the next can cost no
    less than the least found so far (`ties`: or, where it costs as much, once that many
    replicas cost the least)."""

    search: _Search
    eligible: Callable[[str, Holding], bool]
    costs: dict[str, float]
    bound: float  # a cost no walk needs to beat (the least of the small groups', or inf)
    ties: int = 1
    least: float = math.inf  # the least cost of a walked replica
    at_least: int = 0  # walked replicas costing `least`

    def evaluate(self, replica: str, holding: Holding, term: float) -> None:
        cost = self.costs[replica] = self.search.cost(replica, holding, term)
        if cost < self.least:
            self.least, self.at_least = cost, 1
        elif cost == self.least:
            self.at_least += 1

    def along(self, term: float, replicas: Iterable[tuple[str, Holding]]) -> None:
        weights, costs = self.search.weights, self.costs
        for replica, holding in replicas:
            floor, limit = term + load_key(holding.load, weights), min(self.least, self.bound)
            if floor > limit or (floor == limit and self.at_least >= self.ties):
                return  # neither it nor any after it costs less (nor ties, where enough do)
            if replica not in costs and self.eligible(replica, holding):
                self.evaluate(replica, holding, term)


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
    holders (two of them where they tie: `_Search.up_to_least`); every other one (costlier,
    or costing as much as those) is in one last rank: if the ranks before it are full, Serve
    chooses there by queue length, as it would among any replicas."""
    found = as_holdings(holdings, weights)
    wanted = set(candidates)
    if not _tells_apart(found, candidates, wanted, lent_blocks):
        return None
    search = _Search(found, prompt_tokens, block_size, weights, lent_blocks, ongoing)
    costs, least = search.up_to_least(lambda r, h: r in wanted, wanted.difference(found))
    by_cost: dict[float, list[str]] = {}
    for replica, cost in costs.items():
        if cost <= least:
            by_cost.setdefault(cost, []).append(replica)
    ranks = [sorted(by_cost[cost]) for cost in sorted(by_cost)]
    rest = [r for r in candidates if costs.get(r, math.inf) > least]
    return [*ranks, rest] if rest else ranks


def _tells_apart(
    holdings: Holdings, candidates: Sequence[str], wanted: set[str], lent_blocks: int
) -> bool:
    """Whether the cache tells the candidates apart: one holds more than a loan brings, and
    they do not all hold alike (a shared system prompt)."""
    held = [g for g in holdings.groups if any(r in wanted for r in g)]
    deepest = max((holdings[g[0]].cached_blocks for g in held), default=0)
    if deepest <= lent_blocks:
        return False
    if any(holdings.get(c, NOTHING_HELD).cached_blocks == 0 for c in candidates):
        return True  # one holds nothing, another more than the loan
    return len(held) > 1  # (a group: the replicas holding alike)


def _most_held(holdings: Holdings) -> tuple[int, str] | None:
    """(blocks, replica) of the replica that can lend holding the most of the prompt (of
    equals, the last by name); None where none holds any."""
    most = None
    for group in sorted(holdings.groups, key=lambda g: -holdings[g[0]].cached_blocks):
        blocks = holdings[group[0]].cached_blocks
        if most is not None and blocks < most[0]:
            break
        for replica in group:
            if holdings[replica].side_channel and (most is None or (blocks, replica) > most):
                most = (blocks, replica)
    return most


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
    search = _Search(found, prompt_tokens, block_size, weights, lent_blocks)
    costs, _ = search.up_to_least(lambda r, h: role is None or h.role == role, one=True)
    if not costs:
        return None
    _, best = min((cost, replica) for replica, cost in costs.items())
    return best, min(prompt_tokens, found[best].cached_blocks * block_size)


@dataclass(frozen=True)
class Lender:
    """A replica that may lend a prompt's leading blocks to the prefill leg."""

    replica: str
    side_channel: str
    tokens: int  # prompt tokens its blocks hold


@dataclass(frozen=True)
class CacheSurvey:
    """What the cluster's caches hold of one prompt, for the Router's choices."""

    block_hashes: list[bytes]  # the prompt's, as the engines hash it (a loan asks by them)
    decode_holder: tuple[str, int] | None  # cheapest decode replica, tokens it holds
    lender: Lender | None  # the replica holding the most, any role, where it can lend
    # The prefill replica that would compute the prompt cheapest given the lender's blocks
    # (by the engines' loads: the leg's router, knowing its own requests in flight, then
    # chooses), and the tokens it holds itself; None without a prefill replica or a lender.
    borrower: tuple[str, int] | None = None
    # Every replica's holding (the index's answer): each leg's request router ranks its own
    # role's replicas by it instead of asking the index again.
    holdings: Mapping[str, Holding] = field(default_factory=dict)


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
    lender, borrower = None, None
    most = _most_held(found)
    if most is not None:
        blocks, replica = most
        tokens = min(prompt_tokens, blocks * block_size)
        lender = Lender(replica, found[replica].side_channel, tokens)
        # The prefill replica that would compute it cheapest with the loan (it computes
        # what follows the longer of its own run and the loan).
        borrower = cheapest_held(found, prompt_tokens, block_size, weights, blocks, "prefill")
    return CacheSurvey(
        block_hashes=block_hashes,
        decode_holder=cheapest(found, prompt_tokens, block_size, weights, "decode"),
        lender=lender,
        borrower=borrower,
        holdings=found,
    )


def lender_worth_borrowing(survey: CacheSurvey | None, min_tokens: int) -> Lender | None:
    """Prefix loans: the lender whose blocks spare the borrower (the prefill replica the leg
    then goes to) at least `min_tokens` more than it holds itself (0: never); None where
    none does (routing then finds the prompt on a prefill replica, or nobody holds it)."""
    if survey is None or survey.lender is None or survey.borrower is None or min_tokens <= 0:
        return None
    lender, (borrower, held) = survey.lender, survey.borrower
    if borrower == lender.replica:
        return None
    return lender if lender.tokens - held >= min_tokens else None


def decode_holder(survey: CacheSurvey | None, prompt_tokens: int, limit: int) -> str:
    """Cache-aware disaggregation: the decode replica to send the prompt to without a prefill
    leg ("" for none) — one holding all but at most `limit` of its tokens (0: never)."""
    found = survey.decode_holder if survey is not None else None
    if limit <= 0 or found is None:
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
