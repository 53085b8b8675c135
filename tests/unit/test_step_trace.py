"""The scheduler's per-step trace (engine/core/step_trace.py): on a scripted run — a prefix
hit, chunked prefill beside decodes, a preemption and the resume — its records list exactly
what each step's SchedulerOutput says was decided, with what the scheduler saw before; off, the
scheduler's step is untouched; and the ring keeps the newest steps only."""

from __future__ import annotations

import json

import pytest

from engine.core.sched_output import SchedulerOutput
from pdserve.trace_steps import TraceStepsOptions, chrome_trace, jsonl
from tests.unit.sched_utils import (
    make_request,
    make_scheduler,
    run_to_completion,
    runner_for,
    step,
)


def decided(so: SchedulerOutput) -> dict[str, object]:
    """What a SchedulerOutput says the step decided, in the trace's terms."""
    cached = so.scheduled_cached_reqs
    resumed = set(cached.resumed_req_ids)
    tokens = so.num_scheduled_tokens
    return {
        "new": {r.req_id: tokens[r.req_id] for r in so.scheduled_new_reqs},
        "resumed": {i: tokens[i] for i in cached.req_ids if i in resumed},
        "kept_running": {i: tokens[i] for i in cached.req_ids if i not in resumed},
        "preempted": sorted(so.preempted_req_ids),
        "scheduled_tokens": so.total_num_scheduled_tokens,
    }


def test_a_scripted_run_is_traced_exactly() -> None:
    # 8 usable blocks of 4 tokens, a budget of 12 tokens: prompts are chunked beside decodes,
    # and three requests growing past 8 tokens run out of blocks (one is preempted).
    scheduler = make_scheduler(
        num_blocks=9, block_size=4, max_model_len=32, max_num_batched_tokens=12, step_trace_size=64
    )
    runner = runner_for(scheduler)
    shared = [5, 6, 7, 8, 9, 10, 11, 12]
    scheduler.add_request(make_request("a", [*shared, 1], 6))
    outputs = []
    for _ in range(2):  # "a" computed: its two full blocks are cached
        outputs.append(step(scheduler, runner)[0])
    scheduler.add_request(make_request("b", [*shared, 2], 12))  # hits a's 8 tokens
    scheduler.add_request(make_request("c", list(range(200, 208)), 12))
    while scheduler.has_requests():
        outputs.append(step(scheduler, runner)[0])
    records = scheduler.step_trace.records()
    assert len(records) == len(outputs)
    for number, (record, so) in enumerate(zip(records, outputs, strict=True)):
        assert record["step"] == number
        got = {key: record[key] for key in decided(so)}
        got["preempted"] = sorted(got["preempted"])
        assert got == decided(so), number
    json.dumps(records)  # plain JSON, as `pdserve trace steps` writes it
    # The path the script is for was taken: b's prefix hit, c's preemption and resume.
    (admit_b,) = [r for r in records if "b" in r["new"]]
    assert admit_b["prefix_hits"]["b"] == {
        "prompt_tokens": 9,
        "local": 8,
        "external": 0,
        "async_load": False,
    }
    assert admit_b["tiers"]["primary"]["cached"] >= 2  # a's blocks, cached before b came
    preempting = [r for r in records if r["preempted"]]
    assert preempting and any(r["resumed"] for r in records)
    before = preempting[0]
    assert before["running"] >= 2 and before["tiers"]["primary"]["free"] < 8
    assert records[0]["waiting"] == 1 and records[0]["running"] == 0


def test_off_the_step_is_the_schedulers_own() -> None:
    scheduler = make_scheduler()
    assert scheduler.step_trace is None
    assert scheduler._decide.__func__ is type(scheduler)._decide  # not wrapped


def test_the_ring_keeps_the_newest_steps() -> None:
    scheduler = make_scheduler(step_trace_size=3)
    runner = runner_for(scheduler)
    scheduler.add_request(make_request("r", 8, 10))
    for _ in range(6):
        step(scheduler, runner)
    assert [r["step"] for r in scheduler.step_trace.records()] == [3, 4, 5]


def test_tracing_turns_on_and_off_while_the_scheduler_runs() -> None:
    scheduler = make_scheduler()
    runner = runner_for(scheduler)
    scheduler.add_request(make_request("r", 8, 10))
    step(scheduler, runner)
    scheduler.trace_steps(8)
    step(scheduler, runner)
    assert [r["kept_running"] for r in scheduler.step_trace.records()] == [{"r": 1}]
    scheduler.trace_steps(0)
    assert scheduler.step_trace is None and "_decide" not in vars(scheduler)
    step(scheduler, runner)  # untraced, and the step is the scheduler's own
    with pytest.raises(ValueError, match="at least 1"):
        scheduler.trace_steps(-2)


def test_the_chrome_trace_has_a_process_per_engine_and_events_per_step() -> None:
    scheduler = make_scheduler(step_trace_size=8)
    runner = runner_for(scheduler)
    scheduler.add_request(make_request("r", 8, 2))
    run_to_completion(scheduler, runner)
    records = scheduler.step_trace.records()
    engines = [
        {"role": role, "replica_id": "x", "error": "", "records": records}
        for role in ("prefill", "decode")
    ]
    trace = chrome_trace(engines)
    names = [e["args"]["name"] for e in trace["traceEvents"] if e["ph"] == "M"]
    assert names == ["prefill x", "decode x"]
    steps = [e for e in trace["traceEvents"] if e["ph"] == "i"]
    assert len(steps) == 2 * len(records)
    assert steps[0]["args"]["new"] == {"r": 8} and steps[0]["ts"] == records[0]["time"] * 1e6
    lines = [json.loads(line) for line in jsonl(engines)]
    assert [(line["role"], line["step"]) for line in lines[:2]] == [("prefill", 0), ("prefill", 1)]
    with pytest.raises(ValueError, match="format"):
        TraceStepsOptions(format="perfetto")


def test_an_answer_too_large_for_the_proxy_loses_its_oldest_records_and_says_so() -> None:
    """The Router keeps a StepTrace answer within the gRPC proxies' message bound: the oldest
    records go first, from the engine holding the most, each engine counting its losses."""
    from deployments.router.router import _fit
    from protos.pdserve.v1 import generate_pb2 as pb

    big = pb.EngineStepTrace(role="decode", records=[f"{i:04d}" + "x" * 96 for i in range(10)])
    small = pb.EngineStepTrace(role="prefill", records=["y" * 100] * 2)
    _fit([big, small], 700)
    assert big.left_out == 5 and [r[:4] for r in big.records] == [
        "0005",
        "0006",
        "0007",
        "0008",
        "0009",
    ]
    assert small.left_out == 0 and len(small.records) == 2
    untouched = pb.EngineStepTrace(records=["z"] * 3)
    _fit([untouched], 700)
    assert untouched.left_out == 0 and len(untouched.records) == 3


def test_an_engine_answers_its_newest_records_within_its_share() -> None:
    from deployments.replica.engine_server import _newest_lines

    records = [{"step": i, "pad": "x" * 40} for i in range(10)]
    lines, left_out = _newest_lines(records, 200)
    assert [json.loads(line)["step"] for line in lines] == [7, 8, 9] and left_out == 7
    everything, none_left = _newest_lines(records, 0)
    assert len(everything) == 10 and none_left == 0
