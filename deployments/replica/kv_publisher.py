"""Carrying an engine replica's prefix-cache events to the app's KV index
(deployments/cluster/kv_index.py).

A daemon thread of the replica, every `period_s`: the batches the engine loop took since the
last round, with the engine's load when it changed, go to the index actor in one call; an idle
replica still calls every `heartbeat_s`. When the index answers that it cannot trust this
replica (lost batches, a restart, an index that restarted and does not know it) or the call
fails, the next round sends a snapshot instead. The first round always sends one: it announces
the replica and its role, and so does the first round after the replica switched roles. The
index's answer may order a switch (deployments/cluster/role_balance.py): the serving layer's
`on_switch` carries it out.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from engine.async_engine import AsyncEngine
from engine.core.kv_events import BlockStored, EngineLoad, KVEventBatch

logger = logging.getLogger(__name__)

_CALL_TIMEOUT_S = 10.0


class KVEventPublisher:
    def __init__(
        self,
        engine: AsyncEngine,
        replica_id: str,
        app_name: str,
        role: str = "",
        side_channel: str = "",
        period_s: float = 0.02,
        heartbeat_s: float = 1.0,
        signals: ReplicaSignals | None = None,
    ) -> None:
        self._engine = engine
        self._replica_id = replica_id
        self._app_name = app_name
        self._role = role
        self._signals = signals or ReplicaSignals()
        self._side_channel = side_channel  # "host:port" other engines borrow prefixes from
        self._period_s = period_s
        self._heartbeat_s = heartbeat_s
        self._sent_load: Any = None
        self._sent_at = 0.0
        self._index: Any = None
        self._needs_snapshot = True
        self._announced_role = ""  # the role the index last heard (announce_role may move on)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kv-events", daemon=True)
        self._thread.start()

    def announce_role(self, role: str) -> None:
        """The replica took `role` (any thread): the next round announces it with a
        snapshot, within one period."""
        self._role = role

    def stop(self) -> None:
        """Stop publishing and take this replica out of the index (a replica scaled down)."""
        self._stop.set()
        self._thread.join(timeout=_CALL_TIMEOUT_S)
        if self._index is not None:
            self._index.forget.remote([self._replica_id])

    def _run(self) -> None:
        failures = 0
        while not self._stop.wait(self._period_s * (1 << min(failures, 8))):
            try:
                self._publish()
                failures = 0
            except Exception as exc:  # the index is best effort: routing falls back to load
                if not failures:
                    logger.warning("publishing KV events to the index failed: %s", exc)
                failures += 1  # back off (up to ~5 s): a snapshot walks every block
                self._index = None  # look it up again: it may have been recreated
                self._needs_snapshot = True

    def _publish(self) -> None:
        import ray

        from deployments.cluster.kv_index import get_index_actor

        if self._engine.dead is not None:
            self._stop.set()
            return
        if self._index is None:
            self._index = get_index_actor(self._app_name)
        if self._needs_snapshot or self._announced_role != self._role:
            self._engine.take_kv_event_batches()  # covered by the snapshot
            snapshot = self._engine.kv_snapshot().result(timeout=_CALL_TIMEOUT_S)
            load = self._load()
            role = self._role
            announce = self._index.load_snapshot.remote(
                self._replica_id,
                snapshot,
                role,
                load,
                self._side_channel,
                self._signals.role_switching,
            )
            ray.get(announce, timeout=_CALL_TIMEOUT_S)
            self._needs_snapshot, self._announced_role = False, role
            self._sent(load)
            return
        batches = [_lean(batch) for batch in self._engine.take_kv_event_batches()]
        load = self._load()
        due = time.monotonic() - self._sent_at >= self._heartbeat_s
        if batches or load != self._sent_load or due:
            published = self._index.publish.remote(self._replica_id, batches, load)
            reply = ray.get(published, timeout=_CALL_TIMEOUT_S)
            self._needs_snapshot = not reply.current
            self._sent(load)
            if reply.switch_to and reply.switch_to != self._role:
                self._signals.on_switch(reply.switch_to)

    def _load(self) -> EngineLoad:
        """The engine's load, with the replica's recent TTFT and TPOT means."""
        return self._signals.with_latencies(self._engine.stats.load)

    def _sent(self, load: Any) -> None:
        self._sent_load = load
        self._sent_at = time.monotonic()


@dataclass
class ReplicaSignals:
    """What the serving layer adds to an engine's rounds: its recent latencies (TTFT, TPOT
    means), the app's `role_switching` spec, and what to do when the index orders a switch
    (called on the publisher's thread)."""

    with_latencies: Callable[[EngineLoad], EngineLoad] = lambda load: load
    role_switching: dict[str, Any] | None = None
    on_switch: Callable[[str], None] = lambda role: None


def _lean(batch: KVEventBatch) -> KVEventBatch:
    """The batch without the stored blocks' token ids (the index needs only hashes)."""
    events = tuple(
        dataclasses.replace(e, token_ids=[]) if isinstance(e, BlockStored) else e
        for e in batch.events
    )
    return dataclasses.replace(batch, events=events)
