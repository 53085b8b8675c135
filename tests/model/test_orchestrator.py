"""The router's flow over real engines in this process (no Ray): two EngineServers joined by the
gRPC KV transport, and the offline LLM as the oracle.

Why this file is long: the tests share the module's two engines (and a module of its own would
build two more); the cache-aware tests at the end add engines of their own only where a test
needs a fresh cache.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import threading
import time
from collections.abc import AsyncGenerator, Iterator
from typing import Any

import pytest

from deployments.cluster.kv_scoring import CacheSurvey, survey
from deployments.cluster.replica_set import ReplicaSets, RoleWatch
from deployments.errors import DeadlineExceeded
from deployments.protocol import EngineRequest
from deployments.replica.engine_server import EngineServer
from deployments.router.kv_leases import LeaseReleaser, PrefixBorrower
from deployments.router.orchestrator import (
    FlowConfig,
    ModelFacts,
    Orchestrator,
)
from engine.llm import LLM
from engine.outputs import EngineCoreOutput
from engine.request import SamplingParams, StructuredOutputsParams
from tests.model.flow_utils import idle, run, tokens

ENGINE_ARGS = {"max_model_len": 128, "kv_cache_memory_bytes": 8 << 20}
SECRET = "orchestrator-test"
PROMPT = "The quick brown fox jumps over the lazy dog"


@pytest.fixture(scope="module")
def servers() -> Iterator[tuple[EngineServer, EngineServer]]:
    kv = {"connector": "grpc", "secret": SECRET, "lease_seconds": 30}
    # Both engines schedule asynchronously; the offline oracle does not.
    prefill = EngineServer("tiny", {**ENGINE_ARGS, "async_scheduling": True}, kv)
    decode = EngineServer("tiny", {**ENGINE_ARGS, "async_scheduling": True}, kv)
    yield prefill, decode
    for server in (prefill, decode):
        server.__del__()


@pytest.fixture(scope="module")
def offline() -> Iterator[LLM]:
    llm = LLM("tiny", **ENGINE_ARGS)
    yield llm
    llm.close()


def make_flow(
    servers: tuple[EngineServer, EngineServer],
    prefill: Any = "engine",
    decode: Any = None,
    **flow: Any,
) -> Orchestrator:
    prefill_server, decode_server = servers
    tokenizer = decode_server.engine.tokenizer
    arch = decode_server.engine.core.arch
    facts = ModelFacts("tiny", 128, arch.vocab_size)
    return Orchestrator(
        tokenizer,
        facts,
        FlowConfig(**flow),
        decode=decode or decode_server.generate,
        prefill=prefill_server.generate if prefill == "engine" else prefill,
        release=LeaseReleaser(SECRET),
    )


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


def test_failed_prefill_leg_falls_back_to_decode_only(servers, offline):
    async def broken(request: EngineRequest) -> AsyncGenerator[EngineCoreOutput, None]:
        raise RuntimeError("prefill replica died")
        yield  # pragma: no cover (makes this an async generator)

    expected = offline.generate([PROMPT], SamplingParams(max_tokens=12, temperature=0))[0]
    chunks = run(make_flow(servers, prefill=broken), PROMPT, max_tokens=12, temperature=0.0)
    assert tokens(chunks) == expected.outputs[0].token_ids
    assert {c.route for c in chunks} == {"fallback"}


def test_no_prefill_replica_running_means_decode_only_at_once(servers, offline):
    """The prefill role's request router saw no running replica: the prefill leg is not even
    tried (Serve would queue it until a replacement starts)."""
    calls: list[str] = []

    async def never(request: EngineRequest) -> AsyncGenerator[EngineCoreOutput, None]:
        calls.append(request.request_id)
        await asyncio.Event().wait()  # a call queued for a replica that does not come
        yield  # pragma: no cover

    sets = ReplicaSets()
    sets.publish("prefill", [])
    flow = make_flow(servers, prefill=never)
    flow.prefill_replicas = RoleWatch("prefill", sets)
    expected = offline.generate([PROMPT], SamplingParams(max_tokens=8, temperature=0))[0]
    chunks = run(flow, PROMPT, max_tokens=8, temperature=0.0)
    assert tokens(chunks) == expected.outputs[0].token_ids
    assert {c.route for c in chunks} == {"fallback"} and not calls


def test_prefill_replica_set_emptied_while_waiting_gives_the_leg_up(servers, offline):
    """A prefill call waiting in Serve's queue is given up the moment the router sees the
    last prefill replica gone (published from Serve's router thread), not at prefill_timeout_s;
    the abandoned call is closed."""
    closed = threading.Event()

    async def queued(request: EngineRequest) -> AsyncGenerator[EngineCoreOutput, None]:
        try:
            await asyncio.Event().wait()
            yield  # pragma: no cover
        finally:
            closed.set()

    sets = ReplicaSets()
    sets.publish("prefill", ["p1"])
    flow = make_flow(servers, prefill=queued, prefill_timeout_s=300.0)
    flow.prefill_replicas = RoleWatch("prefill", sets)
    threading.Timer(0.5, sets.publish, ("prefill", [])).start()
    expected = offline.generate([PROMPT], SamplingParams(max_tokens=8, temperature=0))[0]
    chunks = run(flow, PROMPT, max_tokens=8, temperature=0.0)
    assert tokens(chunks) == expected.outputs[0].token_ids
    assert {c.route for c in chunks} == {"fallback"}
    assert closed.is_set()
    sets.publish("prefill", ["p1"])  # a replacement runs: disaggregated again
    flow = make_flow(servers)
    flow.prefill_replicas = RoleWatch("prefill", sets)
    chunks = run(flow, PROMPT, max_tokens=8, temperature=0.0)
    assert tokens(chunks) == expected.outputs[0].token_ids
    assert chunks[-1].route == "disaggregated"


def test_short_prompts_skip_the_prefill_leg(servers, offline):
    expected = offline.generate(["Hi"], SamplingParams(max_tokens=8, temperature=0))[0]
    flow = make_flow(servers, min_remote_prefill_tokens=8)
    chunks = run(flow, "Hi", max_tokens=8, temperature=0.0)
    assert tokens(chunks) == expected.outputs[0].token_ids
    assert chunks[-1].route == "decode_only"


def test_decode_leg_that_fails_before_reading_releases_the_prefill_blocks(servers):
    async def broken(request: EngineRequest) -> AsyncGenerator[EngineCoreOutput, None]:
        raise RuntimeError("decode replica died")
        yield  # pragma: no cover

    with pytest.raises(RuntimeError, match="decode replica died"):
        run(make_flow(servers, decode=broken), PROMPT, max_tokens=8, temperature=0.0)
    assert idle(servers[0], timeout_s=5.0)


def test_deadline_aborts_on_the_engines(servers, monkeypatch):
    # Decode steps of at least 10 ms: 100 tokens cannot beat the 0.2 s deadline however fast
    # the machine (the tiny model's own steps take well under a millisecond).
    runner = servers[1].engine.core.runner
    step = runner.execute_model

    def slow_step(scheduler_output):
        time.sleep(0.01)
        return step(scheduler_output)

    monkeypatch.setattr(runner, "execute_model", slow_step)
    with pytest.raises(DeadlineExceeded, match="deadline"):
        run(
            make_flow(servers, request_timeout_s=0.2),
            PROMPT,
            max_tokens=100,
            temperature=0.0,
            ignore_eos=True,
        )
    assert all(idle(s) for s in servers)


@pytest.mark.parametrize(
    ("prompt", "message"),
    [
        ("", "prompt is empty"),
        ([], "prompt is empty"),
        ([1, 10**6], "vocabulary"),
        (list(range(3, 140)), "max_model_len"),
    ],
)
def test_bad_prompts_are_value_errors(servers, prompt, message):
    with pytest.raises(ValueError, match=message):
        run(make_flow(servers), prompt, max_tokens=4)


def test_max_tokens_beyond_the_context_is_refused_not_cut(servers, offline):
    """128-token context: a 120-token prompt leaves 8 output tokens. Asking for 9 is an error
    that says so; asking for exactly 8 runs to the end of the context."""
    prompt = list(range(3, 123))
    with pytest.raises(ValueError, match="at most 8 output tokens remain"):
        run(make_flow(servers), prompt, max_tokens=9, temperature=0.0, ignore_eos=True)
    chunks = run(make_flow(servers), prompt, max_tokens=8, temperature=0.0, ignore_eos=True)
    assert len(tokens(chunks)) == 8 and chunks[-1].finish_reason == "length"
    assert all(idle(s) for s in servers)


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


class IndexOf:
    """A ClusterCache over engines in this process: each engine's cache, with its role and
    side channel, announced to the app's real index (KVIndexServer) at every survey; the
    Serve app keeps that index current from the engines' events instead."""

    def __init__(self, engines: dict[str, tuple[str, EngineServer]]) -> None:
        self.engines = engines

    async def survey(self, prompt: list[int], cache_salt: str | None) -> CacheSurvey | None:
        from deployments.cluster.kv_index import KVIndexServer
        from engine.core.kv_cache_utils import prompt_block_hashes
        from engine.core.kv_events import KVSnapshot

        index = KVIndexServer()
        block_size = 16
        for name, (role, server) in self.engines.items():
            pool = server.engine.core.scheduler.kv_cache_manager.block_pool
            cached = server.engine.run_on_loop(pool.cached_block_hashes).result(timeout=10)
            core = server.engine.core
            address = f"{core.config.kv_transfer.side_channel_host}:{core.side_channel_port}"
            index.load_snapshot(name, KVSnapshot("e", 0, tuple(cached)), role, None, address)
        hashes = prompt_block_hashes(prompt, block_size, cache_salt)
        return survey(index.lookup(hashes), hashes, len(prompt), block_size)


@pytest.mark.parametrize("limit", [64, 0], ids=["cache-aware", "off"])
def test_a_follow_up_turn_the_decode_replica_holds_skips_the_prefill_leg(servers, offline, limit):
    """Cache-aware disaggregation: the decode replica that produced turn one's answer holds
    the prompt and the answer; turn two's prompt adds a short tail, which that replica
    computes itself (route decode_cached, the request hinted to it) instead of a prefill
    replica recomputing the answer and moving the whole prompt's KV."""
    kv = {"connector": "grpc", "secret": SECRET, "lease_seconds": 30}
    decode = EngineServer("tiny", ENGINE_ARGS, kv)
    prefill_calls: list[EngineRequest] = []
    decode_calls: list[EngineRequest] = []

    def recording(fn: Any, calls: list[EngineRequest]) -> Any:
        def call(request: EngineRequest) -> AsyncGenerator[EngineCoreOutput, None]:
            calls.append(request)
            return fn(request)

        return call

    try:
        flow = make_flow(
            (servers[0], decode),
            prefill=recording(servers[0].generate, prefill_calls),
            decode=recording(decode.generate, decode_calls),
            max_local_prefill_tokens=limit,
        )
        flow.cluster_cache = IndexOf({"decode-0": ("decode", decode)})
        params = {"max_tokens": 24, "temperature": 0.0, "ignore_eos": True}
        first_prompt = list(range(100, 140))
        first = run(flow, first_prompt, **params)
        assert {c.route for c in first} == {"disaggregated"}  # nothing cached anywhere yet
        follow_up = first_prompt + tokens(first) + list(range(300, 310))
        expected = offline.generate([follow_up], SamplingParams(**params))[0]
        prefill_calls.clear()
        decode_calls.clear()
        second = run(flow, follow_up, **params)
        assert tokens(second) == expected.outputs[0].token_ids
        if limit:
            assert {c.route for c in second} == {"decode_cached"}
            assert not prefill_calls
            assert [r.replica_hint for r in decode_calls] == ["decode-0"]
            # Every full block of turn one's computed KV was read from the cache: its prompt
            # and answer but the last answer token, which was sampled and never fed back.
            assert second[-1].usage.cached_tokens == (40 + 24 - 1) // 16 * 16
        else:
            assert {c.route for c in second} == {"disaggregated"}
            assert len(prefill_calls) == 1
        assert idle(servers[0]) and idle(decode)
    finally:
        decode.__del__()


@pytest.mark.parametrize("min_loan", [32, 0], ids=["loan", "off"])
def test_a_prefill_engine_borrows_the_prefix_a_decode_engine_holds(servers, offline, min_loan):
    """Prefix loans: turn two goes to a prefill engine that never saw turn one. The decode
    engine that wrote turn one's answer holds its prompt and answer; it lends those blocks
    (LendPrefix, under a lease), the prefill engine reads them over the side channel's
    transport and computes only the rest, and the answer is the one offline generation
    gives. Afterwards no engine holds a block."""
    kv = {"connector": "grpc", "secret": SECRET, "lease_seconds": 30}
    decode = EngineServer("tiny", ENGINE_ARGS, kv)
    fresh = EngineServer("tiny", ENGINE_ARGS, kv)  # the second turn's prefill engine
    params = {"max_tokens": 24, "temperature": 0.0, "ignore_eos": True}
    try:
        cache = IndexOf({"decode-0": ("decode", decode), "prefill-1": ("prefill", fresh)})
        loans = {"max_local_prefill_tokens": 16, "min_prefix_loan_tokens": min_loan}
        first_flow = make_flow((servers[0], decode), **loans)
        first_prompt = list(range(100, 140))
        first = run(first_flow, first_prompt, **params)
        follow_up = first_prompt + tokens(first) + list(range(300, 340))
        flow = make_flow((fresh, decode), **loans)
        flow.cluster_cache = cache
        flow.borrower = PrefixBorrower(SECRET, 16, min_loan)
        second = run(flow, follow_up, **params)
        expected = offline.generate([follow_up], SamplingParams(**params))[0]
        assert tokens(second) == expected.outputs[0].token_ids
        assert {c.route for c in second} == {"disaggregated"}  # 40 new tokens > 16
        read = fresh.engine.core.connector.stats["blocks_read"]
        if min_loan:
            # Turn one's KV but its last answer token: 63 tokens, 3 whole blocks, read.
            assert read == 3
        else:
            assert read == 0
        assert idle(servers[0]) and idle(decode) and idle(fresh)
        assert decode.engine.core.scheduler.kv_cache_manager.num_lent_blocks == 0
    finally:
        decode.__del__()
        fresh.__del__()


def test_a_loan_nobody_reads_is_released_and_an_engine_lends_nothing_it_lacks(servers):
    """The lender's side: blocks are lent only for hashes it holds, stay out of eviction
    while lent, and come back when the lease is released."""
    from connector.side_channel_client import SideChannelClient, SideChannelError
    from engine.core.kv_cache_utils import prompt_block_hashes

    engine = servers[1]
    prompt = list(range(500, 548))
    list(run(make_flow(servers), prompt, max_tokens=2, temperature=0.0))
    assert idle(engine)
    core = engine.engine.core
    client = SideChannelClient(
        core.config.kv_transfer.side_channel_host, core.side_channel_port, SECRET
    )
    try:
        hashes = prompt_block_hashes(prompt, 16)
        assert client.lend_prefix(prompt_block_hashes(list(range(900, 948)), 16)).block_ids == []
        with pytest.raises(SideChannelError, match="INVALID_ARGUMENT"):
            client.lend_prefix([])
        reply = client.lend_prefix(hashes)
        assert len(reply.block_ids) == 3 and reply.lease_id
        stats = engine.stats()
        assert stats["num_free_blocks"] == stats["num_blocks"] - 3  # held for the borrower
        assert client.release(reply.lease_id)
        assert idle(engine)
        assert engine.engine.core.scheduler.kv_cache_manager.num_lent_blocks == 0
    finally:
        client.close()


def test_a_loan_nobody_releases_expires_and_its_blocks_come_back(offline):
    """A borrower that never reads nor releases: the lease expires, and the lender frees the
    blocks on its own (nothing pinned for nobody)."""
    from connector.side_channel_client import SideChannelClient
    from engine.core.kv_cache_utils import prompt_block_hashes

    kv = {"connector": "grpc", "secret": SECRET, "lease_seconds": 0.5}
    lender = EngineServer("tiny", ENGINE_ARGS, kv)
    core = lender.engine.core
    client = SideChannelClient(
        core.config.kv_transfer.side_channel_host, core.side_channel_port, SECRET
    )
    try:
        prompt = list(range(600, 648))
        run(make_flow((lender, lender), prefill=None), prompt, max_tokens=2, temperature=0.0)
        reply = client.lend_prefix(prompt_block_hashes(prompt, 16))
        assert len(reply.block_ids) == 3  # the prompt's three full blocks
        assert core.scheduler.kv_cache_manager.num_lent_blocks == 3
        assert idle(lender, timeout_s=10)  # expired, freed, not read by anyone
        assert core.scheduler.kv_cache_manager.num_lent_blocks == 0
    finally:
        client.close()
        lender.__del__()


def test_a_loan_the_prefill_engine_refuses_falls_back_instead_of_failing(servers, offline):
    """A loan made for other tokens is refused by the prefill engine (ValueError): that is no
    fault of the client's request, which is served decode-only with the right tokens."""

    class WrongLoan:
        async def borrow(self, prompt, survey):
            return {
                "do_remote_prefill": True,
                "remote_engine_id": "elsewhere",
                "remote_request_id": "lend-x",
                "remote_block_ids": [1],
                "remote_host": "127.0.0.1",
                "remote_port": 1,
                "lease_id": "l",
                "remote_num_tokens": 16,
                "remote_tokens_hash": "not these tokens",
            }

    flow = make_flow(servers)
    flow.borrower = WrongLoan()
    params = {"max_tokens": 8, "temperature": 0.0, "ignore_eos": True}
    prompt = list(range(700, 740))
    chunks = run(flow, prompt, **params)
    expected = offline.generate([prompt], SamplingParams(**params))[0]
    assert tokens(chunks) == expected.outputs[0].token_ids
    assert {c.route for c in chunks} == {"fallback"}
    assert idle(servers[0]) and idle(servers[1])
