"""Per block hash, the replicas holding it (a bit mask: bit i for the replica numbered i), and
a prompt's walk over it: the storage under the prefix index (prefix_index.py).

Two implementations of one contract: `HolderTable`, C compiled on first use (csrc/
holder_table.c: entries holding their key and mask inline, side by side in the order their
prompts stored them, so that a walk mostly reads the next entry; csrc/holder_store.h), and
`DictHolders`, the same in Python (a dict of bytes to int), which is the reference the tests
hold the C one to and what runs where no C compiler is. `holders()` makes the first that
works here.

    add(key, bit)       the replica numbered `bit` holds `key`
    discard(key, bit)   it no longer does (a key nobody holds is dropped)
    get(key)            the mask of the replicas holding `key` (0: none)
    match(hashes)       the replicas holding at least the prompt's first block, by the leading
                        blocks they hold: [(blocks, mask)], fewest blocks first
    num_entries()       (key, replica) pairs held
    len()               keys held
"""

from __future__ import annotations

import functools
import itertools
import logging
import operator
from collections.abc import Sequence
from typing import Protocol

logger = logging.getLogger(__name__)

# A prompt's hashes are matched this many at a time (one C-level `and` over their masks),
# then one by one within the spans where replicas drop out.
_SPAN = 16
_ZEROS = itertools.repeat(0)


class Holders(Protocol):
    def add(self, key: bytes, bit: int) -> None: ...
    def discard(self, key: bytes, bit: int) -> None: ...
    def get(self, key: bytes) -> int: ...
    def match(self, hashes: Sequence[bytes]) -> list[tuple[int, int]]: ...
    def num_entries(self) -> int: ...
    def __len__(self) -> int: ...


class DictHolders:
    """The contract above in Python: the reference, and the fallback."""

    def __init__(self) -> None:
        self._masks: dict[bytes, int] = {}

    def add(self, key: bytes, bit: int) -> None:
        self._masks[key] = self._masks.get(key, 0) | 1 << bit

    def discard(self, key: bytes, bit: int) -> None:
        left = self._masks.get(key, 0) & ~(1 << bit)
        if left:
            self._masks[key] = left
        else:
            self._masks.pop(key, None)

    def get(self, key: bytes) -> int:
        return self._masks.get(key, 0)

    def match(self, hashes: Sequence[bytes]) -> list[tuple[int, int]]:
        """One walk of the prompt's hashes, narrowing the replicas holding every block so
        far, done where none holds the next."""
        groups: list[tuple[int, int]] = []
        get = self._masks.get
        alive = -1  # the replicas holding every block so far (at first: every bit)
        depth = 0
        for start in range(0, len(hashes), _SPAN):
            span = hashes[start : start + _SPAN]
            # One `and` of the span's masks in C: most spans narrow nothing.
            if functools.reduce(operator.and_, map(get, span, _ZEROS), alive) == alive:
                depth += len(span)
                continue
            for block_hash in span:
                held = alive & get(block_hash, 0)
                if held != alive:
                    if depth:
                        groups.append((depth, alive & ~held))
                    if not held:
                        return groups
                    alive = held
                depth += 1
        if depth:
            groups.append((depth, alive))
        return groups

    def num_entries(self) -> int:
        return sum(mask.bit_count() for mask in self._masks.values())

    def __len__(self) -> int:
        return len(self._masks)


def holders() -> Holders:
    """The C table where it builds here, else the Python one."""
    table = _native_table()
    return table() if table is not None else DictHolders()


@functools.cache
def _native_table() -> type | None:
    from deployments.cluster.native import NativeBuildError, load

    try:
        table: type = load("holder_table").HolderTable
        return table
    except NativeBuildError as exc:
        logger.warning("the KV index's holder table runs in Python: %s", exc)
        return None
