"""Choosing an engine replica by cache against load: the score of KV-aware routing.

A replica's cost for a prompt is the work, in prompt tokens, that stands between the prompt
and its first computed token there:

    cost = uncached prompt tokens  (what this replica would compute for it)
         + tier_token_cost x prompt tokens held in a tier below its pool only
                                   (copied back into the pool before the prefill)
         + queued prompt tokens    (prefill work already waiting on that replica)
         + request_tokens x ongoing requests   (each running stream slows every step)
         + the whole prompt again when the replica's KV pool is nearly full

The last term keeps a hot spot from attracting more: a replica about to preempt or evict would
lose the cached blocks that made it attractive. A cache hit is worth exactly the tokens it
saves, so a replica holding a long prefix wins until its queue costs more than recomputing
the prefix elsewhere would. Where the cache tells the candidates apart by nothing (no hits, or
every replica holds the same shared system prompt) the router leaves the choice to Serve's
power of two choices, which balances by queue length (`rank_by_cost` returns None).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from engine.core.kv_events import EngineLoad


@dataclass(frozen=True)
class RoutingWeights:
    # Prompt tokens one ongoing request weighs (a running decode slows each step a little;
    # a queued prefill's tokens count in full through queued_prompt_tokens).
    request_tokens: float = 32.0
    # KV usage (blocks held by running requests) from which a replica counts as a hot spot.
    hot_kv_usage: float = 0.9
    # What a token held in a tier below the pool (engine/offload/) costs against computing it:
    # its K/V are copied back first. A copy is far cheaper than the prefill it saves (on this
    # project's 2-core CPU, ~13 us a token from host memory against ~1 ms a token computed;
    # on GPUs a PCIe copy against a prefill, of the same order); a tenth keeps a replica that
    # holds a prefix in its pool ahead of one that holds it in a tier, at equal load.
    tier_token_cost: float = 0.1


@dataclass(frozen=True)
class Holding:
    """What the index knows of one replica for one prompt."""

    cached_blocks: int  # the prompt's leading blocks it holds, in its pool or a tier
    load: EngineLoad | None  # None until the replica has reported
    role: str = ""  # "prefill", "decode", "colocated"
    side_channel: str = ""  # "host:port" of its KV side channel ("" without KV transfer)
    tier_blocks: int = 0  # of cached_blocks, those held in a tier only (loaded back first)


NOTHING_HELD = Holding(0, None)  # a replica the index does not know


def replica_cost(
    prompt_tokens: int,
    block_size: int,
    holding: Holding,
    ongoing: int,
    weights: RoutingWeights,
    lent_blocks: int = 0,
) -> float:
    """The cost above; `ongoing` is the router's own count of requests in flight there;
    `lent_blocks`, the prompt's leading blocks a prefix loan brings (read, not computed,
    wherever the request goes)."""
    cached, tier_blocks = holding.cached_blocks, holding.tier_blocks
    if lent_blocks > cached:
        cached, tier_blocks = lent_blocks, 0
    uncached = max(0, prompt_tokens - cached * block_size)
    in_tier = min(prompt_tokens, tier_blocks * block_size)
    load = holding.load
    queued = load.queued_prompt_tokens if load is not None else 0
    busy = max(ongoing, (load.num_running + load.num_waiting) if load is not None else 0)
    cost = uncached + weights.tier_token_cost * in_tier + queued + weights.request_tokens * busy
    if load is not None and load.kv_cache_usage >= weights.hot_kv_usage:
        cost += prompt_tokens
    return cost


def rank_by_cost(
    candidates: Sequence[str],
    holdings: Mapping[str, Holding],
    prompt_tokens: int,
    block_size: int,
    ongoing: Mapping[str, int],
    weights: RoutingWeights = RoutingWeights(),
    lent_blocks: int = 0,
) -> list[list[str]] | None:
    """Candidates in ranks of equal cost, cheapest first (Serve takes the first rank with
    room); None when the cache does not tell them apart and load alone should decide (a
    loan of `lent_blocks` brings every candidate those blocks)."""
    chosen = [holdings.get(c, NOTHING_HELD) for c in candidates]
    if not chosen or max(h.cached_blocks for h in chosen) <= lent_blocks:
        return None
    if len({(h.cached_blocks, h.tier_blocks) for h in chosen}) == 1:
        return None
    costs: dict[float, list[str]] = {}
    for candidate, holding in zip(candidates, chosen, strict=True):
        busy = ongoing.get(candidate, 0)
        cost = replica_cost(prompt_tokens, block_size, holding, busy, weights, lent_blocks)
        costs.setdefault(cost, []).append(candidate)
    return [costs[cost] for cost in sorted(costs)]


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
    weights: RoutingWeights = RoutingWeights(),
) -> CacheSurvey:
    """`holdings`: every replica's, whatever its role (`KVIndexServer.lookup`)."""

    def tokens(blocks: int) -> int:
        return min(prompt_tokens, blocks * block_size)

    decode = {r: h for r, h in holdings.items() if h.role == "decode"}
    # A loan lends the lender's pool's run and then its tier's (offload/tier_loans.py). Any
    # engine lends: a prefill replica holding a prompt the load sends elsewhere too.
    lenders = [(h.cached_blocks, r) for r, h in holdings.items() if h.side_channel]
    lender, borrower = None, None
    if lenders:
        blocks, replica = max(lenders)
        if blocks:
            lender = Lender(replica, holdings[replica].side_channel, tokens(blocks))
            # The prefill replica that would compute it cheapest with the loan (it computes
            # what follows the longer of its own run and the loan).
            prefill = {r: h for r, h in holdings.items() if h.role == "prefill"}
            borrower = cheapest_held(prefill, prompt_tokens, block_size, weights, blocks)
    return CacheSurvey(
        block_hashes=block_hashes,
        decode_holder=cheapest(decode, prompt_tokens, block_size, weights),
        lender=lender,
        borrower=borrower,
        holdings=holdings,
    )


def cheapest(
    holdings: Mapping[str, Holding],
    prompt_tokens: int,
    block_size: int,
    weights: RoutingWeights = RoutingWeights(),
) -> tuple[str, int] | None:
    """The replica of `holdings` (one role) that would serve the prompt cheapest, and how many
    of its tokens it holds; None when it holds none (cache-aware disaggregation asks this of
    the decode replicas)."""
    found = cheapest_held(holdings, prompt_tokens, block_size, weights)
    return found if found is not None and found[1] else None


def cheapest_held(
    holdings: Mapping[str, Holding],
    prompt_tokens: int,
    block_size: int,
    weights: RoutingWeights = RoutingWeights(),
    lent_blocks: int = 0,
) -> tuple[str, int] | None:
    """The replica of `holdings` that would serve the prompt cheapest by its own reported load
    (the first of equals), cached or not, and the prompt tokens it holds itself; a loan's
    `lent_blocks` reach every one (the survey's borrower); None for no replica."""
    best: tuple[float, str] | None = None
    for replica, holding in holdings.items():
        cost = replica_cost(prompt_tokens, block_size, holding, 0, weights, lent_blocks)
        if best is None or cost < best[0]:
            best = (cost, replica)
    if best is None:
        return None
    replica = best[1]
    return replica, min(prompt_tokens, holdings[replica].cached_blocks * block_size)


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
