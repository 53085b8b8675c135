"""Leases: a prefill engine keeps a finished request's blocks for a reader, for a while.

A lease is live until released, cancelled (the request was aborted) or expired (nobody
renewed it). The engine frees the blocks of every lease reported by `take_finished`, exactly
once; a lease whose blocks are being streamed is reported only once the stream has stopped.

Fencing: a lease records each block's generation (KVCacheBlock.generation) when it is made.
A block whose generation moved since was freed or rewritten under the lease — whatever the
lease's bookkeeping says, its bytes are not the ones lent — and reads of it are refused
(BlocksRewritten), also after the bytes were copied: a read is good only if the generations
are unchanged once it has ended (a renewal, the last chunk's check, the release say so).
"""

from __future__ import annotations

import secrets
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace

import grpc

_MAX_TOMBSTONES = 4096


class LeaseError(Exception):
    code = grpc.StatusCode.FAILED_PRECONDITION


class LeaseNotFound(LeaseError):
    code = grpc.StatusCode.NOT_FOUND


class LeaseExpired(LeaseError):
    code = grpc.StatusCode.FAILED_PRECONDITION


class BlocksNotLeased(LeaseError):
    code = grpc.StatusCode.PERMISSION_DENIED


class BlocksRewritten(LeaseError):
    """A leased block's generation moved: what a reader has of it may not be what was lent."""

    code = grpc.StatusCode.FAILED_PRECONDITION


def no_generations(block_id: int) -> int:
    """The generation source of an engine that has not given its own: nothing ever moves."""
    return 0


@dataclass(frozen=True)
class Lease:
    lease_id: str
    request_id: str
    block_ids: frozenset[int]
    expires_at: float  # on the table's clock (time.monotonic)
    lease_seconds: float


@dataclass
class _Entry:
    lease: Lease
    generations: dict[int, int]  # block id -> its generation when the lease was made
    ended: str | None = None  # "released" | "expired" | "cancelled"
    readers: int = 0  # ReadBlocks streams copying from these blocks right now
    fenced: bool = False  # a block of it was found rewritten


class LeaseTable:
    """Leases on finished requests' blocks. Thread-safe (side-channel threads + engine thread).

    A lease ends by release, expiry (checked against the clock on every access) or
    `cancel_request`. Its request id is then reported once by `take_finished` — but only after
    every ReadBlocks stream copying from its blocks has stopped, so the engine never frees a
    block while it is being read.
    """

    def __init__(
        self,
        clock: Callable[[], float] = time.monotonic,
        generation_of: Callable[[int], int] = no_generations,
    ) -> None:
        self._clock = clock
        self._generation_of = generation_of
        # Leases found with a rewritten block (each fenced its reader's read; counted once
        # however many renewals, reads and releases were then refused).
        self.fences = 0
        # Leases that ran out unreleased: the reader never came, or came too late.
        self.expirations = 0
        self._lock = threading.Lock()
        self._entries: dict[str, _Entry] = {}
        self._by_request: dict[str, str] = {}  # request id -> lease id
        self._tombstones: OrderedDict[str, str] = OrderedDict()  # lease id -> how it ended

    def add(self, request_id: str, block_ids: Iterable[int], lease_seconds: float) -> Lease:
        if lease_seconds <= 0:
            raise ValueError(f"lease_seconds must be > 0, got {lease_seconds!r}")
        with self._lock:
            if request_id in self._by_request:
                raise ValueError(f"request {request_id!r} already holds a lease")
            lease = Lease(
                secrets.token_hex(16),
                request_id,
                frozenset(block_ids),
                self._clock() + lease_seconds,
                lease_seconds,
            )
            generations = {b: self._generation_of(b) for b in lease.block_ids}
            self._entries[lease.lease_id] = _Entry(lease, generations)
            self._by_request[request_id] = lease.lease_id
            return lease

    def renew(self, lease_id: str) -> Lease:
        """Extend a live lease by its lease period; raises LeaseNotFound / LeaseExpired, and
        BlocksRewritten when a block moved (a read in flight must not be used)."""
        with self._lock:
            entry = self._live(lease_id)
            self._check_unmoved(entry, entry.generations)
            entry.lease = replace(entry.lease, expires_at=self._clock() + entry.lease.lease_seconds)
            return entry.lease

    def release(self, lease_id: str) -> bool:
        """End a lease; True when it was live and every block still held what was lent (a
        read that ended before this call may be used). Idempotent."""
        with self._lock:
            entry = self._entries.get(lease_id)
            if entry is None or self._ended(entry) is not None:
                return False
            entry.ended = "released"
            return not self._moved(entry, entry.generations)

    def cancel_request(self, request_id: str) -> bool:
        """End the request's lease (the request was aborted); it is reported by take_finished."""
        with self._lock:
            entry = self._entries.get(self._by_request.get(request_id, ""))
            if entry is None or entry.ended is not None:
                return False
            entry.ended = "cancelled"
            return True

    def take_finished(self) -> set[str]:
        """Request ids whose lease ended since the last call and whose blocks nobody reads."""
        with self._lock:
            self._expire_locked()
            done = [e for e in self._entries.values() if e.ended and e.readers == 0]
            for entry in done:
                self._forget(entry)
            return {entry.lease.request_id for entry in done}

    @property
    def num_active(self) -> int:
        """Leases whose blocks are still held: live, or ended but not yet taken."""
        with self._lock:
            return len(self._entries)

    def open_read(self, lease_id: str, block_ids: Iterable[int]) -> Lease:
        """Check that `block_ids` are under a live lease and hold its blocks until close_read."""
        with self._lock:
            entry = self._live(lease_id)
            missing = sorted(set(block_ids) - entry.lease.block_ids)
            if missing:
                raise BlocksNotLeased(f"blocks {missing[:8]} are not under lease {lease_id}")
            entry.readers += 1
            return entry.lease

    def check_live(self, lease_id: str, block_ids: Iterable[int] = ()) -> None:
        """The lease is live and `block_ids` (under it) still hold what was lent; raises."""
        with self._lock:
            entry = self._live(lease_id)
            self._check_unmoved(entry, block_ids)

    def close_read(self, lease_id: str) -> None:
        with self._lock:
            entry = self._entries.get(lease_id)
            if entry is not None and entry.readers > 0:
                entry.readers -= 1

    def _live(self, lease_id: str) -> _Entry:
        entry = self._entries.get(lease_id)
        ended = self._ended(entry) if entry is not None else self._tombstones.get(lease_id)
        if ended == "expired":
            raise LeaseExpired(f"lease {lease_id} expired")
        if entry is None or ended is not None:
            raise LeaseNotFound(f"lease {lease_id!r} is {ended or 'unknown'}")
        return entry

    def _moved(self, entry: _Entry, block_ids: Iterable[int]) -> list[int]:
        generation_of, generations = self._generation_of, entry.generations
        moved = [b for b in block_ids if generation_of(b) != generations[b]]
        if moved and not entry.fenced:
            entry.fenced = True
            self.fences += 1
        return moved

    def _check_unmoved(self, entry: _Entry, block_ids: Iterable[int]) -> None:
        moved = self._moved(entry, block_ids)
        if moved:
            raise BlocksRewritten(
                f"blocks {moved[:8]} under lease {entry.lease.lease_id} were freed or "
                "rewritten since they were lent"
            )

    def _ended(self, entry: _Entry) -> str | None:
        """How the lease ended, None while live; expiry is checked here, on every access."""
        if entry.ended is None and entry.lease.expires_at <= self._clock():
            self._expire(entry)
        return entry.ended

    def _expire_locked(self) -> list[Lease]:
        now = self._clock()
        expired = [
            e for e in self._entries.values() if e.ended is None and e.lease.expires_at <= now
        ]
        for entry in expired:
            self._expire(entry)
        return [entry.lease for entry in expired]

    def _expire(self, entry: _Entry) -> None:
        entry.ended = "expired"
        self.expirations += 1

    def _forget(self, entry: _Entry) -> None:
        del self._entries[entry.lease.lease_id]
        del self._by_request[entry.lease.request_id]
        self._tombstones[entry.lease.lease_id] = entry.ended or "released"
        while len(self._tombstones) > _MAX_TOMBSTONES:
            self._tombstones.popitem(last=False)


# ---------------------------------------------------------------------------------- server
