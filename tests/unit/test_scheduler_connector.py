"""The scheduler's KV connector hooks, driven by a fake connector (no transport here)."""

from __future__ import annotations

import pytest

from engine.core.sched_output import KVConnectorOutput, ModelRunnerOutput
from engine.request import FinishReason, Request, RequestStatus, SamplingParams
from tests.unit.fake_connector import FakeConnector
from tests.unit.sched_utils import make_request, make_scheduler, runner_for, step

BLOCK = 4
PROMPT = list(range(500, 517))  # 17 tokens: 4 full blocks + 1


def remote_request(req_id: str = "d", *, is_async: bool = True, max_tokens: int = 3, **extra):
    params = {"remote_num_tokens": 16, "async": is_async, **extra}
    return Request(req_id, PROMPT, SamplingParams(max_tokens=max_tokens), kv_transfer_params=params)


def setup(policy="recompute", **kwargs):
    connector = FakeConnector(policy)
    scheduler = make_scheduler(block_size=BLOCK, connector=connector, **kwargs)
    return scheduler, connector, runner_for(scheduler)


def report(scheduler, runner, **kv_output):
    """One step whose runner output carries a connector report."""
    so = scheduler.schedule()
    out = runner.execute(so)
    out.kv_connector_output = KVConnectorOutput(**kv_output)
    outputs = scheduler.update_from_output(so, out)
    scheduler.kv_cache_manager.check_integrity()
    return so, outputs


def land_load(scheduler, runner, req_id):
    """The worker finished writing the remote KV into the request's blocks."""
    request = scheduler.requests[req_id]
    block_ids = scheduler.kv_cache_manager.get_block_ids(req_id)
    runner.load_blocks(request.all_token_ids, block_ids, 16)


def test_async_load_waits_then_computes_only_the_rest():
    scheduler, connector, runner = setup()
    scheduler.add_request(remote_request())
    so, _ = step(scheduler, runner)
    request = scheduler.requests["d"]
    assert request.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    assert so.num_scheduled_tokens == {}
    # 16 tokens to load, and the slot of the 17th, computed once they landed (block 5).
    assert connector.allocations["d"] == ([1, 2, 3, 4, 5], 16)
    assert so.kv_connector_metadata == {"loads": ["d"]}
    # Blocks that are still being written are not in the prefix cache.
    assert all(scheduler.kv_cache_manager.block_pool.blocks[i].block_hash is None for i in (1, 4))
    so, _ = step(scheduler, runner)  # still loading: skipped again
    assert so.num_scheduled_tokens == {}
    land_load(scheduler, runner, "d")
    connector.loads_in_flight.discard("d")
    report(scheduler, runner, finished_recving={"d"})
    so, outputs = step(scheduler, runner)
    assert so.num_scheduled_tokens == {"d": 1}  # only the 17th token is computed locally
    assert so.scheduled_new_reqs[0].num_computed_tokens == 16
    assert [o.request_id for o in outputs] == ["d"]
    pool = scheduler.kv_cache_manager.block_pool
    assert [pool.blocks[i].block_hash for i in (1, 2, 3, 4)] == request.block_hashes[:4]


def test_sync_load_is_scheduled_in_the_same_step():
    scheduler, connector, runner = setup()
    scheduler.add_request(remote_request(is_async=False))
    so = scheduler.schedule()
    assert so.num_scheduled_tokens == {"d": 1}
    assert so.scheduled_new_reqs[0].num_computed_tokens == 16
    land_load(scheduler, runner, "d")
    outputs = scheduler.update_from_output(so, runner.execute(so))
    assert len(outputs[0].new_token_ids) == 1


def test_failed_async_load_recomputes_from_the_first_invalid_block():
    scheduler, connector, runner = setup("recompute")
    scheduler.add_request(remote_request())
    step(scheduler, runner)
    land_load(scheduler, runner, "d")
    runner.invalidate_blocks({3})  # block index 2 (tokens 8..11) arrived broken
    connector.loads_in_flight.discard("d")
    problems = {"d": "checksum"}
    report(scheduler, runner, finished_recving={"d"}, invalid_block_ids={3}, load_problems=problems)
    assert scheduler.requests["d"].timing.kv_load_problem == "checksum"  # for its trace
    so, _ = step(scheduler, runner)
    # Tokens 0..7 are kept; 8..16 are computed here, in the blocks it already holds.
    assert so.scheduled_new_reqs[0].num_computed_tokens == 8
    assert so.num_scheduled_tokens == {"d": 9}
    assert so.scheduled_new_reqs[0].block_ids == [1, 2, 3, 4, 5]
    pool = scheduler.kv_cache_manager.block_pool
    request = scheduler.requests["d"]
    # The valid blocks were cached at promotion; the recomputed ones once scheduled.
    assert pool.blocks[1].block_hash == request.block_hashes[0]
    assert pool.blocks[3].block_hash == request.block_hashes[2]


def test_invalid_block_never_enters_the_prefix_cache():
    scheduler, connector, runner = setup("recompute")
    scheduler.add_request(remote_request())
    step(scheduler, runner)
    connector.loads_in_flight.discard("d")
    report(scheduler, runner, finished_recving={"d"}, invalid_block_ids={1})
    request = scheduler.requests["d"]
    assert request.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    assert all(b.block_hash is None for b in scheduler.kv_cache_manager.block_pool.blocks)
    # A second request with the same prompt finds nothing cached yet.
    twin = Request("twin", PROMPT, SamplingParams(max_tokens=1))
    twin.set_block_hasher(scheduler.kv_cache_manager.block_hasher, BLOCK)
    assert scheduler.kv_cache_manager.get_computed_blocks(twin)[1] == 0


def test_failed_load_under_fail_policy_ends_with_an_error():
    scheduler, connector, runner = setup("fail")
    scheduler.add_request(remote_request())
    step(scheduler, runner)
    connector.loads_in_flight.discard("d")
    problems = {"d": "fenced"}
    _, outputs = report(
        scheduler, runner, finished_recving={"d"}, invalid_block_ids={2}, load_problems=problems
    )
    (out,) = outputs
    assert out.finish_reason == FinishReason.ERROR
    assert "invalid blocks [2]" in out.error
    assert out.timing is not None and out.timing.kv_load_problem == "fenced"
    assert scheduler.requests == {}
    assert scheduler.get_num_unfinished_requests() == 0
    assert scheduler.kv_cache_manager.block_pool.get_num_free_blocks() == 63


def test_failed_sync_load_drops_the_step_and_rewinds():
    scheduler, connector, runner = setup("recompute")
    scheduler.add_request(remote_request(is_async=False))
    so = scheduler.schedule()
    land_load(scheduler, runner, "d")
    out = runner.execute(so)
    out.kv_connector_output = KVConnectorOutput(invalid_block_ids={2})
    assert scheduler.update_from_output(so, out) == []  # token sampled over bad KV: dropped
    request = scheduler.requests["d"]
    assert request.num_computed_tokens == 4 and request.num_output_tokens == 0
    runner.invalidate_blocks({2})
    runner.reqs["d"].num_computed_tokens = 4  # the worker rewinds with the scheduler
    so, _ = step(scheduler, runner)
    assert so.num_scheduled_tokens == {"d": 13}


def test_delay_free_keeps_blocks_until_the_remote_side_read_them():
    scheduler, connector, runner = setup()
    prefill = Request(
        "p", PROMPT, SamplingParams(max_tokens=1), kv_transfer_params={"do_remote_decode": True}
    )
    scheduler.add_request(prefill)
    _, outputs = step(scheduler, runner)
    (out,) = outputs
    assert out.finish_reason == FinishReason.LENGTH
    assert out.kv_transfer_params == {
        "remote_block_ids": [1, 2, 3, 4, 5],
        "do_remote_prefill": True,
    }
    pool = scheduler.kv_cache_manager.block_pool
    assert pool.get_num_free_blocks() == 63 - 5  # held under the lease
    assert scheduler.get_num_unfinished_requests() == 0
    report(scheduler, runner, finished_sending={"p"})
    assert pool.get_num_free_blocks() == 63
    assert scheduler.requests == {}


def test_abort_during_a_load_frees_only_after_the_read_stopped():
    scheduler, connector, runner = setup()
    scheduler.add_request(remote_request())
    step(scheduler, runner)
    scheduler.finish_requests("d", RequestStatus.FINISHED_ABORTED)
    pool = scheduler.kv_cache_manager.block_pool
    assert pool.get_num_free_blocks() == 63 - 5  # the read may still be writing into them
    assert scheduler.get_num_unfinished_requests() == 0
    report(scheduler, runner, finished_recving={"d"})
    assert pool.get_num_free_blocks() == 63
    assert scheduler.requests == {}


def test_connector_asking_to_retry_parks_the_request():
    scheduler, connector, runner = setup()
    scheduler.add_request(remote_request(retry_steps=2, is_async=False))
    scheduler.add_request(Request("plain", [1, 2, 3], SamplingParams(max_tokens=1)))
    so, _ = step(scheduler, runner)
    assert list(so.num_scheduled_tokens) == ["plain"]
    so, _ = step(scheduler, runner)
    assert so.num_scheduled_tokens == {}
    so = scheduler.schedule()
    assert so.num_scheduled_tokens == {"d": 1}
    land_load(scheduler, runner, "d")
    assert len(scheduler.update_from_output(so, runner.execute(so))) == 1


def test_connector_output_without_tokens_is_accepted():
    scheduler, connector, runner = setup()
    so = scheduler.schedule()
    out = ModelRunnerOutput([], [], KVConnectorOutput(finished_sending={"gone"}))
    assert scheduler.update_from_output(so, out) == []


def test_the_step_trace_counts_a_loaded_requests_hits_once():
    """An async load: the step that admits it to load records its hits (16 tokens from the
    remote engine); the step that admits it once its KV arrived lists it as loaded and new,
    and does not count those tokens again, as local hits."""
    scheduler, connector, runner = setup(step_trace_size=16)
    scheduler.add_request(remote_request())
    step(scheduler, runner)
    land_load(scheduler, runner, "d")
    connector.loads_in_flight.discard("d")
    report(scheduler, runner, finished_recving={"d"})
    step(scheduler, runner)
    records = scheduler.step_trace.records()
    first, admitted = records[0], records[-1]
    assert first["started_loading"] == ["d"]
    assert first["prefix_hits"]["d"] == {
        "prompt_tokens": 17,
        "local": 0,
        "external": 16,
        "async_load": True,
    }
    assert admitted["new"] == {"d": 1} and admitted["loaded"] == ["d"]
    assert "d" not in admitted["prefix_hits"]
    counted = [r for r in records if "d" in r["prefix_hits"]]
    assert counted == [first]


def adopting_request(req_id: str = "d", first_token: int = 7, **params) -> Request:
    """A decode leg whose remote holds the whole prompt (17 tokens) and whose first token
    came from that engine (forced)."""
    sampling = SamplingParams(max_tokens=3, forced_output_token_ids=[first_token], **params)
    remote = {"remote_num_tokens": len(PROMPT), "async": True}
    return Request(req_id, PROMPT, sampling, kv_transfer_params=remote)


def test_the_whole_prompt_loaded_with_its_first_token_computes_no_prompt_token():
    scheduler, connector, runner = setup()
    scheduler.add_request(adopting_request())
    step(scheduler, runner)
    assert connector.allocations["d"] == ([1, 2, 3, 4, 5], 17)  # every prompt token
    runner.load_blocks(PROMPT, [1, 2, 3, 4, 5], 17)
    connector.loads_in_flight.discard("d")
    report(scheduler, runner, finished_recving={"d"})
    so, outputs = step(scheduler, runner)
    (new,) = so.scheduled_new_reqs
    # The forced token is taken as sampled: the step computes the position after the prompt,
    # as a colocated engine's first decode step does, over KV the runner checks is the prompt's.
    assert (new.num_computed_tokens, new.output_token_ids) == (17, [7])
    assert so.num_scheduled_tokens == {"d": 1} and new.block_ids[:5] == [1, 2, 3, 4, 5]
    assert [o.new_token_ids for o in outputs] == [[7], [runner.reqs["d"].token_ids[18]]]
    request = scheduler.requests["d"]
    assert request.output_token_ids == [7, runner.reqs["d"].token_ids[18]]
    assert request.timing.kv_load_adopted_first_token


@pytest.mark.parametrize(
    "request_kwargs, why",
    [
        ({"logprobs": 2}, "its logprobs come from the last prompt row"),
        ({"first_token": 2}, "a stop token (eos 2) ends the request in a step"),
        ({"max_tokens": 1}, "max_tokens reached: the step ends it"),
    ],
)
def test_a_first_token_the_step_must_compute_keeps_the_last_prompt_token(request_kwargs, why):
    scheduler, connector, runner = setup()
    first_token = request_kwargs.pop("first_token", 7)
    max_tokens = request_kwargs.pop("max_tokens", 3)
    sampling = SamplingParams(
        max_tokens=max_tokens, forced_output_token_ids=[first_token], **request_kwargs
    )
    remote = {"remote_num_tokens": len(PROMPT), "async": True}
    request = Request("d", PROMPT, sampling, kv_transfer_params=remote, eos_token_id=2)
    scheduler.add_request(request)
    step(scheduler, runner)
    assert connector.allocations["d"] == ([1, 2, 3, 4, 5], 16), why
    land_load(scheduler, runner, "d")
    connector.loads_in_flight.discard("d")
    report(scheduler, runner, finished_recving={"d"})
    so, _ = step(scheduler, runner)
    assert so.num_scheduled_tokens == {"d": 1}
    assert so.scheduled_new_reqs[0].num_computed_tokens == 16
    assert not request.timing.kv_load_adopted_first_token


def test_a_broken_block_in_an_adopting_load_recomputes_and_adopts_nothing():
    scheduler, connector, runner = setup("recompute")
    scheduler.add_request(adopting_request())
    step(scheduler, runner)
    runner.load_blocks(PROMPT, [1, 2, 3, 4, 5], 17)
    runner.invalidate_blocks({5})  # the last block, with the last prompt token
    connector.loads_in_flight.discard("d")
    report(scheduler, runner, finished_recving={"d"}, invalid_block_ids={5})
    so, outputs = step(scheduler, runner)
    (new,) = so.scheduled_new_reqs
    assert (new.num_computed_tokens, new.output_token_ids) == (16, [])
    assert so.num_scheduled_tokens == {"d": 1}  # the last prompt token, here
    request = scheduler.requests["d"]
    assert not request.timing.kv_load_adopted_first_token
    assert [len(o.new_token_ids) for o in outputs] == [1]  # sampled by the step (forced)


def test_a_forced_eos_the_request_ignores_is_adopted():
    scheduler, connector, runner = setup()
    sampling = SamplingParams(max_tokens=3, forced_output_token_ids=[2], ignore_eos=True)
    remote = {"remote_num_tokens": len(PROMPT), "async": True}
    request = Request("d", PROMPT, sampling, kv_transfer_params=remote, eos_token_id=2)
    scheduler.add_request(request)
    step(scheduler, runner)
    assert connector.allocations["d"][1] == 17
    runner.load_blocks(PROMPT, scheduler.kv_cache_manager.get_block_ids("d"), 17)
    connector.loads_in_flight.discard("d")
    report(scheduler, runner, finished_recving={"d"})
    _, outputs = step(scheduler, runner)
    assert outputs[0].new_token_ids == [2] and request.timing.kv_load_adopted_first_token


def test_an_adopted_request_preempted_one_step_ahead_resumes_with_its_tokens():
    """Steps scheduled one ahead of their outputs (async scheduling), a pool small enough
    that the adopted request is preempted and resumed: it emits the forced token first, then
    the runner's samples, and every position's KV stays its own (the runner checks)."""
    connector = FakeConnector()
    scheduler = make_scheduler(
        block_size=BLOCK, connector=connector, num_blocks=12, max_model_len=40
    )
    runner = runner_for(scheduler)
    scheduler.add_request(make_request("x", 7, max_tokens=30))
    prompt = PROMPT[:16]
    sampling = SamplingParams(max_tokens=12, forced_output_token_ids=[7])
    request = Request("d", prompt, sampling, kv_transfer_params={"remote_num_tokens": 16})
    scheduler.add_request(request)
    emitted: dict[str, list[int]] = {}

    def settle(so, out, **kv_output):
        if kv_output:
            out.kv_connector_output = KVConnectorOutput(**kv_output)
        for output in scheduler.update_from_output(so, out):
            emitted.setdefault(output.request_id, []).extend(output.new_token_ids)
        scheduler.kv_cache_manager.check_integrity()

    so = scheduler.schedule()
    settle(so, runner.execute(so))
    runner.load_blocks(prompt, scheduler.kv_cache_manager.get_block_ids("d"), 16)
    connector.loads_in_flight.discard("d")
    request.kv_transfer_params = None  # read: resumed, it computes locally (as PDConnector)
    so = scheduler.schedule()
    settle(so, runner.execute(so), finished_recving={"d"})
    pending = None
    for _ in range(200):  # one step always in flight
        so = scheduler.schedule()
        out = runner.execute(so)
        if pending is not None:
            settle(*pending)
        pending = (so, out)
        if not scheduler.has_unfinished_requests():
            break
    settle(*pending)
    assert request.num_preemptions >= 1 and request.timing.kv_load_adopted_first_token
    assert emitted["d"][0] == 7 and emitted["d"] == request.output_token_ids
    assert len(emitted["d"]) == 12 and len(emitted["x"]) == 30


def test_loads_waiting_for_their_kv_never_hold_the_pool_from_every_one_of_them():
    """Each load also takes the slot of the token computed once it lands: a pool of 7 usable
    blocks held by two loading requests still lets them run, one after the other."""
    connector = FakeConnector()
    scheduler = make_scheduler(
        block_size=BLOCK, connector=connector, num_blocks=8, max_model_len=28
    )
    runner = runner_for(scheduler)
    for req_id, n in (("a", 16), ("b", 12)):
        prompt = [1000 * ord(req_id) + i for i in range(n)]
        sampling = SamplingParams(max_tokens=4, forced_output_token_ids=[7])
        remote = {"remote_num_tokens": n}
        scheduler.add_request(Request(req_id, prompt, sampling, kv_transfer_params=remote))
    finished = set()
    for _ in range(40):
        for req_id in list(connector.loads_in_flight):  # each load lands a step after it starts
            req = scheduler.requests[req_id]
            block_ids = scheduler.kv_cache_manager.get_block_ids(req_id)
            runner.load_blocks(req.all_token_ids, block_ids, connector.allocations[req_id][1])
        landed, connector.loads_in_flight = set(connector.loads_in_flight), set()
        _, outputs = report(scheduler, runner, finished_recving=landed)
        finished |= {o.request_id for o in outputs if o.finish_reason is not None}
        if finished == {"a", "b"}:
            break
    assert finished == {"a", "b"}
