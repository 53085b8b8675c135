"""What a client may read of an error: our own messages, never Ray's internals."""

from __future__ import annotations

import grpc
import pytest
from ray.exceptions import ActorDiedError, RayTaskError

from deployments.errors import (
    INTERNAL_ERROR,
    DeadlineExceeded,
    EngineFailure,
    Overloaded,
    Unauthenticated,
    engine_failure,
    public_message,
    status_of,
)
from engine.async_engine import EngineDeadError


def test_a_dead_replica_is_named_without_ray_text() -> None:
    failure = engine_failure("decode", ActorDiedError())
    assert str(failure) == (
        "the decode engine failed mid-request: its replica died or became unreachable"
    )
    assert "actor" not in public_message(failure).lower()


def test_an_engine_whose_loop_stopped_says_so() -> None:
    cause = EngineDeadError("engine loop failed: boom at /home/me/secret.py")
    wrapped = RayTaskError("generate", "Traceback (most recent call last): ...", cause)
    message = public_message(engine_failure("prefill", wrapped))
    assert message == "the prefill engine failed mid-request: its engine loop stopped"


def test_anything_not_ours_is_a_generic_line() -> None:
    ray_text = "\x1b[36mray::ServeReplica\x1b[39m actor_id=ab12 Traceback ..."
    assert public_message(RuntimeError(ray_text)) == INTERNAL_ERROR
    assert public_message(KeyError("internal")) == INTERNAL_ERROR


@pytest.mark.parametrize(
    "exc",
    [
        ValueError("bad \x1b[31mtoken\x1b[0m"),
        DeadlineExceeded("bad token"),
        EngineFailure("bad token"),
    ],
)
def test_our_own_messages_pass_without_colour_codes(exc: Exception) -> None:
    assert public_message(exc) == "bad token"


def test_overloaded_says_when_to_retry_in_whole_seconds():
    from deployments.errors import Overloaded

    exc = Overloaded("the decode engines are at capacity", 0.2)
    assert exc.retry_after == 1
    assert public_message(exc) == "the decode engines are at capacity (retry after 1 s)"
    assert Overloaded("full", 2.5).retry_after == 3


@pytest.mark.parametrize(
    ("exc", "code", "http_status", "http_type"),
    [
        (ValueError("bad"), grpc.StatusCode.INVALID_ARGUMENT, 400, "invalid_request_error"),
        (DeadlineExceeded("late"), grpc.StatusCode.DEADLINE_EXCEEDED, 504, "timeout"),
        (EngineFailure("gone"), grpc.StatusCode.UNAVAILABLE, 503, "server_error"),
        (Overloaded("full"), grpc.StatusCode.RESOURCE_EXHAUSTED, 429, "rate_limit_error"),
        (Unauthenticated("no key"), grpc.StatusCode.UNAUTHENTICATED, 401, "invalid_request_error"),
        (KeyError("x"), grpc.StatusCode.INTERNAL, 500, "server_error"),
    ],
)
def test_one_status_table_for_both_front_ends(exc, code, http_status, http_type) -> None:
    status = status_of(exc)
    assert (status.grpc_code, status.http_status, status.http_type) == (
        code,
        http_status,
        http_type,
    )
    assert status.internal == (code == grpc.StatusCode.INTERNAL)


def test_the_http_front_end_answers_from_the_table() -> None:
    """An Overloaded refusal also says when to retry, in the header HTTP clients read."""
    import json

    from deployments.router.openai_api import error_response

    response = error_response(Overloaded("the decode engines are at capacity", 2.5))
    body = json.loads(response.body)
    assert response.status_code == 429 and response.headers["Retry-After"] == "3"
    assert (
        body["error"]["type"] == "rate_limit_error"
        and "retry after 3 s" in body["error"]["message"]
    )
    internal = error_response(RuntimeError("/home/me/secret.py line 3"))
    assert internal.status_code == 500
    assert json.loads(internal.body)["error"]["message"] == INTERNAL_ERROR
