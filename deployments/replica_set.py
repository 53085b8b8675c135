"""Whether an engine role has a running replica, as Serve's own request router for it sees it.

The prefill deployment is routed by `request_routers.ReplicaSetRouter`, a Serve request router
(the `request_router_config` extension point) that picks replicas by power of two choices, as
Serve's default does, and also publishes the size of its replica set to `REPLICA_SETS` in this
process whenever Serve changes it: the controller's updates (a replica started, stopped, found
dead by a health check) and the handle's own errors (a call or a queue-length probe that found
the actor dead). The Router reads it to go decode-only at once when no prefill replica runs,
instead of waiting in Serve's queue for a replacement (seconds to minutes) and reporting a
disaggregated route it never took.

Serve runs handles' routers on their own event loop thread: `ReplicaSets` is thread-safe and
wakes waiters on their own loops. No Ray import here: the orchestrator's tests use it as is.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading


class ReplicaSets:
    """Running-replica counts per role, published by request routers (any thread)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: dict[str, int] = {}
        self._waiters: dict[str, list[tuple[asyncio.AbstractEventLoop, asyncio.Future[None]]]] = {}

    def publish(self, role: str, count: int) -> None:
        with self._lock:
            self._counts[role] = count
            waiters = self._waiters.pop(role, []) if count == 0 else []
        for loop, future in waiters:
            with contextlib.suppress(RuntimeError):  # its loop has closed: nobody waits
                loop.call_soon_threadsafe(_resolve, future)

    def available(self, role: str) -> bool:
        """False once the role's router has seen no running replica. Unknown (no router yet,
        i.e. no call made) counts as available: the first call finds out."""
        with self._lock:
            return self._counts.get(role, 1) > 0

    async def gone(self, role: str) -> None:
        """Returns when the role has no running replica (at once if it has none now)."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[None] = loop.create_future()
        with self._lock:
            if self._counts.get(role, 1) == 0:
                return
            self._waiters.setdefault(role, []).append((loop, future))
        try:
            await future
        finally:
            with self._lock:
                waiting = self._waiters.get(role, [])
                if (loop, future) in waiting:
                    waiting.remove((loop, future))


def _resolve(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


REPLICA_SETS = ReplicaSets()


class RoleWatch:
    """One role's view of REPLICA_SETS (the orchestrator's ReplicaWatch)."""

    def __init__(self, role: str, sets: ReplicaSets = REPLICA_SETS) -> None:
        self.role = role
        self._sets = sets

    def available(self) -> bool:
        return self._sets.available(self.role)

    async def gone(self) -> None:
        await self._sets.gone(self.role)
