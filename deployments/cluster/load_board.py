"""The KV index's load board: every replica it knows by reported load, least first, as a
lookup hands it out (`Holdings.board`, and per role), and the same laid out for the C search.

Why a packed copy: a search walks the board's least loaded replicas, reading each one's key,
bit and load. As Python objects those are an entry tuple, a float, an int, a Holding and an
EngineLoad with its numbers, each made when its load arrived and so each on a page of its
own: a walk over 35 replicas touched ~150 pages, and on a machine whose page walks are dear
(a virtual machine's nested paging) a decode leg's ranking took 23 us cold against 6 us warm
(`pdserve bench router-sim`). `PackedBoard` adds the same entries as one bytes object of fixed
records (and the replicas' names as one tuple), kept in step with the entries as loads
arrive: the copy belongs to the change, off the requests' path.
"""

from __future__ import annotations

import bisect
import math
import struct
from typing import Any

from deployments.cluster.kv_cost import load_key
from deployments.cluster.kv_holdings import Board
from engine.core.kv_events import EngineLoad

# One entry: its load_key, the engine's requests (running + waiting; NaN where it has not
# reported a load), its queued prompt tokens, its KV usage, its bit's position
# (deployments/cluster/csrc/search.h reads these records: keep the two in step).
RECORD = struct.Struct("<ddddq")


class PackedBoard(tuple):
    """A board (a tuple of (load_key, replica, bit), least first) with its entries packed:
    `packed`, a RECORD per entry in the same order, and `names`, each entry's replica."""

    packed: bytes
    names: tuple[str, ...]

    def __new__(
        cls, entries: Board | list[tuple[float, str, int]], packed: bytes, names: tuple[str, ...]
    ) -> PackedBoard:
        board = super().__new__(cls, entries)
        board.packed, board.names = packed, names
        return board

    def __reduce__(self) -> tuple[Any, ...]:  # crosses Ray's actor boundary with the answer
        return (PackedBoard, (tuple(self), self.packed, self.names))


def record(load: EngineLoad | None, bit: int) -> bytes:
    """A board entry's RECORD."""
    position = bit.bit_length() - 1
    if load is None:
        return RECORD.pack(load_key(None), math.nan, 0.0, 0.0, position)
    busy = float(load.num_running + load.num_waiting)
    queued, usage = float(load.queued_prompt_tokens), float(load.kv_cache_usage)
    return RECORD.pack(load_key(load), busy, queued, usage, position)


class LoadBoard:
    """Every replica the index knows as (`load_key`, replica, its bit), least first, kept
    sorted as loads change. `snapshot` is the board as a lookup hands it out (`Holdings.board`),
    made at each change: the copy belongs to the change, off the requests' path."""

    def __init__(self) -> None:
        # Each replica's entry and RECORD, as placed in `_sorted` and `_packed`.
        self._placed: dict[str, tuple[tuple[float, str, int], bytes]] = {}
        self._sorted: list[tuple[float, str, int]] = []
        self._names: list[str] = []  # in step with `_sorted`
        self._packed = bytearray()  # a RECORD per entry, in step with `_sorted`
        self.snapshot: Board = PackedBoard((), b"", ())

    def place(self, replica: str, load: EngineLoad | None, bit: int) -> None:
        entry = (load_key(load), replica, bit)
        packed = record(load, bit)
        old = self._placed.get(replica)
        if old == (entry, packed):
            return
        if old is not None:
            self._delete(bisect.bisect_left(self._sorted, old[0]))
        at = bisect.bisect_left(self._sorted, entry)
        self._sorted.insert(at, entry)
        self._names.insert(at, replica)
        self._packed[at * RECORD.size : at * RECORD.size] = packed
        self._placed[replica] = (entry, packed)
        self._snap()

    def remove(self, replica: str) -> None:
        old = self._placed.pop(replica, None)
        if old is not None:
            self._delete(bisect.bisect_left(self._sorted, old[0]))
            self._snap()

    def _delete(self, at: int) -> None:
        del self._sorted[at], self._names[at]
        del self._packed[at * RECORD.size : (at + 1) * RECORD.size]

    def _snap(self) -> None:
        self.snapshot = PackedBoard(self._sorted, bytes(self._packed), tuple(self._names))
