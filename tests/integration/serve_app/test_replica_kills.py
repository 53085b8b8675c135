"""Engine replicas killed under traffic: requests in flight and after complete with the right
tokens (prefill: fallback to decode-only at once, or a recompute of a failed KV read; decode:
streams move to the prefill replica, request migration), and Serve brings replacements up.

Last in the package (name order): these kill replicas of the app every module here shares, and
each test waits for the replacement before it ends.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from engine.llm import LLM
from engine.request import SamplingParams
from pdserve.client import Completion, generate_request
from tests.integration.serve_app.shared import COLOCATED, PROMPTS, greedy
from tests.integration.serving import (
    ServedApp,
    replica_actors,
    running_replicas,
    sigkill_replica,
)
from tests.waiting import wait_until

pytestmark = pytest.mark.integration


def test_killing_the_prefill_replica_keeps_requests_completing(
    app: ServedApp, offline: LLM
) -> None:
    """Under steady traffic, requests in flight at the kill and requests sent after it all
    complete with the right tokens (fallback to decode-only, or recompute of a failed KV
    read). Requests sent right after the kill complete decode-only (route fallback) at once,
    not after waiting for Serve's replacement; once it runs they are disaggregated again."""
    import ray

    prompts = [f"{PROMPTS[i % len(PROMPTS)]} again {i}" for i in range(40)]
    params = SamplingParams(max_tokens=32, temperature=0.0)
    expected = [o.outputs[0].token_ids for o in offline.generate(prompts, params)]
    after = [f"{PROMPTS[1]} {i}" for i in range(3)]
    params = SamplingParams(max_tokens=8, temperature=0.0)
    after_expected = [o.outputs[0].token_ids for o in offline.generate(after, params)]
    (victim,) = replica_actors("PrefillServer")
    results: dict[int, Completion | Exception] = {}
    spans: dict[int, tuple[float, float]] = {}

    def one(i: int) -> None:
        begin = time.monotonic()
        try:
            request = generate_request(prompts[i], max_tokens=32, temperature=0.0)
            results[i] = app.client.complete(request, timeout=180)
        except Exception as exc:  # recorded, asserted below
            results[i] = exc
        spans[i] = (begin, time.monotonic())

    with ThreadPoolExecutor(6) as pool:
        futures = [pool.submit(one, i) for i in range(len(prompts))]
        assert wait_until(lambda: len(results) >= 6, 60)  # traffic is flowing
        killed_at = time.monotonic()
        ray.kill(ray.get_actor(victim, namespace="serve"), no_restart=True)
        assert wait_until(lambda: victim not in replica_actors("PrefillServer"), 30)  # dead
        for prompt, want in zip(after, after_expected, strict=True):
            got = app.client.complete(generate_request(prompt, max_tokens=8, temperature=0.0))
            assert (got.route, got.token_ids) == ("fallback", want)
        # Answered before Serve had a replacement running (it first has to notice the death
        # at a health check, then load an engine): not after waiting for one.
        assert not prefill_replacement_running(victim)
        for future in futures:
            future.result()
    routes = {i: getattr(r, "route", repr(r)) for i, r in sorted(results.items())}
    print("routes after the kill:", routes)
    for i, result in results.items():
        assert isinstance(result, Completion), (i, result)
        assert result.token_ids == expected[i], i
    in_flight = [i for i, (b, e) in spans.items() if b < killed_at < e]
    started_after = [i for i, (b, _) in spans.items() if b > killed_at]
    assert in_flight and started_after, spans
    assert wait_until(lambda: disaggregated_again(app), 120)
    assert prefill_replacement_running(victim)


def disaggregated_again(app: ServedApp) -> bool:
    request = generate_request("Hello", max_tokens=4, temperature=0.0)
    return app.client.complete(request).route == "disaggregated"


def prefill_replacement_running(victim: str) -> bool:
    if replica_actors("PrefillServer") in ([], [victim]):
        return False  # not even started
    return running_replicas("PrefillServer") >= 1


def test_killing_the_decode_replica_moves_its_streams_to_the_prefill_replica(
    app: ServedApp, offline: LLM
) -> None:
    """SIGKILL of the only decode replica under three streams (gRPC greedy, gRPC seeded
    sampling, HTTP SSE). Each goes on on the prefill replica from the tokens it had (request
    migration) and ends as an unbroken run would have: greedy as offline, seeded as the
    colocated app draws. Meanwhile Health reports the dead replica unreachable; once Serve
    has replaced it, no engine holds a block."""
    (victim,) = replica_actors("DecodeServer")
    greedy_ids = greedy(offline, PROMPTS[2], 200, ignore_eos=True).outputs[0].token_ids
    sse_text = greedy(offline, PROMPTS[1], 200, ignore_eos=True).outputs[0].text
    seeded = {"max_tokens": 150, "temperature": 1.0, "seed": 11, "ignore_eos": True}
    seeded_ids = app.clients[COLOCATED].complete(generate_request(PROMPTS[3], **seeded)).token_ids
    calls = [
        app.client.stream(
            generate_request(PROMPTS[2], max_tokens=200, temperature=0.0, ignore_eos=True),
            timeout=180,
        ),
        app.client.stream(generate_request(PROMPTS[3], **seeded), timeout=180),
    ]
    body = {"prompt": PROMPTS[1], "max_tokens": 200, "temperature": 0, "ignore_eos": True}
    with ThreadPoolExecutor(1) as pool:
        events = pool.submit(app.sse, "/v1/completions", body)
        heads = [[next(call) for _ in range(3)] for call in calls]
        assert wait_until(lambda: decode_running(app) >= 3, 30)
        sigkill_replica(victim)
        rests = [list(call) for call in calls]
        sse = events.result()
    streamed = [
        [t for chunk in head + rest for t in chunk.token_ids]
        for head, rest in zip(heads, rests, strict=True)
    ]
    assert streamed == [list(greedy_ids), list(seeded_ids)]
    assert [rest[-1].finish_reason for rest in rests] == ["length", "length"]
    assert [rest[-1].migrations for rest in rests] == [1, 1]  # each moved once, as its end says
    assert not [e for e in sse if isinstance(e, dict) and "error" in e], sse[-3:]
    assert "".join(e["choices"][0]["text"] for e in sse if isinstance(e, dict)) == sse_text
    health = app.client.health()
    states = {(e.role, e.state) for e in health.engines}
    if ("decode", "unreachable") in states:  # not replaced yet
        assert health.status == "DEGRADED", health
    # The replacement starts; then nothing is held anywhere.
    assert wait_until(lambda: replica_actors("DecodeServer") not in ([], [victim]), 120)
    assert wait_until(app.engines_idle, 120), app.client.health()


def decode_running(app: ServedApp) -> int:
    return sum(e.num_running for e in app.client.health().engines if e.role == "decode")
