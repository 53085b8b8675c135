"""The Serve app on real local Ray Serve: gRPC through Serve's gRPC proxy, HTTP through its HTTP
proxy, prefill and decode replicas moving KV over real NIXL. One Serve instance runs the
disaggregated app ("pdserve") and the colocated one ("colocated") for the whole module.

The offline engine in this process is the oracle: greedy outputs must match it token for token.

Why this file is long: every test here runs against one Serve instance (the module fixture;
starting Ray, Serve and four engine replicas takes most of a minute on 2 cores), and a module
of its own would start another.
"""

from __future__ import annotations

import http.client
import json
import re
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
import pytest

from deployments.app import AppConfig
from deployments.launch import APP_NAME, COLOCATED_APP_NAME, ServeOptions, start, stop
from engine.llm import LLM
from engine.request import SamplingParams
from pdserve.client import Completion, GenerationClient, generate_request
from tests.integration.serve_utils import free_port, replica_actors, sigkill_replica, wait_until

pytestmark = pytest.mark.integration

MAX_MODEL_LEN = 256
ENGINE_ARGS = {"max_model_len": MAX_MODEL_LEN, "kv_cache_memory_bytes": 16 << 20}
PROMPTS = [
    "Hello",
    "The quick brown fox jumps over the lazy dog",
    "Once upon a time, in a land far away, there lived a",
    "def fibonacci(n):",
]


LIMITS = {"max_body_bytes": 1 << 20, "max_prompt_chars": 20_000, "max_stop_strings": 8}
HEAVY_LIMITS = {
    "max_body_bytes": 64 << 20,
    "max_prompt_chars": 20_000_000,
    "max_stop_strings": 200_000,
}


class App:
    def __init__(self, grpc_port: int, http_port: int) -> None:
        self.target = f"127.0.0.1:{grpc_port}"
        self.http_port = http_port
        self.client = GenerationClient(self.target, APP_NAME)
        self.colocated = GenerationClient(self.target, COLOCATED_APP_NAME)

    def http(
        self, path: str, body: Any, raw: bytes | None = None, headers: dict[str, str] | None = None
    ) -> tuple[int, Any]:
        conn = http.client.HTTPConnection("127.0.0.1", self.http_port, timeout=120)
        payload = raw if raw is not None else json.dumps(body).encode()
        conn.request("POST", path, payload, {"Content-Type": "application/json", **(headers or {})})
        response = conn.getresponse()
        data = response.read().decode()
        conn.close()
        return response.status, json.loads(data)

    def sse(self, path: str, body: dict[str, Any]) -> list[Any]:
        conn = http.client.HTTPConnection("127.0.0.1", self.http_port, timeout=120)
        conn.request(
            "POST", path, json.dumps({**body, "stream": True}), {"Content-Type": "application/json"}
        )
        response = conn.getresponse()
        assert response.status == 200
        events = []
        for line in response:
            text = line.decode().strip()
            if text.startswith("data: "):
                data = text[len("data: ") :]
                events.append(data if data == "[DONE]" else json.loads(data))
        conn.close()
        return events

    def engines_idle(self, client: GenerationClient | None = None) -> bool:
        health = (client or self.client).health()
        return health.status == "SERVING" and all(
            e.state == "running"
            and e.num_free_blocks == e.num_blocks
            and e.num_running == 0
            and e.num_waiting == 0
            and e.num_held_requests == 0
            for e in health.engines
        )


@pytest.fixture(scope="module")
def app() -> Iterator[App]:
    config = AppConfig.from_args(
        {
            "model": "tiny",
            "engine_args": ENGINE_ARGS,
            # Small limits, so the tests can cross them with small requests.
            "max_body_bytes": LIMITS["max_body_bytes"],
            "max_prompt_chars": LIMITS["max_prompt_chars"],
            "max_stop_strings": LIMITS["max_stop_strings"],
            "num_cpus_per_engine": 0.5,
            "transport": "nixl",
            "lease_seconds": 20,
        }
    )
    grpc_port, http_port = free_port(), free_port()
    start(
        config,
        ServeOptions(
            grpc_port=grpc_port,
            http_port=http_port,
            num_cpus=8,
            # The colocated app takes heavy requests (test_heavy_requests_do_not_stall_others).
            extra_apps={COLOCATED_APP_NAME: {"colocated": True, **HEAVY_LIMITS}},
        ),
    )
    served = App(grpc_port, http_port)
    try:
        yield served
    finally:
        served.client.close()
        served.colocated.close()
        stop()


@pytest.fixture(scope="module")
def offline() -> Iterator[LLM]:
    llm = LLM("tiny", **ENGINE_ARGS)
    yield llm
    llm.close()


def greedy(llm: LLM, prompt: str | list[int], max_tokens: int, **kw: Any) -> Any:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, **kw)
    return llm.generate([prompt], params)[0]


def test_grpc_greedy_matches_offline_disaggregated_and_colocated(app: App, offline: LLM) -> None:
    for prompt in PROMPTS:
        expected = greedy(offline, prompt, 24)
        for client, route in ((app.client, "disaggregated"), (app.colocated, "colocated")):
            got = client.complete(generate_request(prompt, max_tokens=24, temperature=0.0))
            assert got.route == route
            assert got.prompt_token_ids == expected.prompt_token_ids
            assert got.token_ids == expected.outputs[0].token_ids, (prompt, route)
            assert got.text == expected.outputs[0].text
            assert got.finish_reason == expected.outputs[0].finish_reason
            assert got.usage is not None
            assert got.usage.completion_tokens == len(got.token_ids)


def test_seeded_sampling_disaggregated_equals_colocated(app: App) -> None:
    # A prompt no earlier test sent: no decode replica holds it yet.
    prompt = "Seeded, and never sent before: " + PROMPTS[2]
    request = generate_request(prompt, max_tokens=24, temperature=0.9, top_p=0.95, seed=7)
    disaggregated = app.client.complete(request)
    colocated = app.colocated.complete(request)
    assert disaggregated.route == "disaggregated"
    assert disaggregated.token_ids == colocated.token_ids
    assert disaggregated.text == colocated.text
    # Again: the decode replica now holds the prompt and computes it itself (decode_cached),
    # drawing the same seeded tokens.
    for _ in range(20):
        again = app.client.complete(request)
        if again.route == "decode_cached":
            break
        time.sleep(0.05)  # the decode replica's cache reaches the index every 20 ms
    assert again.route == "decode_cached"
    assert again.token_ids == colocated.token_ids


def test_structured_outputs_over_http_and_grpc_disaggregated_and_colocated(app: App) -> None:
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
    for prefix in ("", "/colocated"):
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
    for client in (app.client, app.colocated):
        assert re.fullmatch("[a-z]{4}", client.complete(request).text)


def test_stop_string_across_the_legs(app: App, offline: LLM) -> None:
    full = greedy(offline, PROMPTS[1], 24).outputs[0].text
    stop = full[len(full) // 2 : len(full) // 2 + 3]  # lands in the decode leg's text
    expected = greedy(offline, PROMPTS[1], 24, stop=[stop]).outputs[0]
    got = app.client.complete(
        generate_request(PROMPTS[1], max_tokens=24, temperature=0.0, stop=[stop])
    )
    assert got.finish_reason == "stop"
    assert got.text == expected.text
    assert got.token_ids == expected.token_ids


def test_http_completions_match_offline(app: App, offline: LLM) -> None:
    for prompt in PROMPTS[:2]:
        expected = greedy(offline, prompt, 20).outputs[0]
        body = {
            "model": "tiny",
            "prompt": prompt,
            "max_tokens": 20,
            "temperature": 0,
            "return_token_ids": True,
        }
        status, reply = app.http("/v1/completions", body)
        assert status == 200, reply
        assert reply["id"].startswith("cmpl-") and len(reply["id"]) > len("cmpl-")
        choice = reply["choices"][0]
        assert choice["token_ids"] == expected.token_ids
        assert choice["text"] == expected.text
        assert reply["usage"]["completion_tokens"] == len(expected.token_ids)
        events = app.sse("/v1/completions", body)
        assert events[-1] == "[DONE]"
        texts = [e["choices"][0]["text"] for e in events[:-1]]
        assert len(texts) > 1  # streamed, not one blob
        assert "".join(texts) == expected.text
        assert events[-2]["choices"][0]["finish_reason"] == expected.finish_reason


def test_http_chat_and_models(app: App, offline: LLM) -> None:
    conn = http.client.HTTPConnection("127.0.0.1", app.http_port, timeout=60)
    conn.request("GET", "/v1/models")
    models = json.loads(conn.getresponse().read())
    conn.close()
    assert [m["id"] for m in models["data"]] == ["tiny"]
    messages = [{"role": "user", "content": "Say hello"}]
    tokenizer = offline.tokenizer
    assert tokenizer is not None
    prompt_ids = tokenizer.encode(tokenizer.apply_chat_template(messages), add_special_tokens=False)
    expected = greedy(offline, prompt_ids, 16).outputs[0]
    status, reply = app.http(
        "/v1/chat/completions",
        {"model": "tiny", "messages": messages, "max_tokens": 16, "temperature": 0},
    )
    assert status == 200, reply
    assert reply["id"].startswith("chatcmpl-")
    assert reply["choices"][0]["message"] == {"role": "assistant", "content": expected.text}
    events = app.sse(
        "/v1/chat/completions", {"messages": messages, "max_tokens": 16, "temperature": 0}
    )
    deltas = [e["choices"][0]["delta"] for e in events[:-1]]
    assert deltas[0]["role"] == "assistant"
    assert "".join(d.get("content", "") for d in deltas) == expected.text


def test_http_logprobs_content_parts_and_chat_default_length(app: App) -> None:
    status, reply = app.http(
        "/v1/completions", {"prompt": PROMPTS[1], "max_tokens": 6, "temperature": 0, "logprobs": 2}
    )
    assert status == 200, reply
    logprobs = reply["choices"][0]["logprobs"]
    assert len(logprobs["tokens"]) == len(logprobs["token_logprobs"]) == 6
    assert all(lp <= 0 for lp in logprobs["token_logprobs"])
    assert all(1 <= len(top) <= 2 for top in logprobs["top_logprobs"])
    parts = [{"type": "text", "text": "Say "}, {"type": "text", "text": "hello"}]
    plain = {
        "messages": [{"role": "user", "content": "Say hello"}],
        "temperature": 0,
        "logprobs": True,
        "top_logprobs": 2,
    }
    status, whole = app.http("/v1/chat/completions", {**plain, "max_tokens": 8})
    status_parts, from_parts = app.http(
        "/v1/chat/completions",
        {**plain, "max_tokens": 8, "messages": [{"role": "user", "content": parts}]},
    )
    assert status == status_parts == 200
    assert from_parts["choices"][0]["message"] == whole["choices"][0]["message"]
    content = whole["choices"][0]["logprobs"]["content"]
    assert len(content) == whole["usage"]["completion_tokens"]
    assert all(len(entry["top_logprobs"]) == 2 for entry in content)
    # Chat without max_tokens runs to the end of the context (or a stop), not to 16 tokens.
    unlimited = {"messages": plain["messages"], "temperature": 0}
    status, long = app.http("/v1/chat/completions", unlimited)
    assert status == 200
    choice, used = long["choices"][0], long["usage"]
    assert choice["finish_reason"] == "stop" or (
        used["prompt_tokens"] + used["completion_tokens"] == MAX_MODEL_LEN
    )


def test_first_token_arrives_before_the_decode_leg_finishes(app: App) -> None:
    request = generate_request(PROMPTS[0], max_tokens=160, temperature=0.0, ignore_eos=True)
    stream = app.client.stream(request, timeout=120)
    first = next(stream)
    # The client holds the prefill's token while the decode engine still has the request.
    decode = next(e for e in app.client.health().engines if e.role == "decode")
    assert len(first.token_ids) == 1
    assert first.prompt_token_ids
    assert decode.num_running + decode.num_waiting >= 1
    chunks = [first, *stream]
    print("chunks for 160 tokens:", len(chunks))
    # Tokens stream as produced: one chunk per decode step, or a few steps together when the
    # router falls behind (coalesced), never the whole answer at the end.
    assert len(chunks) > 40
    assert sum(len(c.token_ids) for c in chunks) == 160
    assert chunks[-1].finish_reason == "length"
    assert 0 < chunks[-1].timing.ttft_s < chunks[-1].timing.e2e_s


def test_32_concurrent_streams_match_offline(app: App, offline: LLM) -> None:
    prompts = [f"{PROMPTS[i % len(PROMPTS)]} {i}" for i in range(32)]
    params = SamplingParams(max_tokens=32, temperature=0.0)
    expected = [o.outputs[0].token_ids for o in offline.generate(prompts, params)]

    def one(prompt: str) -> Completion:
        return app.client.complete(
            generate_request(prompt, max_tokens=32, temperature=0.0), timeout=300
        )

    with ThreadPoolExecutor(32) as pool:
        results = list(pool.map(one, prompts))
    assert [r.token_ids for r in results] == expected
    assert all(r.num_chunks > 1 for r in results)
    assert wait_until(app.engines_idle, 30)


def test_cancelled_stream_frees_blocks_on_both_engines(app: App) -> None:
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


def test_http_client_that_disconnects_aborts_its_request(app: App) -> None:
    body = {
        "prompt": PROMPTS[1],
        "max_tokens": 160,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    conn = http.client.HTTPConnection("127.0.0.1", app.http_port, timeout=60)
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


@pytest.mark.parametrize(
    ("interleave", "load"),
    [(False, {"concurrency": 3}), (True, {"request_rate": 20.0})],  # fixed, then Poisson
)
def test_bench_serve_against_both_apps(
    app: App, tmp_path: Any, interleave: bool, load: dict[str, Any]
) -> None:
    from pdserve.bench.serve import ServeBenchConfig, run

    plot = tmp_path / "latency.png"
    report = run(
        ServeBenchConfig(
            target=app.target,
            apps=[APP_NAME, COLOCATED_APP_NAME],
            num_prompts=6,
            input_len=24,
            output_len=8,
            shared_prefix_len=16,
            warmup=1,
            slo_ttft_ms=60_000,
            plot=str(plot),
            progress=False,
            interleave=interleave,
            **load,
        )
    )
    for name in (APP_NAME, COLOCATED_APP_NAME):
        result = report["results"][name]
        assert result["completed"] == 6 and result["failed"] == 0
        assert result["goodput"] == result["request_throughput"] > 0
        assert 0 < result["ttft_ms"]["p50"] <= result["e2e_ms"]["p50"]
        assert result["itl_ms"]["mean"] > 0
    assert set(report["ratios"]) == {f"{COLOCATED_APP_NAME}/{APP_NAME}"}
    assert plot.read_bytes().startswith(b"\x89PNG")


def test_abort_rpc_ends_the_stream(app: App) -> None:
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


def test_deadline_exceeded(app: App) -> None:
    request = generate_request(
        PROMPTS[0], max_tokens=200, temperature=0.0, ignore_eos=True, timeout_s=0.3
    )
    with pytest.raises(grpc.RpcError) as info:
        app.client.complete(request)
    assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert "deadline" in info.value.details()
    assert wait_until(app.engines_idle, 30), app.client.health()


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
    app: App, prompt: Any, params: dict[str, Any], message: str
) -> None:
    with pytest.raises(grpc.RpcError) as info:
        app.client.complete(generate_request(prompt, **params))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert message in info.value.details()


def test_undecodable_grpc_bytes_are_invalid_argument_and_refusals_log_one_info_line(
    app: App,
) -> None:
    """Bytes that are no protobuf message get INVALID_ARGUMENT (grpcio's own answer would be
    UNKNOWN), on the streaming and a unary method; and a refused request leaves one INFO line
    in the Router replica's log, no ERROR and no traceback."""
    import ray

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
    logs = Path(ray._private.worker._global_node.get_logs_dir_path()) / "serve"

    def router_log() -> str:
        return "".join(p.read_text() for p in logs.glob("replica_pdserve_Router_*.log"))

    assert wait_until(lambda: "request refused: INVALID_ARGUMENT" in router_log(), 30)
    lines = [line for line in router_log().splitlines() if marker in line]
    assert lines and all(line.startswith("INFO ") for line in lines), lines
    assert "Traceback" not in router_log()


def test_bad_http_requests_are_400_and_service_keeps_serving(app: App) -> None:
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
    for extra, message in (
        ({"suffix": "x"}, "suffix is not supported"),
        ({"best_of": 3}, "best_of must be 1"),
        ({"logprobs": 21}, "at most 20 logprobs"),
    ):
        status, reply = app.http("/v1/completions", {"prompt": "Hi", **extra})
        assert status == 400 and message in reply["error"]["message"], (extra, reply)
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
    status, reply = app.http("/v1/completions", {"prompt": "Hi", "max_tokens": 3})
    assert status == 200 and reply["choices"][0]["finish_reason"] in ("length", "stop")
    got = app.client.complete(generate_request("Hi", max_tokens=3, temperature=0.0))
    assert got.finish_reason in ("length", "stop")


@pytest.mark.parametrize(
    "heavy",
    [
        {"prompt": "The quick brown fox jumps over the lazy dog. " * 230_000, "max_tokens": 4},
        {
            "prompt": "Once upon a time",
            "stop": [f"never seen {i}" for i in range(100_000)],
            "max_tokens": 200,
            "ignore_eos": True,
        },
        {"prompt": "Hello", "logprobs": 20, "max_tokens": 240, "ignore_eos": True},
    ],
    ids=["10MB-prompt", "100k-stop-strings", "max-logprobs"],
)
def test_heavy_requests_do_not_stall_others(app: App, heavy: dict[str, Any]) -> None:
    """While one heavy request (its limits raised on the colocated app) is being tokenized,
    matched against stop strings or serialized, small requests on the same router finish first.
    The 10 MB prompt is what needs the tokenizing off the event loop (this case fails with it
    on the loop); the other two guard against work done for the whole request at once (a
    stop list prepared at admission, a response serialized in one piece) blocking the loop."""
    small = {"prompt": "Hi", "max_tokens": 4, "temperature": 0}
    finished: dict[str, float] = {}

    def heavy_call() -> tuple[int, Any]:
        try:
            return app.http("/colocated/v1/completions", heavy)
        finally:
            finished["heavy"] = time.monotonic()

    with ThreadPoolExecutor(1) as pool:
        reply = pool.submit(heavy_call)
        time.sleep(0.3)  # the heavy request is on its way to the router
        for i in range(3):
            status, body = app.http("/colocated/v1/completions", small)
            assert status == 200, body
            finished[f"small{i}"] = time.monotonic()
        status, body = reply.result()
    assert status in (200, 400), body  # the 10 MB prompt is refused: longer than the context
    if status == 400:
        assert "output" in body["error"]["message"], body
    assert all(finished[f"small{i}"] < finished["heavy"] for i in range(3)), finished


def test_killing_the_prefill_replica_keeps_requests_completing(app: App, offline: LLM) -> None:
    """Next to last in the module: it kills a replica. Under steady traffic, requests in flight
    at the kill and requests sent after it all complete with the right tokens (fallback to
    decode-only, or recompute of a failed KV read), and Serve brings a new prefill replica up."""
    import ray

    prompts = [f"{PROMPTS[i % len(PROMPTS)]} again {i}" for i in range(40)]
    params = SamplingParams(max_tokens=32, temperature=0.0)
    expected = [o.outputs[0].token_ids for o in offline.generate(prompts, params)]
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
    assert wait_until(lambda: replica_actors("PrefillServer") not in ([], [victim]), 120)
    assert wait_until(
        lambda: (
            app.client.complete(generate_request("Hello", max_tokens=4, temperature=0.0)).route
            == "disaggregated"
        ),
        120,
    )


def test_requests_after_a_prefill_kill_go_decode_only_at_once(app: App, offline: LLM) -> None:
    """With the only prefill replica killed, requests complete decode-only (route fallback,
    right tokens) at once, not after waiting for Serve's replacement; once it runs they are
    disaggregated again."""
    import ray

    (victim,) = replica_actors("PrefillServer")
    ray.kill(ray.get_actor(victim, namespace="serve"), no_restart=True)
    prompts = [f"{PROMPTS[1]} {i}" for i in range(3)]
    params = SamplingParams(max_tokens=8, temperature=0.0)
    expected = [o.outputs[0].token_ids for o in offline.generate(prompts, params)]
    for prompt, want in zip(prompts, expected, strict=True):
        got = app.client.complete(generate_request(prompt, max_tokens=8, temperature=0.0))
        assert (got.route, got.token_ids) == ("fallback", want)
    # Answered before Serve had a replacement running (it first has to notice the death at a
    # health check, then load an engine): not after waiting for one.
    assert not prefill_replacement_running(victim)
    assert wait_until(
        lambda: (
            app.client.complete(generate_request("Hello", max_tokens=4, temperature=0.0)).route
            == "disaggregated"
        ),
        120,
    )
    assert prefill_replacement_running(victim)


def prefill_replacement_running(victim: str) -> bool:
    from ray import serve

    if replica_actors("PrefillServer") in ([], [victim]):
        return False  # not even started
    deployment = serve.status().applications[APP_NAME].deployments["PrefillServer"]
    return deployment.replica_states.get("RUNNING", 0) >= 1


def test_killing_the_decode_replica_moves_its_streams_to_the_prefill_replica(
    app: App, offline: LLM
) -> None:
    """Last in the module: SIGKILL of the only decode replica under three streams (gRPC
    greedy, gRPC seeded sampling, HTTP SSE). Each goes on on the prefill replica from the
    tokens it had (request migration) and ends as an unbroken run would have: greedy as
    offline, seeded as the colocated app draws. Meanwhile Health reports the dead replica
    unreachable; once Serve has replaced it, no engine holds a block."""
    (victim,) = replica_actors("DecodeServer")
    greedy_ids = greedy(offline, PROMPTS[2], 200, ignore_eos=True).outputs[0].token_ids
    sse_text = greedy(offline, PROMPTS[1], 200, ignore_eos=True).outputs[0].text
    seeded = {"max_tokens": 150, "temperature": 1.0, "seed": 11, "ignore_eos": True}
    seeded_ids = app.colocated.complete(generate_request(PROMPTS[3], **seeded)).token_ids
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
    assert not [e for e in sse if isinstance(e, dict) and "error" in e], sse[-3:]
    assert "".join(e["choices"][0]["text"] for e in sse if isinstance(e, dict)) == sse_text
    health = app.client.health()
    states = {(e.role, e.state) for e in health.engines}
    if ("decode", "unreachable") in states:  # not replaced yet
        assert health.status == "DEGRADED", health
    # The replacement starts; then nothing is held anywhere.
    assert wait_until(lambda: replica_actors("DecodeServer") not in ([], [victim]), 120)
    assert wait_until(app.engines_idle, 120), app.client.health()


def decode_running(app: App) -> int:
    return sum(e.num_running for e in app.client.health().engines if e.role == "decode")
