"""The cost of serving a prompt on an engine replica, in prompt tokens: the score of KV-aware
routing (kv_scoring.py searches and ranks by it).

    cost = uncached prompt tokens  (what this replica would compute for it)
         + tier_token_cost x prompt tokens held in a tier below its pool only
                                   (copied back into the pool before the prefill)
         + queued prompt tokens    (prefill work already waiting on that replica)
         + request_tokens x ongoing requests   (each running stream slows every step)
         + the whole prompt again when the replica's KV pool is nearly full

The last term keeps a hot spot from attracting more: a replica about to preempt or evict would
lose the cached blocks that made it attractive. A cache hit is worth exactly the tokens it
saves, so a replica holding a long prefix wins until its queue costs more than recomputing
the prefix elsewhere would. The cost is a cache part (`cache_term`) and a load part
(`load_cost`); `load_key`, the load part as the replica reported it, is the least the load part
can be, so cache part + `load_key` bounds a replica's cost from below (searches stop on it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

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


DEFAULT_WEIGHTS = RoutingWeights()


class Holding(NamedTuple):
    """What the index knows of one replica for one prompt (a tuple: a lookup builds one per
    holder, and a frozen dataclass takes twice as long to build)."""

    cached_blocks: int  # the prompt's leading blocks it holds, in its pool or a tier
    load: EngineLoad | None  # None until the replica has reported
    role: str = ""  # "prefill", "decode", "colocated"
    side_channel: str = ""  # "host:port" of its KV side channel ("" without KV transfer)
    tier_blocks: int = 0  # of cached_blocks, those held in a tier only (loaded back first)


NOTHING_HELD = Holding(0, None)  # a replica the index does not know


def cache_term(
    prompt_tokens: int,
    block_size: int,
    cached_blocks: int,
    tier_blocks: int,
    weights: RoutingWeights,
    lent_blocks: int = 0,
) -> float:
    """The cost's prompt part for a replica holding `cached_blocks` of the prompt's leading
    blocks (`tier_blocks` of them in a tier only): what it would compute, and copy back."""
    if lent_blocks > cached_blocks:
        cached_blocks, tier_blocks = lent_blocks, 0
    uncached = max(0, prompt_tokens - cached_blocks * block_size)
    return uncached + weights.tier_token_cost * min(prompt_tokens, tier_blocks * block_size)


def load_key(load: EngineLoad | None, weights: RoutingWeights = DEFAULT_WEIGHTS) -> float:
    """The cost's load part as the replica reported it. The router's own count of requests
    in flight and a nearly full pool only add to it: `cache_term + load_key` is a replica's
    least possible cost (searches stop on it)."""
    if load is None:
        return 0.0
    busy = load.num_running + load.num_waiting
    return load.queued_prompt_tokens + weights.request_tokens * busy


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
    blocks, tier = holding.cached_blocks, holding.tier_blocks
    term = cache_term(prompt_tokens, block_size, blocks, tier, weights, lent_blocks)
    return term + load_cost(prompt_tokens, holding, ongoing, weights)


def load_cost(prompt_tokens: int, holding: Holding, ongoing: int, weights: RoutingWeights) -> float:
    """The cost's load part: its queue, its requests (the router's count or its own, the
    more), and the whole prompt again where its pool is nearly full."""
    load = holding.load
    if load is None:
        return weights.request_tokens * max(ongoing, 0)
    busy = max(ongoing, load.num_running + load.num_waiting)
    cost = load.queued_prompt_tokens + weights.request_tokens * busy
    if load.kv_cache_usage >= weights.hot_kv_usage:
        cost += prompt_tokens
    return cost
