"""The routing searches' inner loop in C (csrc/cost_search.c, compiled on first use by
native.py): `_Search.up_to_least` of kv_scoring.py, which stays the reference the tests hold
the C one to and what runs where no C compiler is, and a ranking's candidates' mask.

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
