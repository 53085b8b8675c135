"""Files that are read again when they change — a mounted Kubernetes Secret, rotated in place
(kubelet swaps a symlink; a rename replaces a file) — looked at no more than once a period.

Used for the API key file (deployments/credentials.py) and the side channel's certificates
(connector/side_channel.py): `changed()` gives the files' new state when it differs from the
last one `accept`ed, so a caller whose read failed (a file caught mid-rotation) simply does not
accept it, and tries again a period later.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence

# (inode, size, mtime) of each file; a missing file reads as (-1, -1, -1).
Stamp = tuple[tuple[int, int, int], ...]
_MISSING = (-1, -1, -1)


class FileWatch:
    def __init__(
        self,
        paths: Sequence[str],
        period_s: float,
        clock: Callable[[], float] | None = None,
    ) -> None:
        self._paths = tuple(paths)
        self._period_s = period_s
        self._clock = clock if clock is not None else time.monotonic
        self._checked_at = float("-inf")
        self._accepted: Stamp | None = None  # none yet: the first look is a change

    def stamp(self) -> Stamp:
        """The files' state now (one stat each)."""
        return tuple(_stat(path) for path in self._paths)

    def changed(self) -> Stamp | None:
        """The files' new state, where the period has passed since the last look and it is not
        the state last accepted; else None."""
        now = self._clock()
        if now - self._checked_at < self._period_s:
            return None
        self._checked_at = now
        stamp = self.stamp()
        return None if stamp == self._accepted else stamp

    def accept(self, stamp: Stamp) -> None:
        """The state whose contents the caller now holds."""
        self._accepted = stamp


def _stat(path: str) -> tuple[int, int, int]:
    try:
        st = os.stat(path)
    except OSError:
        return _MISSING
    return (st.st_ino, st.st_size, st.st_mtime_ns)
