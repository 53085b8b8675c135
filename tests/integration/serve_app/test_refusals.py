"""Bad requests are refused with the reason, by name, and the service keeps serving: gRPC's
INVALID_ARGUMENT (bytes that are no protobuf message too, logged as one INFO line by the
Router), HTTP 400 in OpenAI's error shape for bad and unsupported fields, 413 and 400 over the
size limits (LIMITS in shared.py)."""

from __future__ import annotations

import time
from typing import Any

import grpc
import pytest

from deployments.launch import APP_NAME
from pdserve.client import generate_request
from tests.integration.serve_app.shared import LIMITS, MAX_MODEL_LEN
from tests.integration.serving import ServedApp
from tests.waiting import wait_until

pytestmark = pytest.mark.integration


@pytest.mark.parametrize(
    ("prompt", "params", "message"),
    [
        ("", {}, "prompt is empty"),
        ([], {}, "prompt is empty"),
        ("Hello", {"max_tokens": 0}, "max_tokens"),
        ("Hello", {"max_tokens": 2**62}, "output tokens remain"),
        ("Hello", {"temperature": -1.0}, "temperature"),
        ("Hello", {"top_p": 1.5}, "top_p"),
        (list(range(20, 20 + MAX_MODEL_LEN + 10)), {}, "max_model_len"),
        ([5, 99999], {}, "vocabulary"),
        ("Hello", {"structured_outputs": {"regex": "a(b"}}, "invalid structured output regex"),
        (
            "Hello",
            {"structured_outputs": {"json_schema": '{"type": "objekt"}'}},
            'Unsupported type "objekt"',
        ),
        ("x" * 20_001, {}, "the limit is 20000 (max_prompt_chars)"),
        ("Hello", {"stop": [str(i) for i in range(9)]}, "the limit is 8 (max_stop_strings)"),
        ("Hello", {"stop": ["x" * 1025]}, "the limit is 1024 (max_stop_chars)"),
        ("Hello", {"request_id": "r" * 257}, "the limit is 256 (max_request_id_chars)"),
    ],
)
def test_bad_grpc_requests_are_invalid_argument(
    app: ServedApp, prompt: Any, params: dict[str, Any], message: str
) -> None:
    with pytest.raises(grpc.RpcError) as info:
        app.client.complete(generate_request(prompt, **params))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert message in info.value.details()


def test_undecodable_grpc_bytes_are_invalid_argument_and_refusals_log_one_info_line(
    app: ServedApp,
) -> None:
    """Bytes that are no protobuf message get INVALID_ARGUMENT (grpcio's own answer would be
    UNKNOWN), on the streaming and a unary method; and a refused request leaves one INFO line
    in the Router replica's log, no ERROR and no traceback."""
    metadata = (("application", APP_NAME),)
    with grpc.insecure_channel(app.target) as channel:
        for method, call in (
            ("Generate", channel.unary_stream("/pdserve.v1.Generation/Generate")),
            ("Health", channel.unary_unary("/pdserve.v1.Generation/Health")),
        ):
            with pytest.raises(grpc.RpcError) as info:
                reply = call(b"\xff\xff\xff", metadata=metadata, timeout=60)
                list(reply) if method == "Generate" else reply
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, method
            assert "not a valid protobuf message" in info.value.details(), method
    bad_token = 3_000_000_000 + time.time_ns() % 1_000_000  # found again in the log below
    marker = f"token id {bad_token} is outside the vocabulary"
    with pytest.raises(grpc.RpcError):
        app.client.complete(generate_request([bad_token]))

    def router_log() -> str:
        return app.logs(f"replica_{APP_NAME}_Router_*.log")

    assert wait_until(lambda: "request refused: INVALID_ARGUMENT" in router_log(), 30)
    lines = [line for line in router_log().splitlines() if marker in line]
    assert lines and all(line.startswith("INFO ") for line in lines), lines
    assert "Traceback" not in router_log()


def assert_serves(app: ServedApp) -> None:
    """The service keeps serving, over HTTP and gRPC."""
    status, reply = app.http("/v1/completions", {"prompt": "Hi", "max_tokens": 3})
    assert status == 200 and reply["choices"][0]["finish_reason"] in ("length", "stop")
    got = app.client.complete(generate_request("Hi", max_tokens=3, temperature=0.0))
    assert got.finish_reason in ("length", "stop")


def test_bad_completions_are_400_and_service_keeps_serving(app: ServedApp) -> None:
    cases: list[tuple[Any, bytes | None, str]] = [
        ({"prompt": "", "max_tokens": 4}, None, "prompt is empty"),
        ({"prompt": "Hi", "max_tokens": 0}, None, "max_tokens"),
        ({"prompt": "Hi", "max_tokens": 10**12}, None, "output tokens remain"),
        ({"prompt": "Hi", "temperature": -0.5}, None, "temperature"),
        ({"prompt": "Hi", "top_p": 2}, None, "top_p"),
        ({"prompt": "Hi", "model": "gpt-17"}, None, "gpt-17"),
        ({"prompt": list(range(20, 20 + MAX_MODEL_LEN + 10))}, None, "max_model_len"),
        ({"prompt": "Hi", "max_tokens": "many"}, None, "max_tokens"),
        (None, b'{"prompt": "Hi", ', "JSON"),
        (None, b'{"prompt": "\xff\xfe"}', "error parsing the body"),  # not UTF-8
        (None, b"[" * 100_000 + b"]" * 100_000, "error parsing the body"),  # too deep
        ({"max_tokens": 3}, None, "prompt"),
    ]
    for body, raw, message in cases:
        status, reply = app.http("/v1/completions", body, raw)
        assert status == 400, (body, reply)
        assert message in reply["error"]["message"], reply
    for extra, message in (
        ({"suffix": "x"}, "suffix is not supported"),
        ({"best_of": 3}, "best_of must be 1"),
        ({"logprobs": 21}, "at most 20 logprobs"),
    ):
        status, reply = app.http("/v1/completions", {"prompt": "Hi", **extra})
        assert status == 400 and message in reply["error"]["message"], (extra, reply)
    assert_serves(app)


def test_bad_chat_requests_are_400_and_service_keeps_serving(app: ServedApp) -> None:
    status, reply = app.http("/v1/chat/completions", {"messages": [], "max_tokens": 3})
    assert status == 400 and "messages" in reply["error"]["message"]
    hi = [{"role": "user", "content": "Hi"}]
    for field, value, message in (
        ("max_completion_tokens", 0, "max_tokens must be an integer >= 1"),
        ("max_completion_tokens", 10**12, "output tokens remain"),
        ("max_tokens", MAX_MODEL_LEN, "output tokens remain"),
    ):
        status, reply = app.http("/v1/chat/completions", {"messages": hi, field: value})
        assert status == 400 and message in reply["error"]["message"], (field, value, reply)
    assert_serves(app)


def test_unsupported_chat_fields_are_400_by_name_and_service_keeps_serving(
    app: ServedApp,
) -> None:
    hi = [{"role": "user", "content": "Hi"}]
    template = "is not supported by this model's chat template"
    refused = [
        ({"tools": [{"type": "function", "function": {"name": "f"}}]}, f"tools {template}"),
        ({"tool_choice": "auto"}, f"tool_choice {template}"),
        ({"functions": [{"name": "f"}]}, f"functions {template}"),
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs must be in [0, 20]"),
        ({"n": 2}, "n must be 1"),
        ({"frobnicate": True}, "frobnicate: Extra inputs are not permitted"),
        ({"response_format": {"type": "json_schema"}}, "needs json_schema.schema"),
        ({"response_format": {"type": "yaml"}}, "must be text, json_object or json_schema"),
        ({"guided_regex": "a(b"}, "invalid structured output regex"),
        ({"guided_json": {"type": "objekt"}}, 'Unsupported type "objekt"'),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"schema": "{oops"}}},
            "invalid structured output json: the schema is not JSON",
        ),
        ({"stream_options": {"include_usage": True}}, "stream_options needs stream: true"),
        ({"guided_regex": "a", "guided_choice": ["a"]}, "give one structured output field"),
        ({"audio": {"voice": "x"}}, "audio is not supported"),
        ({"store": True}, "store: true is not supported"),
    ]
    for extra, message in refused:
        status, reply = app.http("/v1/chat/completions", {"messages": hi, **extra})
        assert status == 400 and message in reply["error"]["message"], (extra, reply)
        assert reply["error"]["type"] == "invalid_request_error"
    assert_serves(app)


def test_http_requests_over_the_size_limits_are_refused_and_service_keeps_serving(
    app: ServedApp,
) -> None:
    big = {"prompt": "x" * LIMITS["max_body_bytes"]}
    status, reply = app.http("/v1/completions", big)
    assert status == 413 and "(max_body_bytes)" in reply["error"]["message"], reply
    long_chat = {"messages": [{"role": "user", "content": "y" * 20_001}]}
    for path, body in (
        ("/v1/completions", {"prompt": "y" * 20_001}),
        ("/v1/chat/completions", long_chat),
    ):
        status, reply = app.http(path, body)
        assert status == 400 and "(max_prompt_chars)" in reply["error"]["message"], reply
    status, reply = app.http(
        "/v1/completions", {"prompt": "Hi", "max_tokens": 3}, headers={"X-Request-Id": "r" * 300}
    )
    assert status == 400 and "(max_request_id_chars)" in reply["error"]["message"], reply
    assert_serves(app)
