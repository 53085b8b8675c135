"""`pdserve bench chaos`'s filing of requests: each in one outcome, whatever the error."""

from __future__ import annotations

import grpc
import pytest

from pdserve.bench.chaos_outcomes import OUTCOMES, Tally, classify_rpc_error, outcomes


class _CallError(grpc.RpcError):
    """An RpcError as a call raises it: with a status code and details."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        self._code, self._details = code, details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


@pytest.mark.parametrize(
    ("exc", "cancelled", "outcome"),
    [
        (_CallError(grpc.StatusCode.CANCELLED, "Cancelled"), True, "cancelled"),
        (_CallError(grpc.StatusCode.CANCELLED, "Cancelled"), False, "failed_clear"),
        (_CallError(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded"), False, "lost"),
        (_CallError(grpc.StatusCode.DEADLINE_EXCEEDED, "timed out after 60 s"), False, "timed_out"),
        (
            _CallError(grpc.StatusCode.UNAVAILABLE, "the decode engine is gone"),
            False,
            "failed_clear",
        ),
        (
            _CallError(grpc.StatusCode.INTERNAL, "Traceback (most recent call last)"),
            False,
            "failed_unclear",
        ),
        (
            _CallError(grpc.StatusCode.INTERNAL, "ray.exceptions.RayActorError"),
            False,
            "failed_unclear",
        ),
        # Raised without a call (no status at all): counted as unclear, never raised again.
        (grpc.RpcError("channel closed"), False, "failed_unclear"),
    ],
)
def test_every_rpc_error_lands_in_one_outcome(exc, cancelled, outcome):
    tally = Tally()
    classify_rpc_error(exc, tally, cancelled=cancelled)
    assert dict(tally.counts) == {outcome: 1}


def test_outcomes_add_up_only_when_every_request_was_filed():
    tally = Tally()
    for outcome in OUTCOMES:
        tally.add(outcome, "x", migrations=1 if outcome == "exact" else 0)
    report = outcomes(tally, requests=len(OUTCOMES))
    assert report["outcomes_add_up"] and report["outcomes_total"] == len(OUTCOMES)
    assert report["migrations"] == 1 and report["migrated_requests"] == 1
    assert not outcomes(tally, requests=len(OUTCOMES) + 1)["outcomes_add_up"]  # one was dropped
    with pytest.raises(AssertionError):
        tally.add("vanished")
