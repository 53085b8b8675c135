"""ReadWatch: the heartbeat of the KV reads in flight, from a thread of its own.

A read can stop making progress without anything telling us: the remote engine was killed
(its socket is gone), frozen (SIGSTOP, a stuck host: nothing answers), or it no longer holds
the blocks (its lease expired or was cancelled: the blocks may be rewritten under the read).
Neither the transport's own deadline (a minute, for big reads over slow links) nor the lease
(tens of seconds) should decide how long a request waits for that.

So every `period_s` each read that has run that long renews its lease with a short deadline
(`timeout_s`: kv_transfer_config.heartbeat_timeout_s, 0.75 s by default). A renewal keeps
the remote holding the blocks; its failure dooms the read, and the engine thread
(KVReads.get_finished) cancels it and hands its blocks to the load-failure policy: a read
that cannot complete is reported within period_s + timeout_s (1 s) of the remote going
quiet. Renewals run here, never on the engine thread, so a frozen remote never stalls
a step.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass

from connector.side_channel_client import SideChannelClient, SideChannelError

logger = logging.getLogger(__name__)

# A read is checked once it has run this long, then this often (most reads end before).
HEARTBEAT_PERIOD_S = 0.25


@dataclass(frozen=True)
class Doom:
    """Why a read cannot complete; `unreachable`: its remote stopped answering (rather than
    answering that it no longer holds the blocks)."""

    reason: str
    unreachable: bool


_SILENT = Doom("the remote engine stopped answering", True)


@dataclass(frozen=True)
class _Watched:
    request_id: str
    client: SideChannelClient
    lease_id: str
    started_at: float


class ReadWatch:
    """Thread-safe: the engine thread adds, removes and takes doomed reads; the watch's own
    thread renews. The thread starts with the first read and stops at `close()`."""

    def __init__(self, timeout_s: float, period_s: float = HEARTBEAT_PERIOD_S) -> None:
        self.period_s = period_s
        self.timeout_s = timeout_s
        self._lock = threading.Lock()
        self._reads: dict[str, _Watched] = {}
        self._doomed: dict[str, Doom] = {}  # by request id
        self._closed = threading.Event()
        self._thread: threading.Thread | None = None
        self.renewals = 0  # leases renewed by a heartbeat (the heartbeat ran)

    def add(self, request_id: str, client: SideChannelClient, lease_id: str) -> None:
        with self._lock:
            self._reads[request_id] = _Watched(request_id, client, lease_id, time.monotonic())
            if self._thread is None and not self._closed.is_set():
                self._thread = threading.Thread(
                    target=self._run, name="pdserve-read-watch", daemon=True
                )
                self._thread.start()

    def remove(self, request_id: str) -> None:
        with self._lock:
            self._reads.pop(request_id, None)
            self._doomed.pop(request_id, None)

    def take_doomed(self) -> dict[str, Doom]:
        """Reads found unable to complete since the last call (each once)."""
        with self._lock:
            doomed, self._doomed = self._doomed, {}
            return doomed

    def close(self) -> None:
        self._closed.set()
        thread = self._thread
        if thread is not None:
            thread.join(self.timeout_s + 5)

    def _run(self) -> None:
        while not self._closed.wait(self.period_s):
            try:
                self.beat()
            except Exception:  # the watch must outlive any one failure, or nothing is doomed
                logger.exception("KV read watch: a heartbeat failed")

    def beat(self, now: float | None = None) -> None:
        """Renew every read that has run for a period (by `now`, default the clock's); doom
        those whose remote failed."""
        now = time.monotonic() if now is None else now
        with self._lock:
            due = [w for w in self._reads.values() if now - w.started_at >= self.period_s]
        gone: set[SideChannelClient] = set()  # one silent renewal dooms its remote's reads
        for watched in due:
            doom = _SILENT if watched.client in gone else self._renew(watched)
            if doom is not None:
                if doom.unreachable:
                    gone.add(watched.client)
                self._doom(watched, doom)

    def _renew(self, watched: _Watched) -> Doom | None:
        """None when renewed; else why the read cannot complete."""
        try:
            watched.client.renew_lease(watched.lease_id, self.timeout_s)
        except SideChannelError as exc:
            if exc.lease_gone:
                return Doom(f"the remote engine no longer holds the blocks ({exc.message})", False)
            return Doom(f"the remote engine stopped answering ({exc.code.name})", True)
        self.renewals += 1
        return None

    def _doom(self, watched: _Watched, doom: Doom) -> None:
        request_id = watched.request_id
        with self._lock:
            # The read renewed, not a later one of the same request id.
            if self._reads.get(request_id) is watched:
                del self._reads[request_id]
                logger.warning("KV read for %s cannot complete: %s", request_id, doom.reason)
                self._doomed[request_id] = doom
