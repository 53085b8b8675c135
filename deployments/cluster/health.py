"""Health of the whole app: every replica of every engine role, not one Serve happens to pick.

The roles' request routers publish their replica sets (deployments/cluster/replica_set.py); a probe
names one replica (`ReplicaProbe.replica_hint`) and the router sends it there alone. A replica
that does not answer in time is reported `unreachable` (dead, restarting, or its loop wedged),
with no figures. No Ray import here: the probe is a callable, so tests run it in-process.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from deployments.cluster.replica_set import ReplicaSets

logger = logging.getLogger(__name__)

RUNNING = "running"
UNREACHABLE = "unreachable"

SERVING = "SERVING"
DEGRADED = "DEGRADED"
NOT_SERVING = "NOT_SERVING"

# (role, replica id or "" for whichever replica Serve picks) -> EngineServer.stats(), or
# another call that names the replica that answered (`replica_id`)
Probe = Callable[[str, str], Awaitable[dict[str, Any]]]
# A health answer is reused this long: probes, load balancers and anyone unauthenticated cost
# the engines at most one survey per second per router replica, however often they ask.
HEALTH_TTL_S = 1.0


@dataclass
class HealthReport:
    status: str
    engines: list[dict[str, Any]]  # pdserve.v1.EngineStats fields


async def survey(
    roles: Sequence[str], sets: ReplicaSets, probe: Probe, timeout_s: float = 2.0
) -> HealthReport:
    """Every replica's stats. The app serves while some engine of any role answers: every
    engine can generate a whole request (a prefill replica takes over when no decode replica
    runs, and the reverse)."""
    engines = await ask_every_replica(roles, sets, probe, timeout_s)
    return HealthReport(_status(roles, engines), engines)


async def ask_every_replica(
    roles: Sequence[str], sets: ReplicaSets, probe: Probe, timeout_s: float = 2.0
) -> list[dict[str, Any]]:
    """`probe`'s answer from every replica of each role (the roles concurrently), each with
    `state` running, or a stand-in saying it is unreachable. Where a role's set is not known
    yet (its router has routed nothing) one probe goes to whichever replica Serve picks."""
    per_role = await asyncio.gather(
        *(_ask_each(probe, role, _replicas(sets, role), timeout_s) for role in roles)
    )
    return [engine for engines in per_role for engine in engines]


def _status(roles: Sequence[str], engines: list[dict[str, Any]]) -> str:
    """SERVING: every role has replicas and each answered. DEGRADED: some engine answered. A
    role whose router has seen no running replica (all starting, say) has no entry, so an app
    with none running is NOT_SERVING, never SERVING for want of anyone to ask."""
    answered = [e for e in engines if e["state"] == RUNNING]
    if not answered:
        return NOT_SERVING
    if len(answered) == len(engines) and {e["role"] for e in answered} >= set(roles):
        return SERVING
    return DEGRADED


def _replicas(sets: ReplicaSets, role: str) -> list[str]:
    """The role's published replicas ("" once: any replica, while not known yet)."""
    ids = sets.replica_ids(role)
    return [""] if ids is None else ids


async def _ask_each(
    probe: Probe, role: str, replicas: list[str], timeout_s: float
) -> list[dict[str, Any]]:
    """One replica after another: calls that one request makes to one deployment at once
    share Serve's internal request id, and a request router without Serve's FIFO mixin
    (KVAwareRouter) may then hand one call's replica to another and spin (Ray 2.60)."""
    engines = []
    for replica in replicas:
        answer = await _ask(probe, role, replica, timeout_s)
        engines.append(answer if answer is not None else _unreachable(role, replica))
    return engines


async def _ask(probe: Probe, role: str, replica: str, timeout_s: float) -> dict[str, Any] | None:
    try:
        async with asyncio.timeout(timeout_s):
            stats = await probe(role, replica)
    except Exception as exc:  # dead, restarting, wedged: reported, never raised
        logger.info("health probe of %s replica %s: %r", role, replica or "(any)", exc)
        return None
    if replica and stats.get("replica_id") != replica:
        return None  # gone from Serve's set: another replica answered in its place
    return {**stats, "state": RUNNING}


def _unreachable(role: str, replica: str) -> dict[str, Any]:
    return {"role": role, "replica_id": replica, "state": UNREACHABLE}


class CachedHealth:
    """One survey at a time, its report reused for `ttl_s`: concurrent callers share the survey
    in flight, later ones its answer (`/health` and gRPC `Health` are open to anyone)."""

    def __init__(
        self,
        survey_once: Callable[[], Awaitable[HealthReport]],
        ttl_s: float = HEALTH_TTL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._survey_once, self._ttl_s, self._clock = survey_once, ttl_s, clock
        self._report: HealthReport | None = None
        self._at = float("-inf")
        self._pending: asyncio.Future[HealthReport] | None = None
        self.surveys = 0  # surveys run (tests read it)

    async def report(self) -> HealthReport:
        if self._report is not None and self._clock() - self._at < self._ttl_s:
            return self._report
        if self._pending is None:
            self._pending = asyncio.ensure_future(self._refresh())
        # Shielded: a caller that gives up does not cancel the survey the others wait for.
        return await asyncio.shield(self._pending)

    async def _refresh(self) -> HealthReport:
        try:
            self.surveys += 1
            report = await self._survey_once()
            self._report, self._at = report, self._clock()
            return report
        finally:
            self._pending = None
