"""engine/stop_strings.py against the definitions it indexes: every occurrence of every stop
string, and every string's every prefix."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from engine.stop_strings import StopStrings

TEXT = st.text(alphabet="ab c", max_size=12)
STOPS = st.lists(st.text(alphabet="ab c", min_size=1, max_size=5), min_size=1, max_size=6)


def first_to_complete(text: str, stops: list[str], new_from: int) -> tuple[str, int] | None:
    """The smallest (end, start) over all occurrences that end after `new_from`."""
    matches = [
        (start + len(stop), start, stop)
        for stop in stops
        for start in range(len(text) - len(stop) + 1)
        if text.startswith(stop, start) and start + len(stop) > new_from
    ]
    if not matches:
        return None
    _, start, stop = min(matches)
    return stop, start


@given(TEXT, STOPS, st.integers(0, 12))
def test_find_is_the_first_match_to_complete(text: str, stops: list[str], new_from: int) -> None:
    new_from = min(new_from, len(text))
    assert StopStrings(stops).find(text, new_from) == first_to_complete(text, stops, new_from)


@given(TEXT, STOPS, st.integers(0, 6))
def test_prefix_len_is_the_longest_suffix_that_begins_a_stop(
    text: str, stops: list[str], max_len: int
) -> None:
    expected = max(
        (
            n
            for n in range(1, min(max_len, len(text)) + 1)
            if any(s.startswith(text[-n:]) for s in stops)
        ),
        default=0,
    )
    assert StopStrings(stops).prefix_len(text, max_len) == expected


def test_many_strings_are_indexed_not_scanned() -> None:
    """100k strings (what an API caller may send): a match and a held-back prefix found."""
    stops = StopStrings([f"never seen {i}" for i in range(100_000)])
    assert stops.find("it was never seen 99999!", 0) == ("never seen 9", len("it was "))
    assert stops.prefix_len("and never se", stops.max_len) == len("never se")
    assert stops.max_len == len("never seen 99999")


@pytest.mark.parametrize("bad", ["stop", ["ok", ""], [3]])
def test_bad_stop_lists_are_refused(bad: object) -> None:
    with pytest.raises(ValueError, match="stop"):
        StopStrings(bad)  # type: ignore[arg-type]
