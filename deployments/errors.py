"""The errors a request can end with, and what a client may read of them.

Clients get our own messages (bad input, a deadline, an engine that failed) and a generic line
for anything else: Ray's exception texts carry actor ids, ANSI colour codes and tracebacks,
which are for the operator's log, not for an API client.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import grpc

_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
INTERNAL_ERROR = "internal error; the server log has the details"


class DeadlineExceeded(TimeoutError):
    """The request ran past its deadline; it was aborted on the engines."""


class RetryLater(RuntimeError):
    """A refusal that a retry may cure, with the seconds after which it may (HTTP's
    Retry-After; over gRPC the message says it: Serve's proxy drops a failed call's trailing
    metadata)."""

    def __init__(self, message: str, retry_after_s: float = 1.0) -> None:
        self.retry_after_s = retry_after_s
        super().__init__(f"{message} (retry after {self.retry_after} s)")

    @property
    def retry_after(self) -> int:
        """Whole seconds, at least 1 (HTTP's Retry-After)."""
        return max(1, math.ceil(self.retry_after_s))


class Overloaded(RetryLater):
    """An engine or the router is at its admission bound: RESOURCE_EXHAUSTED / HTTP 429."""


class Unavailable(RetryLater):
    """No engine replica runs yet (the model loading, GPU nodes still joining, every replica
    restarting): UNAVAILABLE / HTTP 503 at once, instead of a request held until one starts."""


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


@dataclass(frozen=True)
class Status:
    """How both front ends end a request with an error: the gRPC code, and the HTTP status
    with OpenAI's error type."""

    grpc_code: grpc.StatusCode
    http_status: int
    http_type: str

    @property
    def internal(self) -> bool:
        """Our failure, not the request's: logged with its traceback, told in a generic line."""
        return self is INTERNAL


INTERNAL = Status(grpc.StatusCode.INTERNAL, 500, "server_error")
# The one table of what each error is on the wire (gRPC in router/router.py, HTTP in
# router/openai_api.py and openai_format.py). Anything else is INTERNAL.
STATUSES: tuple[tuple[type[BaseException], Status], ...] = (
    (ValueError, Status(grpc.StatusCode.INVALID_ARGUMENT, 400, "invalid_request_error")),
    (DeadlineExceeded, Status(grpc.StatusCode.DEADLINE_EXCEEDED, 504, "timeout")),
    (EngineFailure, Status(grpc.StatusCode.UNAVAILABLE, 503, "server_error")),
    (Overloaded, Status(grpc.StatusCode.RESOURCE_EXHAUSTED, 429, "rate_limit_error")),
    (Unavailable, Status(grpc.StatusCode.UNAVAILABLE, 503, "server_error")),
    (Unauthenticated, Status(grpc.StatusCode.UNAUTHENTICATED, 401, "invalid_request_error")),
)


def status_of(exc: BaseException) -> Status:
    return next((status for kind, status in STATUSES if isinstance(exc, kind)), INTERNAL)


def public_message(exc: BaseException) -> str:
    """What a client may read about `exc`: our own words, or a generic line."""
    if status_of(exc).internal:
        return INTERNAL_ERROR
    return _ANSI.sub("", str(exc))
