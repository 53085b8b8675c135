"""The routing searches in C (csrc/cost_search.c, compiled on first use by native.py):
`rank_by_cost`, `cheapest_held`'s choice and the survey's lender of kv_scoring.py (and the
search under them, `_Search.reference`, which the tests call directly), whose Python stays
the reference the tests hold the C code to and what runs where no C compiler is (or where an
input is not laid out as the index lays an answer out).

At 128 replicas a routing decision runs the search three or four times (the Router's survey,
then each leg's ranking); in Python its big-int masks and per-replica calls took most of the
decision (`pdserve bench router-sim`).
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Mapping, Sequence
from types import ModuleType
from typing import TYPE_CHECKING, Any

from deployments.cluster.kv_cost import DEFAULT_WEIGHTS, RoutingWeights

if TYPE_CHECKING:
    from deployments.cluster.kv_holdings import Holdings

logger = logging.getLogger(__name__)

# What the C search reads of a load, in EngineLoad's order (it reads an EngineLoad by position).
LOAD_FIELDS = ("num_running", "num_waiting", "queued_prompt_tokens", "kv_cache_usage")


def warm_up() -> None:
    """Build (or load) the C module off the caller's thread: a process that routes calls this
    when it starts, so its first request does not wait for the compiler (~0.5 s, once per
    machine: the build is cached on disk)."""
    threading.Thread(target=native, name="pdserve-cost-search-build", daemon=True).start()


@functools.cache
def native() -> ModuleType | None:
    """The C module where it builds here, else None (the Python reference runs)."""
    from deployments.cluster.native import NativeBuildError, load

    try:
        module = load("cost_search")
    except NativeBuildError as exc:
        logger.warning("the routing searches run in Python: %s", exc)
        return None
    from engine.core.kv_events import EngineLoad

    if EngineLoad._fields[:4] == LOAD_FIELDS:  # (else every load is read by name)
        module.set_load_type(EngineLoad)
    return module


# Each call below answers as its reference in kv_scoring.py does, or NotImplemented where the
# C module is not here or declines the input (the caller then runs the reference).


def rank(
    candidates: Sequence[str],
    holdings: Holdings,
    ongoing: Mapping[str, int],
    numbers: tuple[int, int, int],
    weights: RoutingWeights,
) -> Any:
    """`kv_scoring._ranks`."""
    c = native()
    return (
        NotImplemented
        if c is None
        else c.rank(candidates, holdings, ongoing, *numbers, *_of(weights))
    )


def cheapest(
    holdings: Holdings, eligible: int, numbers: tuple[int, int, int], weights: RoutingWeights
) -> Any:
    """`cheapest_held`'s choice: a replica, or None."""
    c = native()
    return NotImplemented if c is None else c.cheapest(holdings, eligible, *numbers, *_of(weights))


def most_held(holdings: Holdings) -> Any:
    """`kv_scoring._most_held_in_python`."""
    c = native()
    return NotImplemented if c is None else c.most_held(holdings, holdings.request_tokens)


def _of(weights: RoutingWeights) -> tuple[float, float, float]:
    if weights is DEFAULT_WEIGHTS:  # (nearly every call)
        return _DEFAULT_NUMBERS
    return weights.request_tokens, weights.hot_kv_usage, weights.tier_token_cost


_DEFAULT_NUMBERS = _of(RoutingWeights())
