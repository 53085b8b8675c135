"""A request's stop strings, indexed once so that each new piece of text costs a few lookups
however many strings there are (an API may be sent 100k of them)."""

from __future__ import annotations

import bisect
from collections.abc import Sequence


def check_stop_strings(stop: Sequence[str]) -> None:
    """A list of non-empty strings, or a ValueError saying what is wrong."""
    if isinstance(stop, str):
        raise ValueError("stop must be a list of strings, not a single string")
    for text in stop:
        if not isinstance(text, str) or not text:
            raise ValueError(f"stop strings must be non-empty strings, got {text!r}")


class StopStrings:
    """Stop strings as a set (for "does one end here?") and a sorted tuple (for "does one
    begin with this?"). Per call the work is (new characters times distinct lengths) set lookups,
    or a binary search per held-back length, never a pass over every string."""

    def __init__(self, stop: Sequence[str]) -> None:
        check_stop_strings(stop)
        self._set = frozenset(stop)
        self._sorted = tuple(sorted(self._set))
        # Longest first: at one end position the longest match starts first.
        self._lengths = sorted({len(text) for text in self._set}, reverse=True)
        self.max_len = self._lengths[0] if self._lengths else 0

    def __bool__(self) -> bool:
        return bool(self._set)

    def find(self, text: str, new_from: int) -> tuple[str, int] | None:
        """The stop string that completes first in `text` among matches ending after
        `new_from`, and where it starts.

        "First to complete" (smallest end, then smallest start) does not depend on how the
        text was split into deltas, so streaming and one-shot decoding stop at the same place.
        """
        for end in range(new_from + 1, len(text) + 1):
            for length in self._lengths:
                if length <= end and text[end - length : end] in self._set:
                    return text[end - length : end], end - length
        return None

    def prefix_len(self, text: str, max_len: int) -> int:
        """Length of the longest suffix of `text` (at most `max_len`) that begins a stop
        string: in sorted order, the first string not below a suffix begins with it if any
        string does."""
        for length in range(min(max_len, len(text)), 0, -1):
            suffix = text[-length:]
            i = bisect.bisect_left(self._sorted, suffix)
            if i < len(self._sorted) and self._sorted[i].startswith(suffix):
                return length
        return 0
