"""The router's flow over two real engines in this process (the package's conftest.py): what
the two legs answer equals the offline engine's answer, token for token and as it streams —
logprobs, stop strings (in a coalesced chunk, in the first token's text), seeded sampling,
structured outputs, a speculating decode engine — and the prefill's blocks come back."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import AsyncGenerator

import pytest

from deployments.protocol import EngineRequest
from deployments.replica.engine_server import EngineServer
from engine.outputs import EngineCoreOutput
from engine.request import SamplingParams, StructuredOutputsParams
from tests.model.flow_utils import idle, run, tokens
from tests.model.orchestrator.shared import ENGINE_ARGS, PROMPT, SECRET, make_flow


def test_disaggregated_equals_offline_and_streams_token_by_token(servers, offline):
    expected = offline.generate([PROMPT], SamplingParams(max_tokens=20, temperature=0))[0]
    chunks = run(make_flow(servers), PROMPT, max_tokens=20, temperature=0.0)
    assert tokens(chunks) == expected.outputs[0].token_ids
    assert "".join(c.text for c in chunks) == expected.outputs[0].text
    assert len(chunks) >= 10  # streamed as produced (a few coalesced if we fall behind)
    assert len(chunks[0].token_ids) == 1  # the prefill's token comes alone, at once
    assert {c.route for c in chunks} == {"disaggregated"}
    assert chunks[0].prompt_token_ids == expected.prompt_token_ids
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 20
    assert all(idle(s) for s in servers)


def test_logprobs_follow_the_tokens_across_the_legs(servers):
    disaggregated = run(make_flow(servers), PROMPT, max_tokens=6, temperature=0.0, logprobs=2)
    colocated = run(
        make_flow(servers, prefill=None), PROMPT, max_tokens=6, temperature=0.0, logprobs=2
    )
    for chunks in (disaggregated, colocated):
        pairs = [
            (t, lp) for c in chunks for t, lp in zip(c.token_ids, c.logprobs or (), strict=True)
        ]
        assert [t for t, _ in pairs] == tokens(chunks)
        assert all(lp[0][0] == t and len(lp[0]) == 3 for t, lp in pairs)  # sampled + top-2
    assert [lp[0] for c in disaggregated for lp in c.logprobs or ()] == [
        lp[0] for c in colocated for lp in c.logprobs or ()
    ]


def test_decode_continues_the_token_the_prefill_sent_even_if_it_would_pick_another(
    servers, offline
):
    """Prefill and decode logits may differ in the last bits (other batch, other kernels): the
    decode must continue the token the client already has. Simulated by a prefill leg whose
    token is not the model's greedy pick."""
    prefill_server = servers[0]
    greedy_first = offline.generate([PROMPT], SamplingParams(max_tokens=1, temperature=0))[0]
    other = (greedy_first.outputs[0].token_ids[0] + 1) % 2000

    async def diverging(request: EngineRequest) -> AsyncGenerator[EngineCoreOutput, None]:
        async for chunk in prefill_server.generate(request):
            yield dataclasses.replace(chunk, new_token_ids=[other])

    chunks = run(make_flow(servers, prefill=diverging), PROMPT, max_tokens=10, temperature=0.0)
    prompt_ids = greedy_first.prompt_token_ids
    rest = offline.generate([[*prompt_ids, other]], SamplingParams(max_tokens=9, temperature=0))
    assert tokens(chunks) == [other, *rest[0].outputs[0].token_ids]
    assert all(idle(s) for s in servers)


def test_stop_string_inside_a_coalesced_decode_chunk(servers, offline):
    """An engine may send several tokens in one chunk: the stop string still ends the request
    at the token that completed it, exactly as offline."""
    decode_server = servers[1]

    async def all_at_once(request: EngineRequest) -> AsyncGenerator[EngineCoreOutput, None]:
        chunks = [chunk async for chunk in decode_server.generate(request)]
        yield dataclasses.replace(
            chunks[-1], new_token_ids=[t for c in chunks for t in c.new_token_ids]
        )

    full = offline.generate([PROMPT], SamplingParams(max_tokens=24, temperature=0))[0]
    text = full.outputs[0].text
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    expected = offline.generate(
        [PROMPT], SamplingParams(max_tokens=24, temperature=0, stop=[stop])
    )[0].outputs[0]
    chunks = run(
        make_flow(servers, decode=all_at_once), PROMPT, max_tokens=24, temperature=0.0, stop=[stop]
    )
    assert len(chunks) == 2  # the prefill's token, then everything else at once
    assert tokens(chunks) == expected.token_ids
    assert "".join(c.text for c in chunks) == expected.text
    assert chunks[-1].finish_reason == "stop"


def test_seeded_sampling_equals_colocated(servers):
    params = {"max_tokens": 16, "temperature": 1.0, "top_k": 50, "seed": 1234}
    disaggregated = run(make_flow(servers), PROMPT, **params)
    colocated = run(make_flow(servers, prefill=None), PROMPT, **params)
    assert tokens(disaggregated) == tokens(colocated)
    assert colocated[-1].route == "colocated"


def test_first_token_that_ends_the_request_releases_the_prefill_blocks(servers, offline):
    first = offline.generate([PROMPT], SamplingParams(max_tokens=1, temperature=0))[0]
    first_token = first.outputs[0].token_ids[0]
    chunks = run(
        make_flow(servers), PROMPT, max_tokens=20, temperature=0.0, stop_token_ids=[first_token]
    )
    assert tokens(chunks) == [first_token]
    assert chunks[-1].finish_reason == "stop"
    # The router released the lease: the prefill blocks are back well before it expires.
    assert idle(servers[0], timeout_s=5.0)


def test_stop_string_in_the_first_token_text(servers, offline):
    first = offline.generate(["Hello"], SamplingParams(max_tokens=1, temperature=0))[0]
    text = first.outputs[0].text
    assert text and "\ufffd" not in text  # the first token decodes to whole characters
    chunks = run(make_flow(servers), "Hello", max_tokens=20, temperature=0.0, stop=[text[-2:]])
    assert chunks[-1].finish_reason == "stop"
    assert len(tokens(chunks)) == 1
    assert idle(servers[0], timeout_s=5.0)


STRUCTURED = StructuredOutputsParams(
    json=json.dumps(
        {
            "type": "object",
            "properties": {"ok": {"type": "boolean"}, "tag": {"enum": ["red", "green", "blue"]}},
            "required": ["ok", "tag"],
            "additionalProperties": False,
        }
    )
)


@pytest.mark.parametrize("sampling", [{"temperature": 0.0}, {"temperature": 1.0, "seed": 11}])
def test_constrained_output_is_the_same_disaggregated_and_colocated(servers, offline, sampling):
    """The prefill engine constrains the first token; the decode engine's grammar starts after
    it: the two legs give what one engine gives, greedy and seeded."""
    params = dict(max_tokens=40, structured_outputs=STRUCTURED, **sampling)
    disaggregated = run(make_flow(servers), PROMPT, **params)
    colocated = run(make_flow(servers, prefill=None), PROMPT, **params)
    expected = offline.generate([PROMPT], SamplingParams(**params))[0].outputs[0]
    assert {c.route for c in disaggregated} == {"disaggregated"}
    assert tokens(disaggregated) == tokens(colocated) == expected.token_ids
    text = "".join(c.text for c in disaggregated)
    assert text == expected.text
    value = json.loads(text)
    assert set(value) == {"ok", "tag"} and value["tag"] in ("red", "green", "blue")
    assert disaggregated[-1].finish_reason == "stop"
    assert all(idle(s) for s in servers)


@pytest.mark.parametrize(
    "spec",
    [
        {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2},
        {"method": "draft_model", "model": "tiny", "num_speculative_tokens": 3},
    ],
    ids=["ngram", "draft_model"],
)
def test_a_speculating_decode_engine_equals_offline(servers, offline, spec):
    """In P/D the decode engine speculates (n-gram drafts, or a draft model that computes the
    prompt's draft K/V itself, the target's having come from the prefill engine; once the
    prefill's token is out): the same greedy tokens as offline generation without it."""
    kv = {"connector": "grpc", "secret": SECRET, "lease_seconds": 30}
    decode = EngineServer("tiny", {**ENGINE_ARGS, "speculative_config": spec}, kv)
    try:
        prompt = f"{PROMPT}. {PROMPT}."
        params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
        expected = offline.generate([prompt], params)[0]
        chunks = run(
            make_flow((servers[0], decode)), prompt, max_tokens=40, temperature=0.0, ignore_eos=True
        )
        assert tokens(chunks) == expected.outputs[0].token_ids
        assert {c.route for c in chunks} == {"disaggregated"}
        assert decode.engine.core.scheduler.speculator.stats.num_accepted_tokens > 0
        assert idle(servers[0]) and idle(decode)
    finally:
        decode.__del__()
