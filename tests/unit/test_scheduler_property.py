"""Whole scheduler runs on random workloads, with invariants checked at every step.

The fake runner simulates the paged KV cache (see FakeModelRunner), so a wrong prefix hit,
a block reused while held, or a bad block table fails the run, not just a counter.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.core.kv_cache_utils import cdiv
from engine.core.preemption import Preemption
from engine.core.scheduler import Scheduler
from engine.request import FinishReason, Request, RequestStatus, SamplingParams
from tests.unit.sched_utils import make_scheduler, runner_for

MAX_MODEL_LEN = 48
SHARED = list(range(1000, 1040))  # prompts draw prefixes of this to share blocks


@dataclass
class Arrival:
    step: int
    request: Request


@st.composite
def workloads(draw):
    block_size = draw(st.sampled_from([1, 2, 4, 8]))
    min_blocks = cdiv(MAX_MODEL_LEN, block_size) + 1
    num_blocks = draw(st.integers(min_blocks, min_blocks * 3))
    chunked = draw(st.booleans())
    config = {
        "block_size": block_size,
        "num_blocks": num_blocks,
        "max_num_seqs": draw(st.integers(1, 8)),
        "max_num_batched_tokens": draw(st.integers(MAX_MODEL_LEN if not chunked else 4, 96)),
        "max_model_len": MAX_MODEL_LEN,
        "enable_chunked_prefill": chunked,
        "long_prefill_token_threshold": draw(st.sampled_from([0, 0, 3, 16])) if chunked else 0,
        "policy": draw(st.sampled_from(["fcfs", "priority"])),
        "enable_prefix_caching": draw(st.booleans()),
    }
    arrivals = []
    for i in range(draw(st.integers(1, 14))):
        shared = draw(st.integers(0, len(SHARED)))
        own = draw(st.lists(st.integers(0, 99), max_size=30))
        prompt = (SHARED[:shared] + own)[: MAX_MODEL_LEN + 4] or [7]
        params = SamplingParams(
            max_tokens=draw(st.integers(1, 24)),
            ignore_eos=draw(st.booleans()),
            min_tokens=0,
        )
        request = Request(
            f"r{i}",
            prompt,
            params,
            eos_token_id=draw(st.sampled_from([None, 3, 5])),
            arrival_time=float(i),
            priority=draw(st.integers(0, 3)),
        )
        arrivals.append(Arrival(draw(st.integers(0, 12)), request))
    aborts = draw(st.lists(st.tuples(st.integers(0, 40), st.integers(0, 13)), max_size=4))
    return config, arrivals, aborts


def check_step(scheduler: Scheduler, so, config) -> None:
    assert so.total_num_scheduled_tokens == sum(so.num_scheduled_tokens.values())
    assert so.total_num_scheduled_tokens <= config["max_num_batched_tokens"]
    assert len(so.num_scheduled_tokens) <= config["max_num_seqs"]
    assert len(scheduler.running) <= config["max_num_seqs"]
    assert all(n > 0 for n in so.num_scheduled_tokens.values())
    if so.preempted_req_ids:
        assert not so.scheduled_new_reqs and not so.scheduled_cached_reqs.resumed_req_ids
    assert not so.preempted_req_ids & so.num_scheduled_tokens.keys()
    for request in scheduler.running:
        # Samples still in flight (async scheduling) count as tokens.
        assert request.num_computed_tokens <= request.num_tokens + request.num_output_placeholders
    pool = scheduler.kv_cache_manager.block_pool
    for new in so.scheduled_new_reqs:
        request = scheduler.requests[new.req_id]
        # A prefix hit maps the request's leading blocks to the very blocks that hold the
        # same hashes, i.e. those another request computed.
        for i in range(new.num_computed_tokens // config["block_size"]):
            assert pool.blocks[new.block_ids[i]].block_hash == request.block_hashes[i]
    scheduler.kv_cache_manager.check_integrity()


def fresh(request: Request) -> Request:
    """The same request, never scheduled (each run needs its own objects)."""
    return Request(
        request.request_id,
        request.prompt_token_ids,
        request.sampling_params,
        eos_token_id=request.eos_token_id,
        arrival_time=request.arrival_time,
        priority=request.priority,
    )


class PipelinedSteps:
    """Async scheduling's order of events, made as hostile as the threads allow: step N+1 is
    scheduled before step N has executed, and step N+1 executes only after step N's outputs
    were settled, new requests and aborts taken, and step N+2 scheduled."""

    def __init__(self, scheduler: Scheduler, runner, config) -> None:
        self.scheduler, self.runner, self.config = scheduler, runner, config
        self.pending = None
        self.num_ahead = 0

    def __call__(self):
        scheduler = self.scheduler
        so = self.pending or self._schedule()
        self.pending = None
        if so.total_num_scheduled_tokens and scheduler.may_schedule_ahead():
            self.pending = self._schedule()
            self.num_ahead += 1
        return scheduler.update_from_output(so, self.runner.execute(so))

    def _schedule(self):
        so = self.scheduler.schedule()
        check_step(self.scheduler, so, self.config)
        return so


def run_workload(workload, async_scheduling: bool):
    """Every request's emitted tokens and finish reason, and the ids the run aborted."""
    config, arrivals, aborts = workload
    scheduler = make_scheduler(**config)
    runner = runner_for(scheduler)
    pending = sorted(arrivals, key=lambda a: a.step)
    requests = {a.request.request_id: fresh(a.request) for a in arrivals}
    emitted: dict[str, list[int]] = {r: [] for r in requests}
    finals: dict[str, FinishReason] = {}
    aborted: set[str] = set()
    pipeline = PipelinedSteps(scheduler, runner, config)

    def sync_step():
        so = scheduler.schedule()
        check_step(scheduler, so, config)
        return scheduler.update_from_output(so, runner.execute(so))

    for step_index in range(2000):
        while pending and pending[0].step <= step_index:
            scheduler.add_request(requests[pending.pop(0).request.request_id])
        for at, index in aborts:
            req_id = f"r{index}"
            if at == step_index and req_id in scheduler.requests:
                scheduler.finish_requests(req_id, RequestStatus.FINISHED_ABORTED)
                aborted.add(req_id)
        if not pending and not scheduler.has_requests() and pipeline.pending is None:
            break
        for out in pipeline() if async_scheduling else sync_step():
            emitted[out.request_id] += out.new_token_ids
            if out.finished:
                assert out.request_id not in finals, "finished twice"
                finals[out.request_id] = out.finish_reason
        scheduler.kv_cache_manager.check_integrity()
    else:
        raise AssertionError("the run did not finish")
    return scheduler, requests, emitted, finals, aborted, pipeline.num_ahead


@settings(
    max_examples=200,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(workloads(), st.booleans())
def test_random_runs_keep_every_invariant(workload, async_scheduling):
    config = workload[0]
    scheduler, requests, emitted, finals, aborted, _ = run_workload(workload, async_scheduling)

    # Every request ended: with an output, or by the abort we sent.
    assert set(finals) | aborted == set(requests)
    assert scheduler.requests == {}
    assert scheduler.get_num_unfinished_requests() == 0
    pool = scheduler.kv_cache_manager.block_pool
    assert pool.get_num_free_blocks() == config["num_blocks"] - 1  # no block leaked
    for req_id, reason in finals.items():
        request = requests[req_id]
        assert emitted[req_id] == request.output_token_ids
        assert len(emitted[req_id]) <= request.max_tokens
        if reason == FinishReason.LENGTH and request.num_prompt_tokens <= MAX_MODEL_LEN:
            assert len(emitted[req_id]) == request.max_tokens or request.num_tokens >= MAX_MODEL_LEN
        if reason == FinishReason.STOP:
            assert emitted[req_id][-1] == request.eos_token_id


@settings(
    max_examples=150,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(workloads())
def test_async_scheduling_emits_what_synchronous_scheduling_emits(workload):
    """Same workload, both step orders: every request that was not aborted emits the same
    tokens and ends the same way (the fake runner samples by request and position, as seeded
    sampling does), through preemption, chunking, prefix hits, stops and max_tokens."""
    *_, sync_emitted, sync_finals, sync_aborted, _ = run_workload(workload, False)
    *_, emitted, finals, aborted, num_ahead = run_workload(workload, True)
    for req_id in set(sync_finals) - sync_aborted - aborted:
        assert emitted[req_id] == sync_emitted[req_id], req_id
        assert finals[req_id] == sync_finals[req_id], req_id
    if any(len(out) > 1 for out in sync_emitted.values()):
        assert num_ahead > 0  # decodes followed decodes: some step was scheduled ahead


def _preempted_after_its_grant() -> tuple:
    """The run hypothesis found (shrunk): under priority, r0 (priority 1) is granted its
    step's slots, which fill block 9 of its prompt; a later running request needs blocks, and
    r0, the lowest priority, is preempted in the same step. Its block 9 was indexed in the
    prefix cache for KV that no step then wrote; r0, admitted again, hit it."""
    config = {
        "block_size": 2,
        "num_blocks": 25,
        "max_num_seqs": 7,
        "max_num_batched_tokens": 9,
        "max_model_len": MAX_MODEL_LEN,
        "enable_chunked_prefill": True,
        "long_prefill_token_threshold": 3,
        "policy": "priority",
        "enable_prefix_caching": True,
    }

    def arrival(step: int, i: int, prompt: list[int], max_tokens: int, priority: int) -> Arrival:
        params = SamplingParams(max_tokens=max_tokens, min_tokens=0)
        return Arrival(step, Request(f"r{i}", prompt, params, None, float(i), priority))

    arrivals = [
        arrival(0, 0, [*SHARED[:20], 0], 1, priority=1),
        *(arrival(0, i, [7], 1, priority=0) for i in (1, 4, 5, 6, 7, 8)),
        arrival(2, 2, [7], 3, priority=0),
        arrival(2, 3, [0] * 9, 1, priority=0),
        arrival(1, 9, [*SHARED[:19], 0], 2, priority=0),
    ]
    return config, arrivals, []


def test_a_request_preempted_after_its_grant_leaves_no_unwritten_block_cached() -> None:
    """Under async scheduling (the order in which this workload takes the path): no block
    past a request's computed tokens stays indexed once it is preempted in the step that
    granted it slots; and the fake runner checks that every position's KV is the request's
    own (r0's resumed prompt read block 9 unwritten before the fix)."""
    preempted_in_own_step = []
    original = Preemption.until_fits

    def until_fits(self, running, request, num_new_tokens, index, step):  # type: ignore[no-untyped-def]
        kv = self.kv_cache_manager
        # The step's grants so far: computed tokens before the step, and the blocks held.
        granted = {
            r.request_id: (r.num_computed_tokens, list(kv.get_blocks(r.request_id)))
            for r in step.scheduled_running
        }
        result = original(self, running, request, num_new_tokens, index, step)
        for victim in step.preempted:
            if victim.request_id in granted:
                preempted_in_own_step.append(victim.request_id)
                computed, blocks = granted[victim.request_id]
                unwritten = blocks[computed // kv.block_size :]
                assert all(block.block_hash is None for block in unwritten)
        return result

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(Preemption, "until_fits", until_fits)
        run_workload(_preempted_after_its_grant(), async_scheduling=True)
    assert "r0" in preempted_in_own_step  # the path this test is about was taken
