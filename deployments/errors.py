"""The errors a request can end with, and what a client may read of them.

Clients get our own messages (bad input, a deadline, an engine that failed) and a generic line
for anything else: Ray's exception texts carry actor ids, ANSI colour codes and tracebacks,
which are for the operator's log, not for an API client.
"""

from __future__ import annotations

import math
import re

_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
INTERNAL_ERROR = "internal error; the server log has the details"


class DeadlineExceeded(TimeoutError):
    """The request ran past its deadline; it was aborted on the engines."""


class Overloaded(RuntimeError):
    """An engine or the router is at its admission bound: RESOURCE_EXHAUSTED / HTTP 429, with
    the seconds after which a retry may succeed."""

    def __init__(self, message: str, retry_after_s: float = 1.0) -> None:
        self.retry_after_s = retry_after_s
        super().__init__(f"{message} (retry after {self.retry_after} s)")

    @property
    def retry_after(self) -> int:
        """Whole seconds, at least 1 (HTTP's Retry-After)."""
        return max(1, math.ceil(self.retry_after_s))


class Unauthenticated(PermissionError):
    """No valid API key (deployments/credentials.py): gRPC UNAUTHENTICATED / HTTP 401. The
    message never names the key the caller sent."""


class EngineFailure(RuntimeError):
    """An engine leg failed mid-request (its replica died, its loop stopped, it reported an
    error). The message is written for clients."""


def engine_failure(role: str, exc: BaseException) -> EngineFailure:
    """A client-safe EngineFailure for an exception raised by a call to an engine replica."""
    from ray.exceptions import RayActorError

    if isinstance(exc, RayActorError):
        reason = "its replica died or became unreachable"
    elif type(getattr(exc, "cause", None)).__name__ == "EngineDeadError":
        reason = "its engine loop stopped"
    else:
        reason = "it raised an internal error"
    return EngineFailure(f"the {role} engine failed mid-request: {reason}")


def public_message(exc: BaseException) -> str:
    """What a client may read about `exc`."""
    if isinstance(exc, (ValueError, DeadlineExceeded, EngineFailure, Overloaded, Unauthenticated)):
        return _ANSI.sub("", str(exc))
    return INTERNAL_ERROR
