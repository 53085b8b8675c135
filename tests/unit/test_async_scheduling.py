"""Async scheduling's bookkeeping in the scheduler: placeholders for samples in flight, the
skip-ahead at length limits, when a step may not be scheduled ahead, and a request preempted
while its step is in flight."""

from __future__ import annotations

from engine.config import SpeculativeConfig
from engine.request import RequestStatus
from tests.unit.sched_utils import make_request, make_scheduler, sampled_output


def test_a_step_in_flight_is_counted_and_the_next_scheduled_over_its_placeholder():
    scheduler = make_scheduler()
    request = make_request("r", 6, max_tokens=8)
    scheduler.add_request(request)
    first = scheduler.schedule()
    assert first.num_scheduled_tokens == {"r": 6}
    assert request.num_output_placeholders == 1  # the prompt's last token samples
    # Scheduled before the first step's sample is back: the placeholder is its input.
    second = scheduler.schedule()
    assert second.num_scheduled_tokens == {"r": 1}
    assert second.scheduled_cached_reqs.num_computed_tokens == [6]
    # The worker holds the first sample by then: it must not truncate it.
    assert second.scheduled_cached_reqs.num_output_tokens == [1]
    assert request.num_output_placeholders == 2 and request.num_computed_tokens == 7
    outputs = scheduler.update_from_output(first, sampled_output(first, {"r": [42]}))
    assert [o.new_token_ids for o in outputs] == [[42]]
    assert request.num_output_placeholders == 1
    third = scheduler.schedule()  # one step stays in flight at a time: N+1 is back first
    assert third.num_scheduled_tokens == {"r": 1}
    scheduler.update_from_output(second, sampled_output(second, {"r": [43]}))
    scheduler.update_from_output(third, sampled_output(third, {"r": [44]}))
    assert request.output_token_ids == [42, 43, 44]
    assert request.num_output_placeholders == 0
    assert request.num_computed_tokens == request.num_tokens - 1


def test_a_request_whose_samples_in_flight_reach_max_tokens_is_not_scheduled_again():
    scheduler = make_scheduler()
    short = make_request("short", 4, max_tokens=2)
    other = make_request("other", 4, max_tokens=10)
    scheduler.add_request(short)
    scheduler.add_request(other)
    first = scheduler.schedule()
    second = scheduler.schedule()
    assert second.num_scheduled_tokens == {"short": 1, "other": 1}
    # Two samples owed to a request of max_tokens=2: nothing left to compute for it.
    third = scheduler.schedule()
    assert third.num_scheduled_tokens == {"other": 1}
    scheduler.update_from_output(first, sampled_output(first, {"short": [1], "other": [1]}))
    outputs = scheduler.update_from_output(
        second, sampled_output(second, {"short": [2], "other": [2]})
    )
    assert [o.finish_reason for o in outputs if o.request_id == "short"] == ["length"]
    assert short.output_token_ids == [1, 2]


def test_a_request_at_the_context_limit_is_not_scheduled_past_it():
    scheduler = make_scheduler(max_model_len=8)
    request = make_request("r", 6, max_tokens=100)
    scheduler.add_request(request)
    scheduler.schedule()  # samples position 6
    scheduler.schedule()  # samples position 7, the last the context holds
    assert scheduler.schedule().num_scheduled_tokens == {}


def test_no_step_is_scheduled_ahead_for_speculation_sync_loads_or_nothing_to_run():
    assert not make_scheduler().may_schedule_ahead()  # nothing to run
    plain = make_scheduler()
    plain.add_request(make_request("r", 4))
    plain.schedule()
    assert plain.may_schedule_ahead()
    speculating = make_scheduler(speculative=SpeculativeConfig(num_speculative_tokens=2))
    speculating.add_request(make_request("g", 4, temperature=0.0))
    speculating.schedule()
    # Its drafts come from the sample in flight: the next step waits for it.
    assert not speculating.may_schedule_ahead()
    penalized = make_scheduler(speculative=SpeculativeConfig(num_speculative_tokens=2))
    penalized.add_request(make_request("p", 4, temperature=1.0, presence_penalty=0.5))
    penalized.schedule()
    assert penalized.may_schedule_ahead()  # never speculates: nothing to wait for
    loading = make_scheduler()
    loading.add_request(make_request("l", 4))
    loading.kv_transfers.note_sync_load(loading.requests["l"])
    assert not loading.may_schedule_ahead()
    loading.kv_transfers.end_step(["l"])
    assert loading.may_schedule_ahead()


def test_no_step_is_scheduled_ahead_while_a_request_hands_its_kv_on():
    # Its blocks are checksummed when it finishes (on EOS, say): a step ahead of its last
    # sample would write the next token's K/V into a leased block after the checksum.
    scheduler = make_scheduler()
    producer = make_request("p", 4, max_tokens=8)
    producer.kv_transfer_params = {"do_remote_decode": True}
    scheduler.add_request(producer)
    scheduler.add_request(make_request("plain", 4, max_tokens=8))
    first = scheduler.schedule()
    assert not scheduler.may_schedule_ahead()
    scheduler.finish_requests("p", RequestStatus.FINISHED_ABORTED)
    scheduler.update_from_output(first, sampled_output(first, {"plain": [1]}))
    assert scheduler.may_schedule_ahead()  # only the plain request is left
    # A prefill leg (max_tokens 1) is never scheduled after its sample: nothing to hold.
    leg = make_request("leg", 4, max_tokens=1)
    leg.kv_transfer_params = {"do_remote_decode": True}
    scheduler.add_request(leg)
    assert scheduler.may_schedule_ahead()


def outgrowing_pair(second_max_tokens: int, eos_token_id: int | None = None):
    """4 usable blocks of 4 tokens: two prompts of 8 tokens fit, their next tokens do not.
    Both prompts are scheduled, then the step after them ahead of their samples."""
    scheduler = make_scheduler(num_blocks=5, block_size=4, max_model_len=16)
    first = make_request("a", 8, max_tokens=5)
    second = make_request("b", 8, max_tokens=second_max_tokens, eos_token_id=eos_token_id)
    scheduler.add_request(first)
    scheduler.add_request(second)
    return scheduler, first, second, scheduler.schedule(), scheduler.schedule()


def test_a_request_preempted_while_its_step_is_in_flight_keeps_that_sample():
    # Both need a third block for the step ahead: "b" is preempted for "a".
    scheduler, _, second, prefill, ahead = outgrowing_pair(5)
    assert ahead.preempted_req_ids == {"b"} and ahead.num_scheduled_tokens == {"a": 1}
    assert second.status == RequestStatus.PREEMPTED and second.num_computed_tokens == 0
    outputs = scheduler.update_from_output(prefill, sampled_output(prefill, {"a": [1], "b": [2]}))
    # The sample "b" made before it was preempted is its first output: it resumes with it.
    assert {o.request_id: o.new_token_ids for o in outputs} == {"a": [1], "b": [2]}
    assert second.output_token_ids == [2] and second.num_output_placeholders == 0
    assert second in scheduler.waiting
    assert second.timing.first_token is not None


def test_a_request_preempted_in_flight_whose_sample_ends_it_leaves_the_queue():
    scheduler, _, second, prefill, ahead = outgrowing_pair(5, eos_token_id=2)
    assert ahead.preempted_req_ids == {"b"}
    outputs = scheduler.update_from_output(prefill, sampled_output(prefill, {"a": [1], "b": [2]}))
    finished = [o for o in outputs if o.request_id == "b"]
    assert finished[0].finish_reason == "stop" and finished[0].new_token_ids == [2]
    assert second not in scheduler.waiting and "b" not in scheduler.requests
    assert scheduler.get_num_unfinished_requests() == 1
    scheduler.update_from_output(ahead, sampled_output(ahead, {"a": [3]}))
    scheduler.kv_cache_manager.check_integrity()


def test_a_request_whose_samples_in_flight_end_it_is_never_the_victim():
    """ "b" owes its only sample (a P/D prefill's, say: its blocks must go to the reader with
    their KV): "a" gives way instead, and keeps its own sample in flight."""
    scheduler, first, second, prefill, ahead = outgrowing_pair(1)
    assert ahead.preempted_req_ids == {"a"} and ahead.num_scheduled_tokens == {}
    assert second.status == RequestStatus.RUNNING
    outputs = scheduler.update_from_output(prefill, sampled_output(prefill, {"a": [1], "b": [2]}))
    by_id = {o.request_id: o for o in outputs}
    assert by_id["b"].finish_reason == "length" and by_id["b"].new_token_ids == [2]
    assert by_id["a"].new_token_ids == [1] and first in scheduler.waiting
    scheduler.update_from_output(ahead, sampled_output(ahead, {}))
    scheduler.kv_cache_manager.check_integrity()
    resumed = scheduler.schedule()
    assert resumed.scheduled_cached_reqs.resumed_req_ids == {"a"}


def test_an_id_reused_while_a_step_is_in_flight_gets_nothing_of_the_old_request():
    scheduler = make_scheduler()
    scheduler.add_request(make_request("r", 4, max_tokens=8))
    first = scheduler.schedule()
    ahead = scheduler.schedule()
    scheduler.update_from_output(first, sampled_output(first, {"r": [1]}))
    scheduler.finish_requests("r", RequestStatus.FINISHED_ABORTED)
    again = make_request("r", [9, 9, 9], max_tokens=8)
    scheduler.add_request(again)
    new = scheduler.schedule()  # admitted while the old request's step is in flight
    # The old request's sample from the step in flight is not the new one's.
    assert scheduler.update_from_output(ahead, sampled_output(ahead, {"r": [2]})) == []
    assert again.output_token_ids == [] and again.num_output_placeholders == 1
    outputs = scheduler.update_from_output(new, sampled_output(new, {"r": [5]}))
    assert [o.new_token_ids for o in outputs] == [[5]] and again.output_token_ids == [5]
