"""AsyncEngine: streaming from the background engine thread, aborts, bad input."""

from __future__ import annotations

import asyncio
import threading

import pytest

from engine.async_engine import AsyncEngine
from engine.llm import LLM
from engine.request import SamplingParams
from tests.model.step_gate import StepGate
from tests.waiting import wait_until, wait_until_async

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def engine(hf_refs):
    eng = AsyncEngine(
        hf_refs["llama_gqa"].path, max_model_len=96, block_size=4, num_gpu_blocks_override=200
    )
    yield eng
    eng.shutdown()


async def collect(engine, prompt, params=GREEDY, **kw):
    return [out async for out in engine.generate(prompt, params, **kw)]


def free_blocks(engine) -> int:
    return engine.core.scheduler.kv_cache_manager.block_pool.get_num_free_blocks()


def ahead(engine, request_id: str, tokens: int, by: int = 2):
    """A condition: the engine has made `by` tokens of the request past `tokens` (or ended
    it). A consumer that waits for it before reading on is behind the engine."""

    def check() -> bool:
        request = engine.core.scheduler.requests.get(request_id)
        return request is None or request.num_output_tokens >= tokens + by

    return check


def test_streams_token_by_token_and_matches_hf(engine, hf_refs):
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    outs = asyncio.run(collect(engine, prompt))
    assert [len(o.outputs[0].new_token_ids) for o in outs] == [1] * 12
    assert [o.finished for o in outs] == [False] * 11 + [True]
    assert outs[-1].outputs[0].token_ids == hf_refs["llama_gqa"].greedy(prompt, 12)
    assert outs[-1].outputs[0].finish_reason == "length"


def test_each_streamed_output_is_a_snapshot_even_for_a_slow_consumer(engine, hf_refs):
    """The loop thread runs ahead of a slow consumer: what a consumer reads must be what the
    step produced (outputs are handed across threads), not the request's later state."""
    prompt = [2, 7, 1, 8, 2, 8]

    async def slow():
        seen = []
        async for out in engine.generate(prompt, GREEDY, request_id="slow-snapshots"):
            # The engine makes more tokens before this consumer reads on.
            assert await wait_until_async(ahead(engine, "slow-snapshots", len(seen) + 1), 10)
            completion = out.outputs[0]
            seen.append((list(completion.new_token_ids), list(completion.token_ids)))
        return seen

    seen = asyncio.run(slow())
    expected = hf_refs["llama_gqa"].greedy(prompt, 12)
    assert [t for new, _ in seen for t in new] == expected
    assert [len(so_far) for _, so_far in seen] == list(range(1, 13))


def test_coalesce_batches_the_steps_a_slow_consumer_missed(engine, hf_refs):
    prompt = [2, 7, 1, 8, 2, 8]

    async def slow():
        seen = []
        async for out in engine.generate(prompt, GREEDY, coalesce=True, request_id="coalesced"):
            seen.append((list(out.outputs[0].new_token_ids), out.finished))
            # The engine makes several tokens before this consumer reads on.
            made = sum(len(new) for new, _ in seen)
            assert await wait_until_async(ahead(engine, "coalesced", made, by=3), 10)
        return seen

    seen = asyncio.run(slow())
    assert [t for new, _ in seen for t in new] == hf_refs["llama_gqa"].greedy(prompt, 12)
    assert len(seen) < 12  # batched, not one output per token
    assert [finished for _, finished in seen] == [False] * (len(seen) - 1) + [True]


def test_concurrent_requests_each_get_their_own_stream(engine, hf_refs):
    prompts = [[i, i + 1, i + 2, i + 3] for i in range(10, 16)]

    async def run_all():
        return await asyncio.gather(*(collect(engine, p) for p in prompts))

    results = asyncio.run(run_all())
    for prompt, outs in zip(prompts, results, strict=True):
        assert outs[-1].outputs[0].token_ids == hf_refs["llama_gqa"].greedy(prompt, 12)


def test_consumer_that_stops_early_aborts_and_frees_blocks(engine):
    before = free_blocks(engine)
    long = SamplingParams(temperature=0.0, max_tokens=80, ignore_eos=True)

    async def take_three():
        seen = 0
        async for _ in engine.generate([7, 7, 7, 7, 7], long, request_id="quitter"):
            seen += 1
            if seen == 3:
                break
        return seen

    assert asyncio.run(take_three()) == 3
    # The engine thread applies the abort.
    wait_until(
        lambda: (
            engine.core.scheduler.get_num_unfinished_requests() == 0
            and free_blocks(engine) == before
        ),
        10,
    )
    assert engine.core.scheduler.get_num_unfinished_requests() == 0
    assert free_blocks(engine) == before


def test_bad_input_is_a_value_error_not_a_dead_engine(engine, hf_refs):
    async def bad():
        with pytest.raises(ValueError, match="max_model_len=96"):
            await collect(engine, list(range(1, 100)))
        with pytest.raises(ValueError, match="outside the vocabulary"):
            await collect(engine, [1, 2, 99999])
        # The engine keeps serving.
        return await collect(engine, [5, 6, 7])

    outs = asyncio.run(bad())
    assert outs[-1].outputs[0].token_ids == hf_refs["llama_gqa"].greedy([5, 6, 7], 12)


def test_duplicate_live_request_id_is_refused(engine):
    long = SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)

    async def dup():
        first = engine.generate([1, 2, 3], long, request_id="same")
        await first.__anext__()
        with pytest.raises(ValueError, match="duplicate request id 'same'"):
            await collect(engine, [4, 5, 6], request_id="same")
        # The refused caller's exit does not end the request it collided with.
        return [out async for out in first]

    rest = asyncio.run(dup())
    assert rest[-1].outputs[0].finish_reason == "length"
    assert len(rest[-1].outputs[0].token_ids) == 60


def test_stop_string_ends_the_request_with_the_default_model():
    llm = LLM("tiny", max_model_len=128, num_gpu_blocks_override=64)
    free = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    text = llm.generate(["Once upon"], free)[0].outputs[0].text
    stop = text[3:6]
    assert stop and stop in text
    out = llm.generate(
        ["Once upon"], SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, stop=[stop])
    )[0].outputs[0]
    assert out.finish_reason == "stop"
    assert out.stop_reason == stop
    assert out.text == text[: text.index(stop)]
    pool = llm.engine.scheduler.kv_cache_manager.block_pool
    assert pool.get_num_free_blocks() == 63


def test_a_caller_whose_event_loop_closed_does_not_kill_the_engine(engine, hf_refs):
    long = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)

    async def start_and_leave():
        stream = engine.generate([8, 8, 8], long, request_id="orphan")
        await stream.__anext__()
        # Leave without closing the stream: asyncio.run closes this loop under it.

    asyncio.run(start_and_leave())
    outs = asyncio.run(collect(engine, [5, 6, 7]))
    assert outs[-1].outputs[0].token_ids == hf_refs["llama_gqa"].greedy([5, 6, 7], 12)
    assert "orphan" not in engine.core.scheduler.requests


def test_shutdown_ends_every_waiting_caller_with_an_error(hf_refs):
    """Streams in flight and requests still queued all hear that the engine is gone."""
    from engine.async_engine import EngineDeadError

    engine = AsyncEngine(
        hf_refs["llama_gqa"].path, max_model_len=96, block_size=4, num_gpu_blocks_override=200
    )
    long = SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)

    async def stream_then_shutdown():
        streaming = engine.generate([1, 2, 3], long)
        await streaming.__anext__()
        engine.shutdown()
        with pytest.raises(EngineDeadError, match="shut down"):
            async for _ in streaming:
                pass
        with pytest.raises(EngineDeadError):
            await collect(engine, [4, 5, 6])

    asyncio.run(asyncio.wait_for(stream_then_shutdown(), 30))


def test_generate_tokens_streams_token_ids_only(engine, hf_refs):
    """What an engine replica sends its router: EngineCoreOutputs, no text anywhere."""
    from engine.outputs import EngineCoreOutput

    prompt = [3, 1, 4, 1, 5, 9, 2, 6]

    async def go():
        return [out async for out in engine.generate_tokens(prompt, GREEDY)]

    outs = asyncio.run(go())
    assert all(isinstance(o, EngineCoreOutput) for o in outs)
    assert not any(hasattr(o, "text") for o in outs)
    assert [t for o in outs for t in o.new_token_ids] == hf_refs["llama_gqa"].greedy(prompt, 12)
    assert [o.finished for o in outs] == [False] * (len(outs) - 1) + [True]
    assert outs[-1].timing is not None and outs[-1].finish_reason == "length"


def test_generate_tokens_refuses_stop_strings(engine):
    async def go():
        async for _ in engine.generate_tokens([1, 2, 3], SamplingParams(stop=["x"])):
            pass

    with pytest.raises(ValueError, match="stop strings need text"):
        asyncio.run(go())


def test_stop_string_is_matched_by_the_caller_and_ends_the_engine_request():
    """AsyncEngine.generate detokenizes in the caller's thread (the engine thread sees token
    ids only); a stop string ends the stream where offline generation ends it, and the engine
    request is ended too: its blocks come back."""
    llm = LLM("tiny", max_model_len=128, num_gpu_blocks_override=64)
    free = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    text = llm.generate(["Once upon"], free)[0].outputs[0].text
    stop = text[5:8]
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, stop=[stop])
    expected = llm.generate(["Once upon"], params)[0].outputs[0]
    llm.close()
    engine = AsyncEngine("tiny", max_model_len=128, num_gpu_blocks_override=64)
    try:
        outs = asyncio.run(collect(engine, "Once upon", params, coalesce=True))
        last = outs[-1].outputs[0]
        assert last.finish_reason == "stop" and last.stop_reason == stop
        assert last.text == expected.text and last.token_ids == expected.token_ids
        assert len(last.token_ids) < 40
        wait_until(lambda: engine.stats.num_free_blocks == 63, 10)
        stats = engine.stats
        assert stats.num_free_blocks == 63 and stats.num_running == stats.num_waiting == 0
    finally:
        engine.shutdown()


def test_calls_on_the_loop_run_between_steps_and_fail_once_the_loop_is_gone(hf_refs):
    """run_on_loop: a call runs on the engine thread and returns its value (or raises its
    error); one a caller cancelled before it ran never runs; after shutdown nothing waits."""
    from concurrent.futures import CancelledError

    from engine.async_engine import EngineDeadError

    engine = AsyncEngine(hf_refs["llama_gqa"].path, max_model_len=64, block_size=4)
    loop_thread = engine.run_on_loop(threading.current_thread).result(timeout=10)
    assert loop_thread.name == "engine-loop"
    with pytest.raises(ZeroDivisionError):
        engine.run_on_loop(lambda: 1 / 0).result(timeout=10)
    ran = []
    gate = threading.Event()
    engine.run_on_loop(gate.wait)  # holds the loop until the gate opens
    late = engine.run_on_loop(lambda: ran.append(1))
    assert late.cancel()
    gate.set()
    with pytest.raises(CancelledError):
        late.result(timeout=10)
    assert engine.run_on_loop(lambda: 2).result(timeout=10) == 2 and ran == []
    engine.shutdown()
    with pytest.raises(EngineDeadError):
        engine.run_on_loop(lambda: 3).result(timeout=1)


def bounded_engine(hf_refs, **kwargs):
    """An engine bounded at 80 queued prompt tokens whose steps cover 8 tokens: a 40-token
    prompt takes five steps (held by the test's StepGate, the others queue behind it)."""
    return AsyncEngine(
        hf_refs["llama_gqa"].path,
        max_model_len=96,
        block_size=4,
        num_gpu_blocks_override=200,
        max_num_batched_tokens=8,
        max_queued_prompt_tokens=80,
        **kwargs,
    )


def test_a_full_engine_refuses_new_prompts_at_once_and_serves_the_rest(hf_refs, monkeypatch):
    """Over max_queued_prompt_tokens a new prompt is refused (QueueFull) before it is queued;
    what was admitted completes, and once the queue drains prompts are admitted again."""
    from engine.core.admission import QueueFull

    eng = bounded_engine(hf_refs)
    gate = StepGate(eng.core, monkeypatch)
    prompts = [[7 + i] * 40 for i in range(3)]

    async def go():
        first = asyncio.create_task(collect(eng, prompts[0]))
        assert await asyncio.to_thread(gate.held.wait, 10)  # its first step, held
        second = asyncio.create_task(collect(eng, prompts[1]))
        third = asyncio.create_task(collect(eng, prompts[2]))
        # The tasks queue their requests when they first run, in order; then the held step
        # ends and the engine takes both: 32 + 40 tokens waiting, and 40 more is too many.
        asyncio.get_running_loop().call_soon(gate.open)
        with pytest.raises(QueueFull, match="retry later"):
            await third
        done = await asyncio.gather(first, second)
        return done, await collect(eng, prompts[2])

    try:
        done, later = asyncio.run(go())
        assert [len(outs[-1].outputs[0].token_ids) for outs in done] == [12, 12]
        assert len(later[-1].outputs[0].token_ids) == 12
        assert not eng.core.scheduler.requests
    finally:
        gate.open()
        eng.shutdown()


def test_a_higher_priority_prompt_displaces_a_waiting_lower_one(hf_refs, monkeypatch):
    """At the bound, a prompt of higher priority takes the place of the lowest-priority one
    still waiting: that caller hears QueueFull (as if refused at admission); the rest run."""
    from engine.core.admission import QueueFull

    eng = bounded_engine(hf_refs, scheduling_policy="priority")
    gate = StepGate(eng.core, monkeypatch)

    async def go():
        first = asyncio.create_task(collect(eng, [7] * 40, priority=5))
        assert await asyncio.to_thread(gate.held.wait, 10)  # running: never displaced
        low = asyncio.create_task(collect(eng, [8] * 40, priority=5))
        urgent = asyncio.create_task(collect(eng, [9] * 40, priority=0))
        # Both queue, low first, before the held step ends and the engine takes them.
        asyncio.get_running_loop().call_soon(gate.open)
        urgent_outs = await urgent
        with pytest.raises(QueueFull, match="higher priority"):
            await low
        return await first, urgent_outs

    try:
        first, urgent = asyncio.run(go())
        assert len(first[-1].outputs[0].token_ids) == len(urgent[-1].outputs[0].token_ids) == 12
        assert not eng.core.scheduler.requests
    finally:
        gate.open()
        eng.shutdown()
