"""Requests that end before their last token: a cancelled gRPC stream, an HTTP client that
disconnects, the Abort RPC, a deadline. Each ends at once, and afterwards no engine holds a
block or a request."""

from __future__ import annotations

import json

import grpc
import pytest

from pdserve.client import generate_request
from tests.integration.serve_app.shared import PROMPTS
from tests.integration.serving import ServedApp
from tests.waiting import wait_until

pytestmark = pytest.mark.integration


def test_cancelled_stream_frees_blocks_on_both_engines(app: ServedApp) -> None:
    request = generate_request(PROMPTS[2], max_tokens=160, temperature=0.0, ignore_eos=True)
    call = app.client.stream(request, timeout=120)
    for _ in range(3):
        next(call)
    health = app.client.health()
    assert any(e.num_free_blocks < e.num_blocks for e in health.engines if e.role == "decode")
    call.cancel()
    with pytest.raises(grpc.RpcError) as info:
        list(call)
    assert info.value.code() == grpc.StatusCode.CANCELLED
    assert wait_until(app.engines_idle, 30), app.client.health()


def test_http_client_that_disconnects_aborts_its_request(app: ServedApp) -> None:
    body = {
        "prompt": PROMPTS[1],
        "max_tokens": 160,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    conn = app.connection(timeout=60)
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    response = conn.getresponse()
    events = 0
    while events < 3:
        if response.readline().startswith(b"data: "):
            events += 1
    assert not app.engines_idle()  # generating
    conn.sock.close()  # gone without a word
    conn.close()
    assert wait_until(app.engines_idle, 30), app.client.health()


def test_abort_rpc_ends_the_stream(app: ServedApp) -> None:
    request = generate_request(
        PROMPTS[3], request_id="to-abort", max_tokens=160, temperature=0.0, ignore_eos=True
    )
    call = app.client.stream(request, timeout=120)
    next(call)
    assert app.client.abort("to-abort")
    rest = list(call)
    assert rest[-1].finish_reason == "abort"
    assert sum(len(c.token_ids) for c in rest) < 159
    assert not app.client.abort("to-abort")  # no longer in flight
    assert wait_until(app.engines_idle, 30), app.client.health()


def test_deadline_exceeded(app: ServedApp) -> None:
    request = generate_request(
        PROMPTS[0], max_tokens=200, temperature=0.0, ignore_eos=True, timeout_s=0.3
    )
    with pytest.raises(grpc.RpcError) as info:
        app.client.complete(request)
    assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert "deadline" in info.value.details()
    assert wait_until(app.engines_idle, 30), app.client.health()
