"""scheduler_stats against a brute-force recount, at every turn of random workloads: prefix hits,
preemptions, remote KV read asynchronously (WAITING_FOR_REMOTE_KVS: its prompt is not
queued here) or synchronously, loads that fail and rewind, requests held finished for a
remote reader, aborts, speculative decoding, steps scheduled ahead of their outputs.

queued_prompt_tokens is kept incrementally (engine/core/queued_prompts.py): the recount here
walks every queue, the way the scheduler used to on every step."""

from __future__ import annotations

import random

import pytest

from engine.config import SpeculativeConfig
from engine.core.sched_output import KVConnectorOutput, ModelRunnerOutput, SchedulerOutput
from engine.core.scheduler import Scheduler
from engine.request import Request, RequestStatus, SamplingParams
from engine.stats import scheduler_stats
from tests.unit.fake_connector import FakeConnector
from tests.unit.sched_utils import make_scheduler

VOCAB = 12  # few distinct tokens: prompts repeat n-grams (drafts) and share blocks (hits)
MAX_MODEL_LEN = 64


def recount(scheduler: Scheduler, added: list[Request]) -> dict[str, int]:
    """scheduler_stats' fields, counted from scratch (`added`: every request the run added)."""
    unfinished = [*scheduler.running, *scheduler.waiting, *scheduler.skipped_waiting]
    assert len({id(r) for r in unfinished}) == len(unfinished)  # each request in one queue
    assert all(not r.is_finished for r in unfinished)
    return {
        "num_free_blocks": scheduler.kv_cache_manager.block_pool.get_num_free_blocks(),
        "num_running": len(scheduler.running),
        "num_waiting": len(scheduler.waiting) + len(scheduler.skipped_waiting),
        "num_held_requests": sum(r.is_finished for r in scheduler.requests.values()),
        "queued_prompt_tokens": sum(
            max(0, r.num_prompt_tokens - r.num_computed_tokens)
            for r in unfinished
            if r.status != RequestStatus.WAITING_FOR_REMOTE_KVS
        ),
        "num_preemptions": sum(r.num_preemptions for r in added),
    }


class RandomRun:
    """One workload: arrivals, aborts, a runner that samples at random and a connector that
    finishes (and breaks) transfers at random."""

    def __init__(self, seed: int, policy: str, speculate: bool, ahead: bool) -> None:
        self.rng = rng = random.Random(seed)
        self.connector = FakeConnector(rng.choice(["recompute", "recompute", "fail"]))
        block_size = rng.choice([2, 4, 8])
        one_sequence = -(-MAX_MODEL_LEN // block_size) + 1  # blocks for max_model_len, null
        # Under priority a head that cannot fit waits for blocks that requests whose loads
        # have landed hold until they are promoted, behind it: a roomier pool there.
        roomy = 1 if policy == "fcfs" else 2
        self.scheduler = make_scheduler(
            block_size=block_size,
            num_blocks=rng.randint(one_sequence * roomy + 1, one_sequence * (roomy + 1)),
            max_num_batched_tokens=rng.choice([8, 16, 40]),
            max_num_seqs=rng.randint(2, 6),
            max_model_len=MAX_MODEL_LEN,
            long_prefill_token_threshold=rng.choice([0, 0, 6]),
            policy=policy,
            connector=self.connector,
            speculative=SpeculativeConfig(num_speculative_tokens=3) if speculate else None,
        )
        self.ahead = ahead
        self.added: list[Request] = []

    def new_request(self) -> Request:
        rng = self.rng
        prompt = [rng.randrange(VOCAB) for _ in range(rng.randint(1, 40))]
        kind = rng.choice(["plain", "plain", "async", "sync", "held", "retry"])
        params: dict | None = {
            "plain": None,
            "async": {"remote_num_tokens": rng.randint(0, len(prompt)), "async": True},
            "sync": {"remote_num_tokens": rng.randint(0, len(prompt)), "async": False},
            "held": {"do_remote_decode": True},
            "retry": {"retry_steps": rng.randint(1, 3), "async": False},
        }[kind]
        # Now and then the id of a request that is gone (a step in flight may still name it).
        gone = [r.request_id for r in self.added if r.request_id not in self.scheduler.requests]
        reuse = gone and rng.random() < 0.1
        request = Request(
            rng.choice(gone) if reuse else f"r{len(self.added)}",
            prompt,
            SamplingParams(max_tokens=rng.randint(1, 12), temperature=0.0),
            eos_token_id=rng.choice([None, 3]),
            arrival_time=float(len(self.added)),
            priority=rng.randint(0, 2),
            kv_transfer_params=params,
        )
        self.added.append(request)
        return request

    def check_stats(self) -> None:
        expected = recount(self.scheduler, self.added)
        stats = scheduler_stats(self.scheduler)
        assert {name: getattr(stats, name) for name in expected} == expected

    def arrivals_and_aborts(self) -> None:
        scheduler, rng = self.scheduler, self.rng
        for _ in range(rng.choice([0, 0, 1, 2])):
            scheduler.add_request(self.new_request())
            self.check_stats()
        if scheduler.requests and rng.random() < 0.08:
            victim = rng.choice(sorted(scheduler.requests))
            scheduler.finish_requests(victim, RequestStatus.FINISHED_ABORTED)
            self.check_stats()

    def schedule(self) -> tuple[SchedulerOutput, ModelRunnerOutput]:
        """A step, and what its runner samples: a token for each request the step takes to
        the end of its tokens, after the drafts it accepts (decided when scheduled)."""
        scheduler = self.scheduler
        owed = {r.request_id: r.num_tokens + r.num_output_placeholders for r in scheduler.running}
        owed.update(
            {r.request_id: r.num_tokens for r in [*scheduler.waiting, *scheduler.skipped_waiting]}
        )
        so = scheduler.schedule()
        self.check_stats()
        req_ids, sampled = list(so.num_scheduled_tokens), []
        for req_id in req_ids:
            request = scheduler.requests[req_id]
            if request.num_computed_tokens < owed[req_id]:
                sampled.append([])
                continue
            drafts = so.scheduled_spec_decode_tokens.get(req_id, [])
            accepted = drafts[: self.rng.randint(0, len(drafts))]
            sampled.append([*accepted, self.rng.randrange(VOCAB)])
        return so, ModelRunnerOutput(req_ids, sampled)

    def transfers(self, so: SchedulerOutput, draining: bool) -> KVConnectorOutput:
        """Loads that end (some with a broken block among those they wrote), reads of held
        blocks that end."""
        scheduler, rng = self.scheduler, self.rng
        report = KVConnectorOutput()
        for req_id in sorted(self.connector.loads_in_flight):
            request = scheduler.requests.get(req_id)
            if request is not None and (draining or rng.random() < 0.4):
                self.connector.loads_in_flight.discard(req_id)
                report.finished_recving.add(req_id)
                if request.status == RequestStatus.WAITING_FOR_REMOTE_KVS and rng.random() < 0.3:
                    self.break_a_block(request, request.num_computed_tokens, report)
        for new in so.scheduled_new_reqs:  # synchronous loads, read during this step
            request = scheduler.requests.get(new.req_id)
            if request is not None and request.num_external_computed_tokens and rng.random() < 0.2:
                loaded_from = new.num_computed_tokens - request.num_external_computed_tokens
                self.break_a_block(request, loaded_from, report)
        for req_id, request in scheduler.requests.items():
            if request.is_finished and (draining or rng.random() < 0.4):
                report.finished_sending.add(req_id)
        return report

    def break_a_block(self, request: Request, loaded_from: int, report: KVConnectorOutput) -> None:
        """One of the blocks a load wrote (tokens from `loaded_from` on) arrived broken. Not
        a sequence's first block: a request rewound to nothing computed while it holds blocks
        looks for prefix hits when admitted again, and refuses them (a separate matter)."""
        block_size = self.scheduler.block_size
        loaded_to = loaded_from + request.num_external_computed_tokens
        block_ids = self.scheduler.kv_cache_manager.get_block_ids(request.request_id)
        written = block_ids[max(1, loaded_from // block_size) : -(-loaded_to // block_size)]
        if written:
            report.invalid_block_ids.add(self.rng.choice(written))

    def update(self, so: SchedulerOutput, out: ModelRunnerOutput, draining: bool) -> None:
        out.kv_connector_output = self.transfers(so, draining)
        self.scheduler.update_from_output(so, out)
        self.check_stats()

    def run(self, num_steps: int = 120) -> None:
        scheduler = self.scheduler
        pending = None
        for index in range(num_steps + 400):
            draining = index >= num_steps
            if not draining:
                self.arrivals_and_aborts()
            elif not scheduler.has_requests() and pending is None and not scheduler.requests:
                break
            so, out = pending or self.schedule()
            pending = None
            if self.ahead and so.total_num_scheduled_tokens and scheduler.may_schedule_ahead():
                pending = self.schedule()
            self.update(so, out, draining)
        else:
            raise AssertionError("the run did not drain")
        assert scheduler_stats(scheduler).queued_prompt_tokens == 0
        assert scheduler.kv_cache_manager.block_pool.get_num_free_blocks() == (
            scheduler.kv_cache_manager.block_pool.num_blocks - 1
        )


@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize(
    ("policy", "speculate", "ahead"),
    [("fcfs", False, False), ("priority", False, False), ("fcfs", True, False),
     ("fcfs", False, True), ("priority", False, True)],
)  # fmt: skip
def test_scheduler_stats_equal_a_recount(seed, policy, speculate, ahead):
    RandomRun(seed, policy, speculate, ahead).run()
