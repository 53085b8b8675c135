"""The routing searches in C (csrc/cost_search.c, compiled on first use by native.py):
`_Search.up_to_least` and `rank_by_cost` of kv_scoring.py, whose Python stays the reference
the tests hold the C code to and what runs where no C compiler is (or where an input is not
laid out as the index lays an answer out).

At 128 replicas a routing decision runs the search three or four times (the Router's survey,
then each leg's ranking); in Python its big-int masks and per-replica calls took most of the
decision (`pdserve bench router-sim`).
"""

from __future__ import annotations

import functools
import logging
from types import ModuleType

logger = logging.getLogger(__name__)


@functools.cache
def native() -> ModuleType | None:
    """The C module where it builds here, else None (the Python reference runs)."""
    from deployments.cluster.native import NativeBuildError, load

    try:
        return load("cost_search")
    except NativeBuildError as exc:
        logger.warning("the routing searches run in Python: %s", exc)
        return None
