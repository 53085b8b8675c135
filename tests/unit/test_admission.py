"""Bounded admission (engine/core/admission.py) over a real scheduler's requests."""

from __future__ import annotations

import pytest

from engine.config import SchedulerConfig
from engine.core.admission import QueueFull, check_admission, displaceable
from engine.request import Request, SamplingParams
from tests.unit.sched_utils import make_request, make_scheduler, runner_for, step


def admit(scheduler, request: Request, bound: int) -> None:
    check_admission(request, scheduler.requests.values(), bound)
    scheduler.add_request(request)


def test_prompts_past_the_bound_are_refused_and_admitted_again_once_computed():
    scheduler = make_scheduler(max_num_batched_tokens=32)
    admit(scheduler, make_request("a", 40), bound=64)
    admit(scheduler, make_request("b", 20), bound=64)  # 60 queued
    with pytest.raises(QueueFull, match="64 queued prompt tokens"):
        admit(scheduler, make_request("c", 8), bound=64)
    step(scheduler, runner_for(scheduler))  # 32 of a's tokens computed: 28 queued
    admit(scheduler, make_request("c", 8), bound=64)
    assert "c" in scheduler.requests


def test_no_bound_a_lone_long_prompt_resumed_requests_and_kv_readers_always_get_in():
    scheduler = make_scheduler()
    for i in range(5):
        admit(scheduler, make_request(f"free{i}", 100), bound=0)  # 0: no bound
    scheduler = make_scheduler()
    admit(scheduler, make_request("long", 120), bound=16)  # nothing waits: admitted
    resumed = Request(
        "resumed", list(range(10, 30)), SamplingParams(max_tokens=8), output_token_ids=[5, 6]
    )
    admit(scheduler, resumed, bound=16)
    reader = make_request("reader", 60)
    reader.kv_transfer_params = {"do_remote_prefill": True}
    check_admission(reader, scheduler.requests.values(), 16)  # computes no prompt of its own
    with pytest.raises(QueueFull):
        admit(scheduler, make_request("fresh", 4), bound=16)


def test_the_bound_is_checked_as_an_engine_argument():
    with pytest.raises(ValueError, match="max_queued_prompt_tokens"):
        SchedulerConfig(16, 4, 64, max_queued_prompt_tokens=-1)


def test_a_higher_priority_prompt_displaces_the_lowest_waiting_ones():
    scheduler = make_scheduler(policy="priority")
    admit(scheduler, make_request("low-old", 30, priority=5, arrival_time=1.0), bound=64)
    admit(scheduler, make_request("low-new", 30, priority=5, arrival_time=2.0), bound=64)
    urgent = make_request("urgent", 30, priority=0)
    with pytest.raises(QueueFull):
        check_admission(urgent, scheduler.requests.values(), 64)
    # The lowest priority, the latest first; just enough to make room.
    assert [r.request_id for r in displaceable(urgent, scheduler.requests.values(), 64)] == [
        "low-new"
    ]
    # Equal priority displaces nothing. A prompt longer than the bound gets in once nothing
    # waits (as at admission), so it displaces every lower one.
    same = make_request("same", 30, priority=5)
    assert displaceable(same, scheduler.requests.values(), 64) == []
    huge = make_request("huge", 100, priority=0)
    assert [r.request_id for r in displaceable(huge, scheduler.requests.values(), 64)] == [
        "low-new",
        "low-old",
    ]


def test_started_requests_are_never_displaced():
    scheduler = make_scheduler(policy="priority", max_num_batched_tokens=8)
    admit(scheduler, make_request("started", 30, priority=9), bound=40)
    step(scheduler, runner_for(scheduler))  # 8 of its tokens computed
    urgent = make_request("urgent", 30, priority=0)
    assert displaceable(urgent, scheduler.requests.values(), 40) == []


def test_a_stream_under_way_is_neither_refused_nor_displaced():
    """Its first token already sent by the prefill engine (forced here) or by a failed engine
    (resumed): refusing it would break a stream, not shed a request."""
    scheduler = make_scheduler(policy="priority")
    admit(scheduler, make_request("queued", 60, priority=0), bound=64)
    forced = make_request("forced", 30, priority=9, forced_output_token_ids=[5])
    admit(scheduler, forced, bound=64)  # over the bound, admitted
    urgent = make_request("urgent", 30, priority=0)
    assert displaceable(urgent, scheduler.requests.values(), 64) == []
    loan_prefill = make_request("loan", 30)
    loan_prefill.kv_transfer_params = {"do_remote_prefill": True, "do_remote_decode": True}
    with pytest.raises(QueueFull):  # a prefill leg reading a prefix loan computes the rest
        check_admission(loan_prefill, scheduler.requests.values(), 64)
