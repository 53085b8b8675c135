"""What the app answers over gRPC (Serve's gRPC proxy), disaggregated (prefill and decode
replicas moving KV over real NIXL) and colocated: greedy tokens equal the offline engine's,
seeded sampling equals the colocated app's, structured outputs and stop strings hold across the
legs, and tokens stream as they are made."""

from __future__ import annotations

import json
import re

import pytest

from deployments.cluster.request_routers import KV_COMPAT_HASH
from engine.llm import LLM
from pdserve.client import generate_request
from tests.integration.serve_app.shared import COLOCATED, PROMPTS, greedy
from tests.integration.serving import ServedApp, replica_metadata
from tests.waiting import wait_until

pytestmark = pytest.mark.integration


def test_grpc_greedy_matches_offline_disaggregated_and_colocated(
    app: ServedApp, offline: LLM
) -> None:
    for prompt in PROMPTS:
        expected = greedy(offline, prompt, 24)
        for client, route in ((app.client, "disaggregated"), (app.clients[COLOCATED], "colocated")):
            got = client.complete(generate_request(prompt, max_tokens=24, temperature=0.0))
            assert got.route == route
            assert got.prompt_token_ids == expected.prompt_token_ids
            assert got.token_ids == expected.outputs[0].token_ids, (prompt, route)
            assert got.text == expected.outputs[0].text
            assert got.finish_reason == expected.outputs[0].finish_reason
            assert got.usage is not None
            assert got.usage.completion_tokens == len(got.token_ids)
    # Serve holds each engine replica's KV compatibility hash as its metadata, which the
    # request routers pair decode requests by (tests/unit/test_request_routers.py).
    (producer,) = replica_metadata("PrefillServer")
    assert len(producer[KV_COMPAT_HASH]) == 64
    assert replica_metadata("DecodeServer") == [producer]


def test_seeded_sampling_disaggregated_equals_colocated(app: ServedApp) -> None:
    # A prompt no earlier test sent: no decode replica holds it yet.
    prompt = "Seeded, and never sent before: " + PROMPTS[2]
    request = generate_request(prompt, max_tokens=24, temperature=0.9, top_p=0.95, seed=7)
    disaggregated = app.client.complete(request)
    colocated = app.clients[COLOCATED].complete(request)
    assert disaggregated.route == "disaggregated"
    assert disaggregated.token_ids == colocated.token_ids
    assert disaggregated.text == colocated.text
    # Again: the decode replica now holds the prompt and computes it itself (decode_cached),
    # drawing the same seeded tokens. Its cache reaches the index every 20 ms: until then
    # the request is disaggregated again.
    answers = []

    def decode_cached() -> bool:
        answers.append(app.client.complete(request))
        return answers[-1].route == "decode_cached"

    wait_until(decode_cached, 30)
    again = answers[-1]
    assert again.route == "decode_cached"
    assert again.token_ids == colocated.token_ids


def test_structured_outputs_over_http_and_grpc_disaggregated_and_colocated(
    app: ServedApp,
) -> None:
    schema = {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}, "tag": {"enum": ["red", "green", "blue"]}},
        "required": ["ok", "tag"],
        "additionalProperties": False,
    }
    response_format = {"type": "json_schema", "json_schema": {"name": "t", "schema": schema}}
    body = {
        "messages": [{"role": "user", "content": "Pick"}],
        "max_tokens": 40,
        "temperature": 1.0,
        "seed": 4,
        "response_format": response_format,
    }
    contents = []
    for prefix in ("", f"/{COLOCATED}"):
        status, reply = app.http(f"{prefix}/v1/chat/completions", body)
        assert status == 200, reply
        contents.append(reply["choices"][0]["message"]["content"])
        value = json.loads(contents[-1])
        assert set(value) == {"ok", "tag"} and value["tag"] in ("red", "green", "blue")
    assert contents[0] == contents[1]  # the seeded legs agree
    choice = {"prompt": "Hi", "max_tokens": 8, "temperature": 0, "guided_choice": ["yes", "no"]}
    status, reply = app.http("/v1/completions", choice)
    assert status == 200 and reply["choices"][0]["text"] in ("yes", "no"), reply
    request = generate_request(
        "Hi", max_tokens=12, temperature=0.0, structured_outputs={"regex": "[a-z]{4}"}
    )
    for client in (app.client, app.clients[COLOCATED]):
        assert re.fullmatch("[a-z]{4}", client.complete(request).text)


def test_stop_string_across_the_legs(app: ServedApp, offline: LLM) -> None:
    full = greedy(offline, PROMPTS[1], 24).outputs[0].text
    stop = full[len(full) // 2 : len(full) // 2 + 3]  # lands in the decode leg's text
    expected = greedy(offline, PROMPTS[1], 24, stop=[stop]).outputs[0]
    got = app.client.complete(
        generate_request(PROMPTS[1], max_tokens=24, temperature=0.0, stop=[stop])
    )
    assert got.finish_reason == "stop"
    assert got.text == expected.text
    assert got.token_ids == expected.token_ids


def test_first_token_arrives_before_the_decode_leg_finishes(app: ServedApp) -> None:
    request = generate_request(PROMPTS[0], max_tokens=160, temperature=0.0, ignore_eos=True)
    stream = app.client.stream(request, timeout=120)
    first = next(stream)
    assert len(first.token_ids) == 1
    assert first.prompt_token_ids

    # The client holds the prefill's token while the decode engine still has the request
    # (159 tokens to go). Its stats are a snapshot as of its last step: wait for the one
    # after the decode leg arrived.
    def decode_holds_it() -> bool:
        decode = next(e for e in app.client.health().engines if e.role == "decode")
        return decode.num_running + decode.num_waiting >= 1

    assert wait_until(decode_holds_it, 30.0)
    chunks = [first, *stream]
    print("chunks for 160 tokens:", len(chunks))
    # Tokens stream as produced: one chunk per decode step, or a few steps together when the
    # router falls behind (coalesced), never the whole answer at the end.
    assert len(chunks) > 40
    assert sum(len(c.token_ids) for c in chunks) == 160
    assert chunks[-1].finish_reason == "length"
    assert 0 < chunks[-1].timing.ttft_s < chunks[-1].timing.e2e_s
