"""Which legs the router's flow runs, and what it does when one fails: short prompts skip the
prefill leg; a failed, missing or given-up prefill leg falls back to decode-only; a decode leg
that fails releases the prefill's blocks; the deadline aborts on the engines; bad prompts and
too many output tokens are refused."""

from __future__ import annotations

import asyncio
import dataclasses
import threading
from collections.abc import AsyncGenerator
from contextlib import aclosing

import pytest

from deployments.cluster.replica_set import ReplicaSets, RoleWatch
from deployments.errors import DeadlineExceeded, Unavailable
from deployments.protocol import EngineRequest
from engine.outputs import EngineCoreOutput
from engine.request import SamplingParams
from tests.model.flow_utils import idle, run, tokens
from tests.model.orchestrator.shared import PROMPT, make_flow
from tests.model.step_gate import StepGate


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
        # Once the call is queued, the last replica goes, as seen from another thread.
        threading.Thread(target=sets.publish, args=("prefill", [])).start()
        try:
            await asyncio.Event().wait()
            yield  # pragma: no cover
        finally:
            closed.set()

    sets = ReplicaSets()
    sets.publish("prefill", ["p1"])
    flow = make_flow(servers, prefill=queued, prefill_timeout_s=300.0)
    flow.prefill_replicas = RoleWatch("prefill", sets)
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
    # The decode engine is held after a few steps until the router gives the leg up: 100
    # tokens cannot beat the 0.2 s deadline however fast the machine (the tiny model's own
    # steps take well under a millisecond).
    gate = StepGate(servers[1].engine.core, monkeypatch, free_steps=3)

    async def decode(request: EngineRequest) -> AsyncGenerator[EngineCoreOutput, None]:
        try:
            async with aclosing(servers[1].generate(request)) as outputs:
                async for output in outputs:
                    yield output
        finally:
            gate.open()  # the router closed the call: the engine goes on, to its abort

    try:
        with pytest.raises(DeadlineExceeded, match="deadline"):
            run(
                make_flow(servers, decode=decode, request_timeout_s=0.2),
                PROMPT,
                max_tokens=100,
                temperature=0.0,
                ignore_eos=True,
            )
    finally:
        gate.open()
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


def test_no_engine_replica_running_refuses_at_once_with_a_retry(servers, offline):
    """Both roles' routers have seen no running replica (the model loading, GPU nodes joining):
    the request is refused before any leg is called, told when to retry, and counted; once a
    replica runs it is served. Where an engine may scale to zero (no retry set) it is not
    refused: the queued call is what makes Serve start one."""
    calls: list[str] = []

    async def queued(request: EngineRequest) -> AsyncGenerator[EngineCoreOutput, None]:
        calls.append(request.request_id)
        await asyncio.Event().wait()  # Serve's queue, waiting for a replica
        yield  # pragma: no cover

    sets = ReplicaSets()
    sets.publish("prefill", [])
    sets.publish("decode", [])
    flow = make_flow(servers, prefill=queued, decode=queued, retry_while_starting_s=7.0)
    flow.prefill_replicas = RoleWatch("prefill", sets)
    flow.decode_replicas = RoleWatch("decode", sets)
    with pytest.raises(Unavailable, match=r"no engine replica is running yet.*retry after 7 s"):
        run(flow, PROMPT, max_tokens=4, temperature=0.0)
    assert calls == []

    sets.publish("decode", ["d1"])  # one runs: the request goes to it (decode-only)
    flow.decode = servers[1].generate
    expected = offline.generate([PROMPT], SamplingParams(max_tokens=4, temperature=0))[0]
    assert tokens(run(flow, PROMPT, max_tokens=4, temperature=0.0)) == (
        expected.outputs[0].token_ids
    )

    sets.publish("decode", [])
    # May scale to zero: the call waits in Serve's queue (here until its deadline).
    flow.config = dataclasses.replace(
        flow.config, retry_while_starting_s=None, request_timeout_s=0.5
    )
    flow.decode = queued
    with pytest.raises(DeadlineExceeded):
        run(flow, PROMPT, max_tokens=4, temperature=0.0)
    assert calls  # it was sent on, to wait for a replica
