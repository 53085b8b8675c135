"""An engine replica's role at runtime (deployments/cluster/role_balance.py says why and when).

A switch, ordered by the KV index (the app's balancer, or an operator's `order_switch`) or
called on the replica (`EngineServer.switch_role`):
1. **Announce.** The role changes at once and the replica's KV publisher announces it (a
   snapshot, within 20 ms): routers take it out of the old role's candidates and into the
   new one's. The role's epoch counts the switches.
2. **Drain.** Every request admitted before the switch (the old role's legs) runs on; one still
   generating after `drain_timeout_s` moves at its next token: its stream ends with an error,
   and the Router moves it to another engine from its prompt and the tokens generated so far
   (migration.py: token-exact; a move counts against the request's `max_migrations`, which
   is why the app refuses role switching with migration off). A prefill leg is one step:
   it ends where it started.
3. **Fence.** KV the replica handed out as a prefill replica (blocks held for a decode
   reader) stays readable under its lease until read or expired, never freed early: a
   switch out of the prefill role is done when those are gone too (or when their leases
   must have expired).

Every engine computes prompts and generates tokens alike: the role only steers the routers,
which is why a switch needs neither a restart nor a new engine.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from deployments.cluster.role_balance import ROLES as SWITCHABLE
from engine.outputs import EngineCoreOutput
from engine.request import FinishReason

MOVED = "the engine replica changed role; the request moves to another engine"


@dataclass
class SwitchReport:
    role: str
    previous_role: str
    epoch: int  # the role's, after the switch
    drained: int = 0  # old-role requests that finished on this replica
    moved: int = 0  # old-role requests moved after drain_timeout_s
    held_requests_at_end: int = 0  # handed-off KV still held (leases past the wait)
    seconds: float = 0.0


@dataclass
class _Leg:
    epoch: int  # the role's epoch the request was admitted in
    deadline: float = float("inf")  # when it moves (set by a switch)


@dataclass
class RoleState:
    """The replica's role, its epoch, and its requests by epoch (any thread)."""

    role: str
    drain_timeout_s: float = 30.0
    # The app switches roles (its Router places legs by role): elsewhere a switched replica
    # would be left out by its deployment's router and reached by no other.
    enabled: bool = True
    announce: Callable[[str], None] = lambda role: None  # the KV publisher's announce_role
    epoch: int = 0  # one more per switch
    moved: int = 0
    _legs: dict[int, _Leg] = field(default_factory=dict)  # by admission
    _admitted: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def switch(self, role: str) -> int:
        """Take `role` now (ValueError for a role engines cannot take); the new epoch."""
        if role not in SWITCHABLE:
            raise ValueError(f"an engine replica switches to one of {SWITCHABLE}, not {role!r}")
        with self._lock:
            if role == self.role:
                return self.epoch
            if self.role not in SWITCHABLE or not self.enabled:
                raise ValueError(f"this {self.role} engine replica's app does not switch roles")
            self.role, self.epoch = role, self.epoch + 1
            deadline = time.monotonic() + self.drain_timeout_s
            for leg in self._legs.values():
                leg.deadline = min(leg.deadline, deadline)
            # Under the lock: two switches at once (an order, a call) announce in order.
            self.announce(role)
            return self.epoch

    def admit(self) -> int:
        """A request came in: its key (both legs of a request share its id)."""
        with self._lock:
            self._admitted += 1
            self._legs[self._admitted] = _Leg(self.epoch)
            return self._admitted

    def finish(self, key: int) -> None:
        with self._lock:
            self._legs.pop(key, None)

    def must_move(self, key: int) -> bool:
        """Whether the request outstayed its drain: it ends here, counted as moved."""
        leg = self._legs.get(key)
        if leg is None or time.monotonic() < leg.deadline:
            return False
        with self._lock:
            self.moved += 1
        return True

    def older_than(self, epoch: int) -> int:
        """Requests admitted before `epoch` still running here."""
        with self._lock:
            return sum(1 for leg in self._legs.values() if leg.epoch < epoch)


def moved_output(request_id: str) -> EngineCoreOutput:
    """The last output of a request that moves: the Router's migration takes it up."""
    return EngineCoreOutput(request_id, [], finish_reason=FinishReason.ERROR, error=MOVED)


async def wait_switched(
    state: RoleState,
    report: SwitchReport,
    held_requests: Callable[[], int],
    lease_s: float,
    poll_s: float = 0.05,
) -> dict[str, Any]:
    """Wait until the requests of the epochs before the report's are gone (finished or moved) and
    the KV handed out before it is read or its leases must have run out; what it took."""
    start, epoch = time.monotonic(), report.epoch
    before = state.older_than(epoch)
    moved_before = state.moved
    drain_end = start + state.drain_timeout_s + 1.0  # moves happen at the next token
    while state.older_than(epoch) and time.monotonic() < drain_end:
        await asyncio.sleep(poll_s)
    fence_end = start + max(state.drain_timeout_s, lease_s)
    # Only a prefill replica hands KV out (a loan's blocks are leased like it, briefly).
    while report.previous_role == "prefill" and held_requests() and time.monotonic() < fence_end:
        await asyncio.sleep(poll_s)
    report.moved = state.moved - moved_before
    report.drained = max(0, before - report.moved - state.older_than(epoch))
    report.held_requests_at_end = held_requests()
    report.seconds = round(time.monotonic() - start, 3)
    return asdict(report)
