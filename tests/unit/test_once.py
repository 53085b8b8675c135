"""deployments/cluster/once.py: computed on the first read only, kept per instance, and
usable on a frozen dataclass (as CacheSurvey uses it)."""

from __future__ import annotations

from dataclasses import dataclass

from deployments.cluster.once import once


@dataclass(frozen=True)
class Answer:
    x: int
    calls: list[int]

    @once
    def doubled(self) -> int:
        """Twice x."""
        self.calls.append(self.x)
        return 2 * self.x


def test_computed_once_per_instance_and_kept() -> None:
    calls: list[int] = []
    a, b = Answer(1, calls), Answer(2, calls)
    assert (a.doubled, a.doubled, b.doubled, a.doubled) == (2, 2, 4, 2)
    assert calls == [1, 2]
    assert a.__dict__["doubled"] == 2


def test_read_on_the_class_it_is_the_descriptor() -> None:
    assert isinstance(Answer.doubled, once)
    assert Answer.doubled.__doc__ == "Twice x."
