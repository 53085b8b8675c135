"""Carrying an engine replica's prefix-cache events to the app's KV index (deployments/kv_index).

A daemon thread of the replica, every `period_s`: the batches the engine loop took since the
last round go to the index actor in one call; when the index answers that it cannot trust this
replica (lost batches, a restart, an index that restarted) or the call fails, the next round
sends a snapshot instead. The first round always sends one: it announces the replica.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from engine.async_engine import AsyncEngine

logger = logging.getLogger(__name__)

_CALL_TIMEOUT_S = 10.0


class KVEventPublisher:
    def __init__(
        self, engine: AsyncEngine, replica_id: str, app_name: str, period_s: float = 0.02
    ) -> None:
        self._engine = engine
        self._replica_id = replica_id
        self._app_name = app_name
        self._period_s = period_s
        self._index: Any = None
        self._needs_snapshot = True
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kv-events", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        failing = False
        while not self._stop.wait(self._period_s):
            try:
                self._publish()
                failing = False
            except Exception as exc:  # the index is best effort: routing falls back to load
                if not failing:
                    logger.warning("publishing KV events to the index failed: %s", exc)
                failing = True
                self._index = None  # look it up again: it may have been recreated
                self._needs_snapshot = True

    def _publish(self) -> None:
        import ray

        from deployments.kv_index import get_index_actor

        if self._engine.dead is not None:
            self._stop.set()
            return
        if self._index is None:
            self._index = get_index_actor(self._app_name)
        if self._needs_snapshot:
            self._engine.take_kv_event_batches()  # covered by the snapshot
            snapshot = self._engine.kv_snapshot().result(timeout=_CALL_TIMEOUT_S)
            ray.get(
                self._index.load_snapshot.remote(self._replica_id, snapshot),
                timeout=_CALL_TIMEOUT_S,
            )
            self._needs_snapshot = False
            return
        batches = self._engine.take_kv_event_batches()
        if batches:
            applied = self._index.apply.remote(self._replica_id, batches)
            self._needs_snapshot = not ray.get(applied, timeout=_CALL_TIMEOUT_S)
