"""The OpenAI HTTP API through Serve's HTTP proxy: completions (whole and streamed) and chat
equal the offline engine's greedy answers, /v1/models, logprobs, content parts, and chat's
default length."""

from __future__ import annotations

import json

import pytest

from engine.llm import LLM
from tests.integration.serve_app.shared import MAX_MODEL_LEN, PROMPTS, greedy
from tests.integration.serving import ServedApp

pytestmark = pytest.mark.integration


def test_http_completions_match_offline(app: ServedApp, offline: LLM) -> None:
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


def test_http_chat_and_models(app: ServedApp, offline: LLM) -> None:
    conn = app.connection(timeout=60)
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


def test_http_logprobs_content_parts_and_chat_default_length(app: ServedApp) -> None:
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
