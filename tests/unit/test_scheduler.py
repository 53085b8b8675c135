"""Scheduler behaviour with a fake model runner: budget, chunking, preemption, stops, aborts."""

from __future__ import annotations

import pytest

from engine.config import SchedulerConfig
from engine.core.sched_output import ModelRunnerOutput
from engine.request import FinishReason, RequestStatus
from engine.stats import scheduler_stats
from tests.unit.sched_utils import (
    make_request,
    make_scheduler,
    run_to_completion,
    runner_for,
    sampled_output,
    step,
)


def test_one_budget_shared_and_last_prompt_chunked():
    scheduler = make_scheduler(max_num_batched_tokens=64)
    for i in range(3):
        scheduler.add_request(make_request(f"r{i}", [i * 100 + t for t in range(30)]))
    so = scheduler.schedule()
    assert so.num_scheduled_tokens == {"r0": 30, "r1": 30, "r2": 4}
    assert so.total_num_scheduled_tokens == 64
    assert [r.req_id for r in so.scheduled_new_reqs] == ["r0", "r1", "r2"]


def test_chunked_prefill_continues_then_decodes_in_one_batch():
    scheduler = make_scheduler(max_num_batched_tokens=64)
    runner = runner_for(scheduler)
    for i in range(3):
        scheduler.add_request(make_request(f"r{i}", [i * 100 + t for t in range(30)]))
    step(scheduler, runner)
    so, outputs = step(scheduler, runner)
    # r0 and r1 decode one token each; r2 finishes its prompt (26 tokens) in the same step.
    assert so.num_scheduled_tokens == {"r0": 1, "r1": 1, "r2": 26}
    assert so.scheduled_cached_reqs.req_ids == ["r0", "r1", "r2"]
    assert sorted(o.request_id for o in outputs) == ["r0", "r1", "r2"]


def test_long_prefill_threshold_caps_each_chunk():
    scheduler = make_scheduler(max_num_batched_tokens=64, long_prefill_token_threshold=8)
    runner = runner_for(scheduler)
    scheduler.add_request(make_request("a", 20))
    scheduler.add_request(make_request("b", 5))
    so, outputs = step(scheduler, runner)
    assert so.num_scheduled_tokens == {"a": 8, "b": 5}
    assert [o.request_id for o in outputs] == ["b"]  # only b reached the end of its prompt
    assert step(scheduler, runner)[0].num_scheduled_tokens == {"a": 8, "b": 1}
    assert step(scheduler, runner)[0].num_scheduled_tokens == {"a": 4, "b": 1}


def test_without_chunking_a_prompt_goes_whole_or_waits():
    scheduler = make_scheduler(
        max_num_batched_tokens=64, max_model_len=64, enable_chunked_prefill=False
    )
    for i in range(3):
        scheduler.add_request(make_request(f"r{i}", [i * 100 + t for t in range(30)]))
    so = scheduler.schedule()
    assert so.num_scheduled_tokens == {"r0": 30, "r1": 30}
    assert scheduler.requests["r2"].status == RequestStatus.WAITING


def test_max_num_seqs_bounds_the_running_set():
    scheduler = make_scheduler(max_num_seqs=2)
    for i in range(4):
        scheduler.add_request(make_request(f"r{i}", [i, i + 1, i + 2]))
    so = scheduler.schedule()
    assert list(so.num_scheduled_tokens) == ["r0", "r1"]
    assert len(scheduler.running) == 2


def test_prompt_longer_than_max_model_len_is_ignored_with_an_error():
    scheduler = make_scheduler(max_model_len=16)
    runner = runner_for(scheduler)
    scheduler.add_request(make_request("long", 17))
    scheduler.add_request(make_request("ok", 16, max_tokens=5))
    finals = run_to_completion(scheduler, runner)
    assert finals["long"].finish_reason == FinishReason.LENGTH
    assert "max_model_len=16" in finals["long"].error
    assert finals["long"].new_token_ids == []
    # a prompt of exactly max_model_len gets one token, then hits the length limit
    assert len(finals["ok"].new_token_ids) == 1
    assert finals["ok"].finish_reason == FinishReason.LENGTH


def test_duplicate_request_id_is_refused():
    scheduler = make_scheduler()
    scheduler.add_request(make_request("x", 3))
    with pytest.raises(ValueError, match="duplicate request id 'x'"):
        scheduler.add_request(make_request("x", 3))


def test_prefix_hit_across_requests_in_the_scheduler():
    scheduler = make_scheduler()
    runner = runner_for(scheduler)
    shared = list(range(12))
    scheduler.add_request(make_request("a", [*shared, 50, 51], max_tokens=1))
    run_to_completion(scheduler, runner)
    scheduler.add_request(make_request("b", [*shared, 60], max_tokens=1))
    so = scheduler.schedule()
    (new,) = so.scheduled_new_reqs
    assert new.num_computed_tokens == 12
    assert new.block_ids[:3] == [1, 2, 3]  # a's cached blocks, reused in place
    assert so.num_scheduled_tokens == {"b": 1}
    assert scheduler.requests["b"].num_cached_tokens == 12


def test_new_block_ids_only_when_a_block_is_added():
    scheduler = make_scheduler(block_size=4)
    runner = runner_for(scheduler)
    scheduler.add_request(make_request("a", 6, max_tokens=8))
    step(scheduler, runner)  # prompt: 6 tokens in blocks [1, 2]; output token 7 sampled
    seen = []
    for _ in range(3):
        so, _ = step(scheduler, runner)
        seen.append(so.scheduled_cached_reqs.new_block_ids[0])
    # computing positions 6, 7 fits block 2; position 8 needs block 3
    assert seen == [None, None, [3]]


def fill_and_decode(scheduler, runner, n_steps):
    for _ in range(n_steps):
        step(scheduler, runner)


def test_fcfs_preempts_the_most_recently_admitted():
    # 8 usable blocks of 4 tokens. Three requests of 8-token prompts take 2 blocks each.
    scheduler = make_scheduler(
        num_blocks=9, block_size=4, max_model_len=32, max_num_batched_tokens=64
    )
    runner = runner_for(scheduler)
    for i in range(3):
        scheduler.add_request(make_request(f"r{i}", [i * 100 + t for t in range(8)], 20))
    step(scheduler, runner)  # 6 blocks used, 2 free
    step(scheduler, runner)  # each needs a 3rd block at position 8: 3 more needed, 2 free
    # Step 2 gave r0 and r1 their 3rd block; r2 could not grow and preempted itself.
    assert scheduler.requests["r2"].status == RequestStatus.PREEMPTED
    assert scheduler_stats(scheduler).num_preemptions == 1
    assert [r.request_id for r in scheduler.running] == ["r0", "r1"]


def two_twelve_token_requests(max_tokens: int = 9):
    # 7 usable blocks of 4 tokens; each 12-token prompt takes 3, leaving 1 free.
    scheduler = make_scheduler(
        num_blocks=8, block_size=4, max_model_len=28, max_num_batched_tokens=64
    )
    runner = runner_for(scheduler)
    for i in range(2):
        prompt = [i * 100 + t for t in range(12)]
        scheduler.add_request(make_request(f"r{i}", prompt, max_tokens))
    step(scheduler, runner)
    return scheduler, runner


def test_no_admission_in_a_step_that_preempted():
    scheduler, runner = two_twelve_token_requests()
    scheduler.add_request(make_request("late", [7, 8, 9], 1))
    so, _ = step(scheduler, runner)  # both need a 4th block: r0 gets it, r1 is preempted
    assert so.preempted_req_ids == {"r1"}
    assert so.num_scheduled_tokens == {"r0": 1}
    # r1's 3 blocks came back, so "late" would fit, but nothing is admitted this step.
    assert so.scheduled_new_reqs == []
    assert scheduler.requests["late"].status == RequestStatus.WAITING
    finals = run_to_completion(scheduler, runner)
    assert {r: f.finish_reason for r, f in finals.items()} == {
        "r0": FinishReason.LENGTH,
        "r1": FinishReason.LENGTH,
        "late": FinishReason.LENGTH,
    }


def test_resumed_request_carries_all_its_tokens_and_blocks():
    scheduler, runner = two_twelve_token_requests()
    step(scheduler, runner)  # r1 preempted with 1 output token
    resumed_so = None
    while resumed_so is None:
        so, _ = step(scheduler, runner)
        if so.scheduled_cached_reqs.resumed_req_ids:
            resumed_so = so
    cached = resumed_so.scheduled_cached_reqs
    assert cached.resumed_req_ids == {"r1"}
    assert resumed_so.scheduled_new_reqs == []
    i = cached.req_ids.index("r1")
    assert len(cached.resumed_token_ids["r1"]) == 13  # 12 prompt + 1 output
    assert cached.resumed_token_ids["r1"][:12] == [100 + t for t in range(12)]
    assert cached.new_block_ids[i] == scheduler.kv_cache_manager.get_block_ids("r1")
    assert scheduler.requests["r1"].num_preemptions == 1


def test_priority_preempts_the_lowest_priority_and_admits_by_priority():
    scheduler = make_scheduler(
        num_blocks=7, block_size=4, max_model_len=24, max_num_batched_tokens=64, policy="priority"
    )
    runner = runner_for(scheduler)
    scheduler.add_request(make_request("low", [1] * 8, 20, priority=5, arrival_time=1.0))
    scheduler.add_request(make_request("mid", [2] * 8, 20, priority=1, arrival_time=2.0))
    step(scheduler, runner)
    assert [r.request_id for r in scheduler.running] == ["mid", "low"]
    scheduler.add_request(make_request("high", [3] * 4, 20, priority=0, arrival_time=3.0))
    so, _ = step(scheduler, runner)  # 6 blocks held now; high does not fit and waits
    assert "high" not in so.num_scheduled_tokens
    preempting = None
    for _ in range(10):
        so, _ = step(scheduler, runner)
        if so.preempted_req_ids:
            preempting = so
            break
    assert preempting is not None
    # At position 12 both need a 4th block; the lowest priority is the victim.
    assert preempting.preempted_req_ids == {"low"}
    assert preempting.num_scheduled_tokens == {"mid": 1}
    # The next admission picks high (priority 0) before low (priority 5), though low
    # arrived first and was running before.
    so, _ = step(scheduler, runner)
    assert [r.req_id for r in so.scheduled_new_reqs] == ["high"]
    assert scheduler.requests["low"].status == RequestStatus.PREEMPTED


def test_priority_victim_scheduled_earlier_in_the_step_gives_back_its_budget():
    scheduler = make_scheduler(
        num_blocks=5, block_size=4, max_model_len=16, max_num_batched_tokens=64, policy="priority"
    )
    runner = runner_for(scheduler)
    # "low" is admitted first (alone), so it sits before "high" in the running list.
    scheduler.add_request(make_request("low", [1] * 5, 20, priority=9, arrival_time=1.0))
    step(scheduler, runner)
    scheduler.add_request(make_request("high", [2] * 8, 20, priority=0, arrival_time=2.0))
    step(scheduler, runner)
    assert [r.request_id for r in scheduler.running] == ["low", "high"]
    # All 4 usable blocks are held. low computes position 6 (fits its 2nd block); high
    # computes position 8 and needs a 3rd block. The victim is low, already scheduled in
    # this step: its token goes back into the budget and it leaves the output.
    so, _ = step(scheduler, runner)
    assert so.preempted_req_ids == {"low"}
    assert so.num_scheduled_tokens == {"high": 1}
    assert so.total_num_scheduled_tokens == 1
    assert so.scheduled_cached_reqs.req_ids == ["high"]


def test_priority_self_preemption_lets_later_requests_run():
    scheduler = make_scheduler(
        num_blocks=5, block_size=4, max_model_len=16, max_num_batched_tokens=64, policy="priority"
    )
    runner = runner_for(scheduler)
    scheduler.add_request(make_request("low", [1] * 7, 20, priority=9, arrival_time=1.0))
    step(scheduler, runner)
    scheduler.add_request(make_request("high", [2] * 7, 20, priority=0, arrival_time=2.0))
    step(scheduler, runner)
    # low needs a 3rd block and is itself the lowest priority: it steps aside, and high,
    # after it in the running list, is still scheduled in the same step.
    so, _ = step(scheduler, runner)
    assert so.preempted_req_ids == {"low"}
    assert so.num_scheduled_tokens == {"high": 1}


def test_priority_queue_admits_by_priority_then_arrival():
    scheduler = make_scheduler(max_num_seqs=2, policy="priority")
    scheduler.add_request(make_request("c", 3, priority=2, arrival_time=1.0))
    scheduler.add_request(make_request("b", 3, priority=1, arrival_time=3.0))
    scheduler.add_request(make_request("a", 3, priority=1, arrival_time=2.0))
    so = scheduler.schedule()
    assert list(so.num_scheduled_tokens) == ["a", "b"]


@pytest.mark.parametrize(
    ("params", "tokens", "expected_len", "reason", "stop_reason"),
    [
        ({}, [5, 7, 9, 2, 3], 4, FinishReason.STOP, None),  # eos=2 stops, included
        ({"ignore_eos": True}, [5, 2, 9, 2, 3, 4], 6, FinishReason.LENGTH, None),
        ({"stop_token_ids": [9]}, [5, 9, 1], 2, FinishReason.STOP, 9),
        ({"min_tokens": 3}, [2, 2, 2, 7], 3, FinishReason.STOP, None),
        ({"min_tokens": 2, "stop_token_ids": [9]}, [9, 9], 2, FinishReason.STOP, 9),
    ],
)
def test_stop_conditions(params, tokens, expected_len, reason, stop_reason):
    scheduler = make_scheduler()
    scheduler.add_request(make_request("a", 3, max_tokens=6, eos_token_id=2, **params))
    outputs = []
    for token in tokens:
        so = scheduler.schedule()
        if not so.num_scheduled_tokens:
            break
        outputs += scheduler.update_from_output(so, sampled_output(so, {"a": [token]}))
    emitted = [t for o in outputs for t in o.new_token_ids]
    assert emitted == tokens[:expected_len]
    assert outputs[-1].finish_reason == reason
    assert outputs[-1].stop_reason == stop_reason
    assert scheduler.kv_cache_manager.block_pool.get_num_free_blocks() == 63


def test_tokens_after_a_stop_in_one_step_are_dropped():
    scheduler = make_scheduler()
    scheduler.add_request(make_request("a", 3, max_tokens=10, stop_token_ids=[7]))
    so = scheduler.schedule()
    (out,) = scheduler.update_from_output(so, sampled_output(so, {"a": [4, 7, 8, 9]}))
    assert out.new_token_ids == [4, 7]
    assert out.finish_reason == FinishReason.STOP


def test_max_model_len_caps_generation():
    scheduler = make_scheduler(max_model_len=10)
    runner = runner_for(scheduler)
    scheduler.add_request(make_request("a", 7, max_tokens=100))
    finals = run_to_completion(scheduler, runner)
    assert finals["a"].finish_reason == FinishReason.LENGTH
    assert scheduler.kv_cache_manager.block_pool.get_num_free_blocks() == 63


def test_abort_running_and_waiting_frees_everything():
    scheduler = make_scheduler(max_num_seqs=1)
    runner = runner_for(scheduler)
    scheduler.add_request(make_request("run", 6, max_tokens=50))
    scheduler.add_request(make_request("wait", 6, max_tokens=50))
    step(scheduler, runner)
    assert scheduler.requests["run"].status == RequestStatus.RUNNING
    scheduler.finish_requests(["run", "wait", "unknown"], RequestStatus.FINISHED_ABORTED)
    assert scheduler.get_num_unfinished_requests() == 0
    assert scheduler.requests == {}
    so = scheduler.schedule()
    assert so.finished_req_ids == {"run", "wait"}
    assert scheduler.kv_cache_manager.block_pool.get_num_free_blocks() == 63
    scheduler.kv_cache_manager.check_integrity()


def test_abort_between_schedule_and_update_drops_the_sampled_token():
    scheduler = make_scheduler()
    scheduler.add_request(make_request("a", 3, max_tokens=5))
    so = scheduler.schedule()
    scheduler.finish_requests("a", RequestStatus.FINISHED_ABORTED)
    assert scheduler.update_from_output(so, sampled_output(so, {"a": [1]})) == []


def test_finish_requests_needs_a_finished_status():
    scheduler = make_scheduler()
    with pytest.raises(ValueError, match="finished status"):
        scheduler.finish_requests("a", RequestStatus.RUNNING)


def test_runner_output_must_match_its_request_list():
    scheduler = make_scheduler()
    scheduler.add_request(make_request("a", 3))
    so = scheduler.schedule()
    with pytest.raises(ValueError):
        scheduler.update_from_output(so, ModelRunnerOutput(["a"], []))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_num_batched_tokens": 0}, "max_num_batched_tokens"),
        ({"max_num_seqs": -1}, "max_num_seqs"),
        ({"policy": "lifo"}, "policy"),
        ({"enable_chunked_prefill": False, "max_num_batched_tokens": 8}, "max_model_len"),
        ({"long_prefill_token_threshold": -2}, "long_prefill_token_threshold"),
    ],
)
def test_scheduler_config_rejects_bad_values(kwargs, message):
    base = {"max_num_batched_tokens": 64, "max_num_seqs": 4, "max_model_len": 32}
    with pytest.raises(ValueError, match=message):
        SchedulerConfig(**{**base, **kwargs})
