"""A turn asks for its KV to be kept for its session's next turn, over HTTP (OpenAI's
prompt_cache_key and cache_control) and gRPC (KVPin): the engine that answered pins it, the
usage says so, and an idle engine lets go of it at its TTL. Bad pins are refused by name."""

from __future__ import annotations

import grpc
import pytest

from pdserve.client import generate_request
from protos.pdserve.v1 import generate_pb2 as pb
from tests.integration.serve_app.shared import COLOCATED, PROMPTS
from tests.integration.serving import APP_NAME, ServedApp
from tests.waiting import wait_until

pytestmark = pytest.mark.integration


def pinned_blocks(app: ServedApp, name: str) -> int:
    return sum(e.num_blocks - e.num_free_blocks for e in app.clients[name].health().engines)


def test_a_turn_asks_its_kv_kept_and_an_idle_engine_lets_go_at_its_ttl(app: ServedApp) -> None:
    cache_control = {"type": "ephemeral", "ttl": "3s"}
    part = {"type": "text", "text": "Plan a trip to the sea", "cache_control": cache_control}
    body = {
        "messages": [{"role": "user", "content": [part]}],
        "max_tokens": 4,
        "temperature": 0,
        "prompt_cache_key": "agent-http",
    }
    status, reply = app.http("/v1/chat/completions", body)
    assert status == 200, reply
    assert reply["usage"]["kv_pin"] == {"ttl_s": 3.0, "refused": False}
    request = generate_request(" ".join(PROMPTS), max_tokens=4, temperature=0.0)
    request.pin.CopyFrom(pb.KVPin(session="agent-grpc", ttl_s=3.0))
    for name in (APP_NAME, COLOCATED):
        got = app.clients[name].complete(request)
        assert got.usage is not None and got.usage.pinned_ttl_s == 3.0
    # Nothing runs, yet the pins hold the turns' blocks; at their TTL the engines wake and
    # let go of them.
    assert pinned_blocks(app, APP_NAME) > 0 and pinned_blocks(app, COLOCATED) > 0
    assert wait_until(app.engines_idle, 30), app.client.health()
    assert wait_until(lambda: app.engines_idle(COLOCATED), 30)


@pytest.mark.parametrize(
    ("cache_control", "named"),
    [
        ({"type": "ephemeral", "ttl": "2h"}, "messages[0].cache_control.ttl"),
        ({"type": "persistent"}, "messages[0].cache_control.type"),
        ({}, "messages[0].cache_control.type"),
        ({"type": "ephemeral", "scope": "global"}, "messages[0].cache_control has unknown"),
    ],
)
def test_bad_pins_are_refused_by_name(app: ServedApp, cache_control, named) -> None:
    message = {"role": "user", "content": "Hello", "cache_control": cache_control}
    status, reply = app.http("/v1/chat/completions", {"messages": [message], "max_tokens": 2})
    assert status == 400 and named in reply["error"]["message"], reply


def test_bad_grpc_pins_are_invalid_argument(app: ServedApp) -> None:
    for pin, named in (
        (pb.KVPin(session="s", ttl_s=5000.0), "at most 3600"),
        (pb.KVPin(ttl_s=5.0), "session key"),
    ):
        request = generate_request(PROMPTS[0], max_tokens=2)
        request.pin.CopyFrom(pin)
        with pytest.raises(grpc.RpcError) as info:
            app.client.complete(request)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert named in info.value.details()
