"""`once`: functools.cached_property without the lock Python 3.11's takes.

A routing decision reads two of a survey's answers once each (kv_scoring.CacheSurvey), and on
3.11 each first read took an RLock (3.12 dropped it): ~0.8 us against ~0.4 here. A survey is
read by one request's task, so there is nothing to lock against: two threads reading one
answer first would both compute it, alike, and one would be kept.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Generic, TypeVar, overload

T = TypeVar("T")


class once(Generic[T]):  # (lower case: named as the decorator it stands in for)
    """A method computed on first read and kept in the instance's __dict__ (which, this
    being a non-data descriptor, later reads find first). Works on frozen dataclasses too."""

    def __init__(self, compute: Callable[[Any], T]) -> None:
        self._compute = compute
        self._name = compute.__name__
        self.__doc__ = compute.__doc__

    def __set_name__(self, owner: type, name: str) -> None:
        self._name = name

    @overload
    def __get__(self, instance: None, owner: type | None = None) -> once[T]: ...
    @overload
    def __get__(self, instance: object, owner: type | None = None) -> T: ...
    def __get__(self, instance: object | None, owner: type | None = None) -> T | once[T]:
        if instance is None:
            return self
        value = instance.__dict__[self._name] = self._compute(instance)
        return value
