"""One scheduling step: what it decided (Step), and the SchedulerOutput describing it."""

from __future__ import annotations

from engine.core.kv_cache_manager import KVCacheManager
from engine.core.kv_cache_utils import KVCacheBlock
from engine.core.sched_output import CachedRequestData, NewRequestData, SchedulerOutput
from engine.request import Request


class Step:
    """Everything one `schedule()` call decides, before it becomes a SchedulerOutput."""

    __slots__ = (
        "budget",
        "new_blocks",
        "num_scheduled",
        "preempted",
        "scheduled_new",
        "scheduled_resumed",
        "scheduled_running",
        "skipped",
        "spec_tokens",
        "started_loading",
    )

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self.num_scheduled: dict[str, int] = {}
        self.new_blocks: dict[str, list[KVCacheBlock]] = {}  # only requests that got some
        self.scheduled_running: list[Request] = []
        self.scheduled_new: list[Request] = []
        self.scheduled_resumed: list[Request] = []
        self.preempted: list[Request] = []
        self.skipped: list[Request] = []  # back to skipped_waiting once the step is decided
        self.spec_tokens: dict[str, list[int]] = {}  # drafts scheduled for verification
        # Admitted to load their KV from elsewhere while others compute (also in `skipped`).
        self.started_loading: list[Request] = []

    def unschedule(self, request: Request) -> None:
        """Roll back what this step already granted a request that is now preempted."""
        req_id = request.request_id
        self.scheduled_running.remove(request)
        self.budget += self.num_scheduled.pop(req_id)
        self.new_blocks.pop(req_id, None)
        self.spec_tokens.pop(req_id, None)


def build_scheduler_output(
    step: Step, kv_cache_manager: KVCacheManager, finished_req_ids: set[str]
) -> SchedulerOutput:
    """Describe the step for the worker, then advance every scheduled request's
    `num_computed_tokens`: the worker computes those tokens now, and the next schedule()
    builds on that. (The output keeps the values from before the step.) A request that will
    sample owes a placeholder until the step's output is back."""
    get_block_ids = kv_cache_manager.get_block_ids
    new_reqs = [
        NewRequestData.from_request(r, get_block_ids(r.request_id)) for r in step.scheduled_new
    ]
    cached = _describe_running(step)
    for request in step.scheduled_resumed:
        req_id = request.request_id
        cached.req_ids.append(req_id)
        cached.resumed_req_ids.add(req_id)
        cached.new_block_ids.append(get_block_ids(req_id))
        cached.num_computed_tokens.append(request.num_computed_tokens)
        cached.num_output_tokens.append(len(request.output_token_ids))
        cached.resumed_token_ids[req_id] = list(request.all_token_ids)
    num_scheduled = step.num_scheduled
    for requests in (step.scheduled_new, step.scheduled_running, step.scheduled_resumed):
        _advance(requests, num_scheduled)
    return SchedulerOutput(
        scheduled_new_reqs=new_reqs,
        scheduled_cached_reqs=cached,
        num_scheduled_tokens=num_scheduled,
        total_num_scheduled_tokens=sum(num_scheduled.values()),
        preempted_req_ids={r.request_id for r in step.preempted},
        finished_req_ids=finished_req_ids,
        scheduled_spec_decode_tokens=step.spec_tokens,
        scheduled_requests=[*step.scheduled_new, *step.scheduled_running, *step.scheduled_resumed],
    )


def _describe_running(step: Step) -> CachedRequestData:
    """The running requests' part of CachedRequestData, a list per field (a decode step's
    whole batch is here: comprehensions, not appends)."""
    running = step.scheduled_running
    req_ids = [r.request_id for r in running]
    new_blocks = step.new_blocks
    return CachedRequestData(
        req_ids=req_ids,
        new_block_ids=[
            [b.block_id for b in new_blocks[i]] if i in new_blocks else None for i in req_ids
        ],
        num_computed_tokens=[r.num_computed_tokens for r in running],
        # The worker holds the samples of steps still in flight too.
        num_output_tokens=[len(r.output_token_ids) + r.num_output_placeholders for r in running],
    )


def _advance(requests: list[Request], num_scheduled: dict[str, int]) -> None:
    """The step computes these tokens; one that reaches past the known tokens samples, and
    that sample is owed (a placeholder) until the step's output is back."""
    for request in requests:
        computed = request.num_computed_tokens + num_scheduled[request.request_id]
        request.num_computed_tokens = computed
        if computed >= len(request.all_token_ids) + request.num_output_placeholders:
            request.num_output_placeholders += 1
