"""Request migration over real engines in this process (no Ray): a decode leg whose engine
fails part-way goes on elsewhere from the tokens already streamed, and the client's stream is
exactly the one an unbroken run gives. The failing engine is simulated by a StreamFn that stops
a real engine's stream after some outputs and raises what the router's Serve wrapper raises for
a dead replica (EngineFailure); the Serve-level tests kill real replicas.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncGenerator, Iterator
from contextlib import aclosing
from typing import Any

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from deployments.cluster.replica_set import ReplicaSets, RoleWatch
from deployments.errors import EngineFailure, Overloaded, public_message
from deployments.protocol import EngineRequest, GenerateInput
from deployments.replica.engine_server import EngineServer
from deployments.router.kv_leases import LeaseReleaser
from deployments.router.migration import MigrationPolicy
from deployments.router.orchestrator import FlowConfig, ModelFacts, Orchestrator, StreamFn
from deployments.router.telemetry import RouterTelemetry
from engine.llm import LLM
from engine.outputs import EngineCoreOutput
from engine.request import SamplingParams
from tests.model.flow_utils import idle, run, tokens

ENGINE_ARGS = {"max_model_len": 128, "kv_cache_memory_bytes": 8 << 20}
SECRET = "migration-test"
PROMPT = "Once upon a time, in a land far away, there lived a"
FAST = MigrationPolicy(max_migrations=3, backoff_s=0.01)


@pytest.fixture(scope="module")
def servers() -> Iterator[tuple[EngineServer, EngineServer]]:
    kv = {"connector": "grpc", "secret": SECRET, "lease_seconds": 30}
    prefill = EngineServer("tiny", ENGINE_ARGS, kv)
    decode = EngineServer("tiny", {**ENGINE_ARGS, "async_scheduling": True}, kv)
    yield prefill, decode
    for server in (prefill, decode):
        server.__del__()


@pytest.fixture(scope="module")
def offline() -> Iterator[LLM]:
    llm = LLM("tiny", **ENGINE_ARGS)
    yield llm
    llm.close()


class Dying:
    """A decode deployment whose first `failures` calls die after `after` outputs each
    (`after=-1`: before the call reaches the engine)."""

    def __init__(self, server: EngineServer, after: int, failures: int = 1) -> None:
        self.server = server
        self.after = after
        self.failures = failures
        self.requests: list[EngineRequest] = []

    async def __call__(self, request: EngineRequest) -> AsyncGenerator[EngineCoreOutput, None]:
        self.requests.append(request)
        dies = len(self.requests) <= self.failures
        if dies and self.after < 0:
            raise EngineFailure("the decode engine failed mid-request: test")
        sent = 0
        async with aclosing(self.server.generate(request)) as outputs:
            async for output in outputs:
                if dies and sent == self.after:
                    # Closing the engine's stream aborts the request there, as a dead
                    # replica's engine would drop it.
                    raise EngineFailure("the decode engine failed mid-request: test")
                sent += 1
                yield output
        if dies:
            raise EngineFailure("the decode engine failed mid-request: test")


def make_flow(
    servers: tuple[EngineServer, EngineServer],
    decode: StreamFn,
    prefill: StreamFn | str | None = "engine",
    telemetry: RouterTelemetry | None = None,
    **flow: Any,
) -> Orchestrator:
    prefill_server, decode_server = servers
    arch = decode_server.engine.core.arch
    return Orchestrator(
        decode_server.engine.tokenizer,
        ModelFacts("tiny", 128, arch.vocab_size),
        FlowConfig(**{"migration": FAST, **flow}),
        decode=decode,
        prefill=prefill_server.generate if prefill == "engine" else prefill,  # type: ignore[arg-type]
        release=LeaseReleaser(SECRET),
        telemetry=telemetry,
    )


def greedy(offline: LLM, max_tokens: int, **kw: Any) -> list[int]:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, **kw)
    return list(offline.generate([PROMPT], params)[0].outputs[0].token_ids)


@pytest.mark.parametrize("after", [-1, 0, 1, 5])
def test_a_failed_decode_leg_continues_token_exact(servers, offline, after):
    """Dead before the request reached its engine (the prefill's KV never read: the router
    releases it), before its first output, after the repeat of the prefill's token, or five
    tokens in: the stream is the unbroken one, text included, and every engine ends with
    nothing held."""
    dying = Dying(servers[1], after)
    flow = make_flow(servers, dying)
    chunks = run(flow, PROMPT, max_tokens=24, temperature=0.0, ignore_eos=True)
    want = greedy(offline, 24, ignore_eos=True)
    assert tokens(chunks) == want
    assert (
        "".join(c.text for c in chunks)
        == offline.generate(
            [PROMPT], SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
        )[0]
        .outputs[0]
        .text
    )
    first, resumed = dying.requests
    assert first.kv_transfer_params and not resumed.kv_transfer_params
    assert resumed.request_id != first.request_id
    # What the failed engine had streamed (outputs may come several tokens at once), and
    # nothing else, is carried over.
    carried = resumed.output_token_ids
    assert carried == want[: len(carried)] and len(carried) >= max(after, 0)
    assert (after <= 0) == (not carried)
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 24
    assert [c.migrations for c in chunks[-1:]] == [1]  # the last chunk tells the client
    assert all(c.migrations == 0 for c in chunks[:-1])
    assert {c.route for c in chunks} == {"disaggregated"}
    assert all(idle(s) for s in servers)


def test_seeded_sampling_continues_draw_for_draw(servers):
    params = {"max_tokens": 20, "temperature": 1.0, "top_k": 50, "seed": 77, "ignore_eos": True}
    unbroken = run(make_flow(servers, servers[1].generate), PROMPT, **params)
    migrated = run(make_flow(servers, Dying(servers[1], after=6, failures=2)), PROMPT, **params)
    colocated = run(make_flow(servers, Dying(servers[1], after=3), prefill=None), PROMPT, **params)
    assert tokens(migrated) == tokens(unbroken) == tokens(colocated)
    assert all(idle(s) for s in servers)


def test_stop_strings_and_max_tokens_count_across_the_move(servers, offline):
    full = offline.generate([PROMPT], SamplingParams(max_tokens=24, temperature=0))[0]
    text = full.outputs[0].text
    stop = text[len(text) * 2 // 3 :][:3]
    want = offline.generate([PROMPT], SamplingParams(max_tokens=24, temperature=0, stop=[stop]))
    chunks = run(
        make_flow(servers, Dying(servers[1], after=2)),
        PROMPT,
        max_tokens=24,
        temperature=0.0,
        stop=[stop],
    )
    assert tokens(chunks) == want[0].outputs[0].token_ids
    assert "".join(c.text for c in chunks) == want[0].outputs[0].text
    assert all(idle(s) for s in servers)


def test_with_no_decode_replica_left_a_prefill_engine_finishes(servers, offline):
    """The decode role's router saw its replica set empty: the request moves to the prefill
    deployment at once, not into Serve's queue for a replacement."""
    sets = ReplicaSets()
    sets.publish("decode", ["d1"])
    dying = Dying(servers[1], after=4, failures=99)
    on_prefill: list[EngineRequest] = []

    async def prefill(request: EngineRequest) -> AsyncGenerator[EngineCoreOutput, None]:
        on_prefill.append(request)
        async with aclosing(servers[0].generate(request)) as outputs:
            async for output in outputs:
                yield output

    original = dying.__call__

    async def decode(request: EngineRequest) -> AsyncGenerator[EngineCoreOutput, None]:
        async with aclosing(original(request)) as outputs:
            try:
                async for output in outputs:
                    yield output
            except EngineFailure:
                sets.publish("decode", [])  # the replica is gone, Serve's router saw it
                raise

    flow = make_flow(servers, decode, prefill=prefill)
    flow.decode_replicas = RoleWatch("decode", sets)
    chunks = run(flow, PROMPT, max_tokens=20, temperature=0.0, ignore_eos=True)
    assert tokens(chunks) == greedy(offline, 20, ignore_eos=True)
    assert len(dying.requests) == 1
    assert on_prefill[-1].output_token_ids and not on_prefill[-1].kv_transfer_params
    assert all(idle(s) for s in servers)


def test_a_resumed_call_stuck_in_serves_queue_moves_when_the_role_empties(servers, offline):
    """The resumed request was sent to the decode role, whose last replica then died: it
    waits in Serve's queue no longer than until the router sees the set empty."""
    sets = ReplicaSets()
    sets.publish("decode", ["d1"])
    calls: list[EngineRequest] = []
    closed = threading.Event()

    async def decode(request: EngineRequest) -> AsyncGenerator[EngineCoreOutput, None]:
        calls.append(request)
        if len(calls) == 1:
            async for output in Dying(servers[1], after=3)(request):
                yield output
            return
        # Queued: now the last replica goes, as seen from another thread.
        threading.Thread(target=sets.publish, args=("decode", [])).start()
        try:
            await asyncio.Event().wait()  # queued for a replica that does not come
            yield  # pragma: no cover
        finally:
            closed.set()

    flow = make_flow(servers, decode, request_timeout_s=60.0)
    flow.decode_replicas = RoleWatch("decode", sets)
    chunks = run(flow, PROMPT, max_tokens=16, temperature=0.0, ignore_eos=True)
    assert tokens(chunks) == greedy(offline, 16, ignore_eos=True)
    assert len(calls) == 2 and closed.is_set()
    assert all(idle(s) for s in servers)


def test_migrations_are_bounded_and_end_with_a_clean_error(servers):
    dying = Dying(servers[1], after=2, failures=99)
    flow = make_flow(servers, dying, migration=MigrationPolicy(max_migrations=2, backoff_s=0))
    with pytest.raises(EngineFailure) as info:
        run(flow, PROMPT, max_tokens=20, temperature=0.0, ignore_eos=True)
    assert len(dying.requests) == 3
    assert public_message(info.value) == "the decode engine failed mid-request: test"
    assert all(idle(s) for s in servers)


def test_migration_off_fails_the_stream(servers):
    dying = Dying(servers[1], after=2)
    flow = make_flow(servers, dying, migration=MigrationPolicy(max_migrations=0))
    with pytest.raises(EngineFailure):
        run(flow, PROMPT, max_tokens=10, temperature=0.0)
    assert len(dying.requests) == 1
    assert all(idle(s) for s in servers)


def test_an_engine_that_reports_an_error_is_left_too(servers, offline):
    import dataclasses

    calls = 0

    async def erring(request: EngineRequest) -> AsyncGenerator[EngineCoreOutput, None]:
        nonlocal calls
        calls += 1
        async with aclosing(servers[1].generate(request)) as outputs:
            async for output in outputs:
                if calls == 1 and output.new_token_ids:
                    yield dataclasses.replace(output, error="engine loop stopped")
                    return
                yield output

    chunks = run(make_flow(servers, erring), PROMPT, max_tokens=12, temperature=0.0)
    assert tokens(chunks) == greedy(offline, 12)
    assert calls == 2
    assert all(idle(s) for s in servers)


def test_the_trace_shows_each_move(servers):
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    telemetry = RouterTelemetry(provider.get_tracer("test"))
    flow = make_flow(servers, Dying(servers[1], after=3, failures=2), telemetry=telemetry)
    chunks = run(flow, PROMPT, max_tokens=16, temperature=0.0, ignore_eos=True)
    assert chunks[-1].migrations == 2
    (span,) = [s for s in exporter.get_finished_spans() if s.name == "router.request"]
    moves = [e for e in span.events if e.name == "pdserve.migration"]
    assert [e.attributes["pdserve.migration.attempt"] for e in moves] == [1, 2]
    assert [e.attributes["pdserve.migration.target"] for e in moves] == ["decode", "decode"]
    assert span.attributes["pdserve.migrations"] == 2
    assert span.attributes["pdserve.outcome"] == "ok"


def test_a_new_request_with_no_decode_replica_is_served_by_a_prefill_engine(servers, offline):
    sets = ReplicaSets()
    sets.publish("decode", [])
    decode_calls: list[EngineRequest] = []

    async def decode(request: EngineRequest) -> AsyncGenerator[EngineCoreOutput, None]:
        decode_calls.append(request)
        await asyncio.Event().wait()  # Serve's queue, waiting for a replacement
        yield  # pragma: no cover

    flow = make_flow(servers, decode)
    flow.decode_replicas = RoleWatch("decode", sets)
    chunks = run(flow, PROMPT, max_tokens=12, temperature=0.0)
    assert tokens(chunks) == greedy(offline, 12)
    assert {c.route for c in chunks} == {"fallback"} and not decode_calls
    assert all(idle(s) for s in servers)


def test_an_abort_while_waiting_for_the_first_output_closes_the_call(servers):
    sets = ReplicaSets()
    sets.publish("decode", ["d1"])
    closed = threading.Event()
    waiting = asyncio.Event()

    async def decode(request: EngineRequest) -> AsyncGenerator[EngineCoreOutput, None]:
        try:
            waiting.set()
            await asyncio.Event().wait()
            yield  # pragma: no cover
        finally:
            closed.set()

    flow = make_flow(servers, decode, min_remote_prefill_tokens=1000)  # decode-only
    flow.decode_replicas = RoleWatch("decode", sets)

    async def go() -> None:
        request = GenerateInput(PROMPT, SamplingParams(max_tokens=8, temperature=0.0))
        task = asyncio.create_task(anext(flow.generate(request)))
        await asyncio.wait_for(waiting.wait(), 10)  # the call waits for its first output
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(go())
    assert closed.is_set()


def overloaded_first(server: EngineServer, calls: list[EngineRequest], times: int = 1) -> StreamFn:
    """A deployment whose first `times` calls are refused at admission (as the router's Serve
    wrapper reports a full queue)."""

    async def stream(request: EngineRequest) -> AsyncGenerator[EngineCoreOutput, None]:
        calls.append(request)
        if len(calls) <= times:
            raise Overloaded("the decode engines are at capacity; retry later", 2.0)
        async with aclosing(server.generate(request)) as outputs:
            async for output in outputs:
                yield output

    return stream


def test_a_full_engine_refuses_before_anything_is_sent_and_nothing_moves(servers):
    """Decode-only: refused at once (no migration, no retry); a full prefill deployment is not
    a reason to go decode-only (that would move the load, not shed it)."""
    calls: list[EngineRequest] = []
    flow = make_flow(servers, overloaded_first(servers[1], calls), min_remote_prefill_tokens=999)
    with pytest.raises(Overloaded) as info:
        run(flow, PROMPT, max_tokens=8, temperature=0.0)
    assert len(calls) == 1 and info.value.retry_after_s == 2.0
    prefill_calls: list[EngineRequest] = []
    decode = Dying(servers[1], after=0, failures=0)
    flow = make_flow(servers, decode, prefill=overloaded_first(servers[0], prefill_calls))
    with pytest.raises(Overloaded):
        run(flow, PROMPT, max_tokens=8, temperature=0.0)
    assert len(prefill_calls) == 1 and not decode.requests
    assert all(idle(s) for s in servers)


def test_a_full_decode_deployment_after_the_first_token_is_a_move(servers, offline):
    """The client already has the prefill's token: the decode leg is retried elsewhere, not
    refused."""
    calls: list[EngineRequest] = []
    flow = make_flow(servers, overloaded_first(servers[1], calls))
    chunks = run(flow, PROMPT, max_tokens=12, temperature=0.0)
    assert tokens(chunks) == greedy(offline, 12)
    assert len(calls) == 2 and calls[0].kv_transfer_params and not calls[1].kv_transfer_params
    assert all(idle(s) for s in servers)


def test_capacity_mid_stream_is_a_failure_not_a_429(servers):
    """The client has the prefill's token; when no decode engine takes the request on, it
    ends as a failure (UNAVAILABLE), never as "retry later" over a half-sent answer."""
    calls: list[EngineRequest] = []
    flow = make_flow(
        servers,
        overloaded_first(servers[1], calls, times=99),
        migration=MigrationPolicy(max_migrations=1, backoff_s=0),
    )
    with pytest.raises(EngineFailure, match="no engine could take the request on"):
        run(flow, PROMPT, max_tokens=8, temperature=0.0)
    assert len(calls) == 2
    assert all(idle(s) for s in servers)
