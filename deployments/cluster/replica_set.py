"""Which replicas of an engine role run, as Serve's own request router for the role sees them.

Every engine deployment is routed by one of `request_routers`' Serve request routers (the
`request_router_config` extension point), which publish the role's replica set to
`REPLICA_SETS` in this process whenever Serve changes it: the controller's updates (a replica
started, stopped, found dead by a health check) and the handle's own errors (a call or a
queue-length probe that found the actor dead). The Router reads it
- to go decode-only at once when no prefill replica runs, instead of waiting in Serve's queue
  for a replacement (seconds to minutes) and reporting a disaggregated route it never took;
- to move a request whose decode replica died to a prefill replica when no decode replica is
  left (deployments/router/migration.py);
- to ask every replica for its state (`Health`).

Serve runs handles' routers on their own event loop thread: `ReplicaSets` is thread-safe and
wakes waiters on their own loops. No Ray import here: the orchestrator's tests use it as is.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Iterable
from typing import Protocol


class ReplicaWatch(Protocol):
    """Whether a deployment has a running replica (RoleWatch; tests make their own)."""

    def available(self) -> bool: ...

    async def gone(self) -> None:
        """Returns when no replica is running."""


class ReplicaSets:
    """Running replicas per role (their Serve replica ids), published by request routers (any
    thread)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._replicas: dict[str, tuple[str, ...]] = {}
        self._waiters: dict[str, list[tuple[asyncio.AbstractEventLoop, asyncio.Future[None]]]] = {}

    def publish(self, role: str, replica_ids: Iterable[str]) -> None:
        ids = tuple(sorted(replica_ids))
        with self._lock:
            self._replicas[role] = ids
            waiters = self._waiters.pop(role, []) if not ids else []
        for loop, future in waiters:
            with contextlib.suppress(RuntimeError):  # its loop has closed: nobody waits
                loop.call_soon_threadsafe(_resolve, future)

    def available(self, role: str) -> bool:
        """False once the role's router has seen no running replica. Unknown (no router yet,
        i.e. no call made) counts as available: the first call finds out."""
        with self._lock:
            return role not in self._replicas or bool(self._replicas[role])

    def replica_ids(self, role: str) -> list[str] | None:
        """The role's running replicas; None while unknown (no call made yet)."""
        with self._lock:
            ids = self._replicas.get(role)
        return None if ids is None else list(ids)

    async def gone(self, role: str) -> None:
        """Returns when the role has no running replica (at once if it has none now)."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[None] = loop.create_future()
        with self._lock:
            if role in self._replicas and not self._replicas[role]:
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

    def replica_ids(self) -> list[str] | None:
        return self._sets.replica_ids(self.role)
