"""How `pdserve bench chaos` files each request it sent: in exactly one outcome, counted
under a lock (many client threads), and whether the outcomes add up to the requests sent."""

from __future__ import annotations

import threading
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

# What a clear error never shows: Ray's internals, colour codes, a traceback.
INTERNALS = ("actor", "Traceback", "\x1b[", "ray.", "RayTaskError")

OUTCOMES = (
    "exact",
    "mismatch",
    "cancelled",
    "refused",
    "accepted_malformed",
    "failed_clear",
    "failed_unclear",
    "timed_out",
    "lost",
)


@dataclass
class Tally:
    counts: Counter[str] = field(default_factory=Counter)
    unclear: list[str] = field(default_factory=list)
    migrations: int = 0  # over the completed requests
    migrated_requests: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, outcome: str, message: str = "", migrations: int = 0) -> None:
        assert outcome in OUTCOMES, outcome
        with self.lock:
            self.counts[outcome] += 1
            self.migrations += migrations
            self.migrated_requests += migrations > 0
            if outcome == "failed_unclear" and len(self.unclear) < 5:
                self.unclear.append(message[:300])


def outcomes(tally: Tally, requests: int) -> dict[str, Any]:
    """The requests sent, each in its one outcome, whether those add up; the migrations."""
    counts = tally.counts
    total = sum(counts[outcome] for outcome in OUTCOMES)
    return {
        "requests": requests,
        "outcomes_total": total,
        "outcomes_add_up": total == requests,
        "migrations": tally.migrations,
        "migrated_requests": tally.migrated_requests,
        "completed": counts["exact"] + counts["mismatch"],
        "completed_exact": counts["exact"],
        "completed_mismatch": counts["mismatch"],
        "cancelled": counts["cancelled"],
        "malformed_refused": counts["refused"],
        "malformed_accepted": counts["accepted_malformed"],
        "failed_clear": counts["failed_clear"],
        "failed_unclear": counts["failed_unclear"],
        "unclear_examples": tally.unclear,
        "timed_out": counts["timed_out"],
        "lost": counts["lost"],
    }


def classify_rpc_error(exc: Any, tally: Tally, cancelled: bool) -> None:
    """File a request that ended in a gRPC error: cancelled by us, lost (the client's own
    deadline), timed out (the server's), failed clearly or not (internals in the message)."""
    import grpc

    code, details = rpc_status(exc)
    if code is None:  # an RpcError that is not a call's (no status): counted, never raised
        tally.add("failed_unclear", f"{type(exc).__name__}: {exc}")
    elif code == grpc.StatusCode.CANCELLED and cancelled:
        tally.add("cancelled")
    elif code == grpc.StatusCode.DEADLINE_EXCEEDED and details == "Deadline Exceeded":
        tally.add("lost")  # grpc's own deadline: the server never answered
    elif code == grpc.StatusCode.DEADLINE_EXCEEDED:
        tally.add("timed_out")  # the server's deadline: answered, but a hang would show here
    elif any(mark in details for mark in INTERNALS):
        tally.add("failed_unclear", f"{code.name}: {details}")
    else:
        tally.add("failed_clear")


def rpc_status(exc: Any) -> tuple[Any, str]:
    """An RpcError's status code and details; (None, "") for one raised without a call."""
    code, details = getattr(exc, "code", None), getattr(exc, "details", None)
    if not callable(code):
        return None, ""
    return code(), (details() if callable(details) else "") or ""
