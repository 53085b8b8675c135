"""Waiting on a condition with a deadline: the one place in tests/ that polls.

A test never sleeps to let something happen: it waits for what it needs to see (here), or
holds the work back on an event it releases itself.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable


def wait_until(condition: Callable[[], object], timeout_s: float, period_s: float = 0.05) -> bool:
    """Poll `condition` (exceptions count as False) until it holds or the time is up."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if condition():
                return True
        except Exception:
            pass
        left = deadline - time.monotonic()
        if left < 0:
            return False
        time.sleep(min(period_s, left))  # the pause between two looks, never past the deadline


async def wait_until_async(
    condition: Callable[[], object], timeout_s: float, period_s: float = 0.05
) -> bool:
    """`wait_until` from a coroutine: the polling runs in a thread, so the event loop (and
    every task on it) goes on meanwhile."""
    return await asyncio.to_thread(wait_until, condition, timeout_s, period_s)
