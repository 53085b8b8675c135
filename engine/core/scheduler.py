"""The V1 scheduler: one token budget shared by prefills and decodes, running requests first.

There is no prefill phase and no decode phase. A request has `num_computed_tokens` and
`num_tokens`; each step hands out `{request_id: num_new_tokens}` so that the former catches up
with the latter. A decode is a request one token behind; a prefill chunk is one further behind.

Running requests are scheduled here (room made by preemption.Preemption), then waiting ones
admitted (sched_admit.Admitter); sched_step describes the step for the worker. Settling a
step's outputs is here too. A full batch's decode step touches every running request three
times (schedule, describe, settle): those loops keep to plain attributes, rare cases to helpers.
"""

from __future__ import annotations

import time
from collections.abc import Iterable

from engine.config import CacheConfig, SchedulerConfig, SpeculativeConfig
from engine.core.admission import check_new_request
from engine.core.kv_cache_manager import KVCacheManager
from engine.core.kv_cache_utils import KVCacheBlock, check_capacity
from engine.core.kv_transfer_state import KVTransferState
from engine.core.pins import KVPins
from engine.core.preemption import Preemption
from engine.core.queued_prompts import QueuedPromptTokens
from engine.core.recompute import stepwise_tokens
from engine.core.request_queue import RequestQueue, create_request_queue
from engine.core.sched_admit import Admitter
from engine.core.sched_output import KVConnectorOutput, ModelRunnerOutput, SchedulerOutput
from engine.core.sched_step import Step, build_scheduler_output
from engine.core.step_trace import StepTrace
from engine.core.stop import append_sampled, append_until_stop, owes_its_last_token
from engine.kv_connector import KVConnectorBase
from engine.outputs import EngineCoreOutput
from engine.request import FinishReason, Request, RequestStatus, finish_reason_of
from engine.spec_decode.scheduling import Speculator, drafts_that_fit

_RUNNING = RequestStatus.RUNNING
_PREEMPTED = RequestStatus.PREEMPTED


class Scheduler:
    def __init__(
        self,
        scheduler_config: SchedulerConfig,
        cache_config: CacheConfig,
        connector: KVConnectorBase | None = None,
        speculative: SpeculativeConfig | None = None,
    ) -> None:
        self.scheduler_config = scheduler_config
        self.speculator = Speculator.create(speculative, scheduler_config.max_model_len)
        self.cache_config = cache_config
        self.connector = connector
        self.max_model_len = scheduler_config.max_model_len
        self.block_size = cache_config.block_size
        check_capacity(scheduler_config, cache_config)
        self.kv_cache_manager = KVCacheManager(cache_config, scheduler_config.max_model_len)
        self.requests: dict[str, Request] = {}
        self.waiting: RequestQueue = create_request_queue(scheduler_config.policy)
        # Requests that could not be considered (blocked on a remote load, or the connector
        # asked to retry); looked at again each step before `waiting` under FCFS.
        self.skipped_waiting: RequestQueue = create_request_queue(scheduler_config.policy)
        self.running: list[Request] = []
        # Finished since the last schedule(): the worker drops their state.
        self.finished_req_ids: set[str] = set()
        self.kv_transfers = KVTransferState(self.kv_cache_manager, self.requests, connector)
        self.tier = self.kv_cache_manager.tier  # the KV tier below the pool, if any
        self.pins = self.kv_cache_manager.pins = KVPins(
            self.kv_cache_manager.block_pool,
            scheduler_config.kv_pin_budget,
            predict=scheduler_config.policy == "continuum",
        )
        self.queued_prompts = QueuedPromptTokens()
        self.admitter = Admitter(
            scheduler_config,
            (self.waiting, self.skipped_waiting),
            self.kv_cache_manager,
            self.kv_transfers,
            connector,
            self.speculator,
            self.queued_prompts,
            emit=lambda output: self._pending_outputs.append(output),
        )
        self.preemption = Preemption(
            scheduler_config.policy,
            self.max_model_len,
            self.kv_cache_manager,
            self.waiting,
            self.queued_prompts,
            self.speculator,
        )
        # Outputs produced outside a step (e.g. rejected on arrival), sent with the next one.
        self._pending_outputs: list[EngineCoreOutput] = []
        # Requests let go of (their ids free for new ones), counted for update_from_output.
        self._num_released = 0
        self.step_trace: StepTrace | None = None
        self.trace_steps(scheduler_config.step_trace_size)

    # ---------------------------------------------------------------- requests in and out

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"duplicate request id {request.request_id!r}")
        error = check_new_request(request, self.max_model_len)  # ValueError, or too long
        if error is not None:
            request.status = RequestStatus.FINISHED_IGNORED
            request.error = error
            self._pending_outputs.append(
                EngineCoreOutput(request.request_id, [], FinishReason.LENGTH, error=error)
            )
            return
        request.set_block_hasher(self.kv_cache_manager.block_hasher, self.block_size)
        self.requests[request.request_id] = request
        if self.pins.goes_first(request):
            self.waiting.prepend_request(request)  # its prefix is held for it
        else:
            self.waiting.add_request(request)
        self.queued_prompts.add(request)
        self.kv_transfers.note_handoff(request)

    def finish_requests(self, request_ids: str | Iterable[str], status: RequestStatus) -> None:
        """End requests from outside (abort, error). Unknown or finished ids are ignored."""
        if not status.is_finished:
            raise ValueError(f"finish_requests needs a finished status, got {status.name}")
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        doomed = [r for r in (self.requests.get(i) for i in ids) if r and not r.is_finished]
        if not doomed:
            return
        running = {id(r) for r in doomed if r.status == _RUNNING}
        if running:
            self.running = [r for r in self.running if id(r) not in running]
        others = [r for r in doomed if id(r) not in running]
        if others:
            self.waiting.remove_requests(others)
            self.skipped_waiting.remove_requests(others)
        for request in doomed:
            self._finish(request, status)

    def get_num_unfinished_requests(self) -> int:
        return len(self.waiting) + len(self.skipped_waiting) + len(self.running)

    def has_unfinished_requests(self) -> bool:
        return self.get_num_unfinished_requests() > 0

    def has_requests(self) -> bool:
        """Work to do, or results not handed out yet: the engine loop should step."""
        return self.has_unfinished_requests() or bool(
            self.finished_req_ids or self._pending_outputs
        )

    # ---------------------------------------------------------------- schedule

    def schedule(self) -> SchedulerOutput:
        self.pins.expire()  # before any allocation: an expired pin's blocks are free
        step = self._decide()
        finished, self.finished_req_ids = self.finished_req_ids, set()
        output = build_scheduler_output(step, self.kv_cache_manager, finished)
        output.num_released_requests = self._num_released
        if self.connector is not None:
            output.kv_connector_metadata = self.connector.build_connector_meta(output)
        if self.tier is not None:
            output.tier_copies, output.tier_copies_first = self.tier.take_copies()
        return output

    def trace_steps(self, size: int) -> None:
        """Keep the newest `size` steps' records from now on (engine/core/step_trace.py; the
        records kept so far go); 0: trace nothing, not even a check per step."""
        self.step_trace = StepTrace(size) if size else None
        self.__dict__.pop("_decide", None)  # the class's own, unwrapped
        if self.step_trace is not None:
            self._decide = self.step_trace.around(self, self._decide)  # type: ignore[method-assign]

    def _decide(self) -> Step:
        """The step's decisions (wrapped by the step trace where one is kept)."""
        step = Step(self.scheduler_config.max_num_batched_tokens)
        self._schedule_running(step)
        # A step that had to preempt is short of blocks: admitting now would only thrash.
        if not step.preempted:
            self.admitter.schedule(step, self.running)
        return step

    def _schedule_running(self, step: Step) -> None:
        threshold = self.scheduler_config.long_prefill_token_threshold
        stepwise = self.scheduler_config.stepwise_recompute
        max_model_len = self.max_model_len
        running = self.running
        room = self.kv_cache_manager.running_room
        speculator = self.speculator
        lookahead = (
            speculator.lookahead_tokens if speculator and speculator.needs_lookahead else None
        )
        scheduled_running = step.scheduled_running
        num_scheduled = step.num_scheduled
        budget = step.budget  # a local in the loop; step.budget is kept for preemption
        i = 0
        while i < len(running) and budget > 0:
            request = running[i]
            placeholders = request.num_output_placeholders
            if placeholders and owes_its_last_token(request, max_model_len):
                i += 1  # async skip-ahead: the samples in flight end it, nothing to schedule
                continue
            # Placeholders are tokens sampled by a step still in flight (async scheduling);
            # drafts are computed with the last token, to be verified (num_tokens_with_spec).
            drafts = request.spec_token_ids
            num_new_tokens = len(request.all_token_ids) + placeholders - request.num_computed_tokens
            if drafts:
                num_new_tokens += len(drafts)
            if threshold and num_new_tokens > threshold:  # 0: no threshold
                num_new_tokens = threshold
            if num_new_tokens > budget:
                num_new_tokens = budget
            if stepwise and num_new_tokens > 1:  # known outputs, as decoding computed them
                num_new_tokens = stepwise_tokens(
                    request, request.num_computed_tokens, num_new_tokens
                )
            if num_new_tokens <= 0:
                i += 1
                continue
            req_id = request.request_id
            num_lookahead = lookahead(request) if lookahead else 0
            if num_lookahead or request.num_computed_tokens + num_new_tokens > room.get(req_id, 0):
                step.budget = budget
                new_blocks, i = self._slots_for(request, num_new_tokens, num_lookahead, i, step)
                budget = step.budget  # what an unscheduled victim gave back
                if new_blocks is None:
                    # It was the victim itself and left `running`: running[i] is the next one
                    # (under FCFS there is none; under priority a better one may now fit).
                    continue
                if new_blocks:
                    step.new_blocks[req_id] = new_blocks
            # else, usually: a decode within its blocks, nothing to allocate nor cache
            scheduled_running.append(request)
            num_scheduled[req_id] = num_new_tokens
            if drafts and (fit := drafts_that_fit(request, drafts, num_new_tokens)):
                step.spec_tokens[req_id] = fit
            budget -= num_new_tokens
            i += 1
        step.budget = budget

    def _slots_for(
        self, request: Request, num_new_tokens: int, num_lookahead: int, index: int, step: Step
    ) -> tuple[list[KVCacheBlock] | None, int]:
        """Slots for running[index] past its room: allocated, or made by preemption. Returns
        its new blocks (None if it was preempted itself) and its index in `running`."""
        new_blocks = self.kv_cache_manager.allocate_running_slots(
            request, num_new_tokens, num_lookahead
        )
        if new_blocks is not None:
            return new_blocks, index
        return self.preemption.until_fits(self.running, request, num_new_tokens, index, step)

    def may_schedule_ahead(self) -> bool:
        """Whether the next step may be scheduled before the outputs of the one in flight are
        back (async scheduling). Not while KV transfers hold steps back (`holds_steps`),
        nor while a running request speculates: its drafts are proposed from its newest
        token, which is only known once the step is back. Nor when nothing is left to run."""
        if not self.has_unfinished_requests() or self.kv_transfers.holds_steps():
            return False
        speculator = self.speculator
        return speculator is None or not any(map(speculator.wants_drafts, self.running))

    # ---------------------------------------------------------------- results

    def update_from_output(
        self, scheduler_output: SchedulerOutput, model_runner_output: ModelRunnerOutput
    ) -> list[EngineCoreOutput]:
        """Append sampled tokens, apply stop conditions, settle KV transfers."""
        outputs, self._pending_outputs = self._pending_outputs, []
        kv_output = model_runner_output.kv_connector_output
        tier_report = model_runner_output.tier_report
        loads = [kv_output] if kv_output is not None else []
        if tier_report is not None and self.tier is not None:
            loads.append(self.tier.settle(tier_report))
        discarded: set[str] = set()
        for load in loads:
            if load.invalid_block_ids:
                discarded |= self._handle_invalid_blocks(load, scheduler_output)
        self.kv_transfers.end_step(scheduler_output.num_scheduled_tokens)
        first_output = len(outputs)
        self._settle_samples(scheduler_output, model_runner_output, discarded, outputs)
        if self.speculator is not None:
            self.speculator.propose(
                self.requests, outputs[first_output:], model_runner_output.draft_token_ids
            )
        if model_runner_output.logprobs is not None:
            model_runner_output.attach_logprobs(outputs[first_output:])
        outputs.extend(self._pending_outputs)
        self._pending_outputs = []
        for load in loads:
            for done in self.kv_transfers.update_from_xfer_finished(load):
                self.free_request_blocks(done)
        if kv_output is not None and self.connector is not None:
            self.connector.update_connector_output(kv_output)
        return outputs

    def _handle_invalid_blocks(
        self, kv_output: KVConnectorOutput, scheduler_output: SchedulerOutput
    ) -> set[str]:
        """Apply the load-failure policy; returns the requests whose samples of this step
        are dropped (computed over bad KV)."""
        outcome = self.kv_transfers.handle_invalid_blocks(
            kv_output, scheduler_output.num_scheduled_tokens
        )
        for failed, error in outcome.failed:
            self.fail_request(failed, error)
        for req_id in outcome.discarded:
            request = self.requests.get(req_id)
            if request is not None and not request.is_finished:
                self.queued_prompts.watch(request)  # rewound: its prompt may be owed again
        return outcome.discarded

    def _settle_samples(
        self,
        scheduler_output: SchedulerOutput,
        runner_output: ModelRunnerOutput,
        discarded: set[str],
        outputs: list[EngineCoreOutput],
    ) -> None:
        """Each sample of the step to its request, in order. The loop is the decode fast
        path (running, one token, no drafts, good KV); _settle_sample takes the rest."""
        requests = self.requests
        scheduled = self._scheduled_by_id(scheduler_output)
        rare = discarded.union(scheduler_output.scheduled_spec_decode_tokens)
        max_model_len = self.max_model_len
        any_stopped = False
        for req_id, token_ids in zip(
            runner_output.req_ids, runner_output.sampled_token_ids, strict=True
        ):
            if not token_ids:
                continue  # a prefill chunk that did not reach the end of the prompt
            request = requests.get(req_id)
            if request is None or (scheduled is not None and request is not scheduled.get(req_id)):
                continue  # finished and gone (its id may name a new request by now)
            if request.status is not _RUNNING or len(token_ids) != 1 or req_id in rare:
                output = self._settle_sample(request, token_ids, scheduler_output, discarded)
                if output is None:
                    continue
            else:
                if request.num_output_placeholders:
                    request.num_output_placeholders -= 1  # this step's sample is here
                if request.timing.first_token is None:
                    request.timing.first_token = time.time()
                status = append_sampled(request, token_ids[0], max_model_len)
                if status is None:  # usually
                    outputs.append(EngineCoreOutput(req_id, token_ids))
                    continue
                output = self._finish_output(request, token_ids, status)
            any_stopped = any_stopped or output.finish_reason is not None
            outputs.append(output)
        if any_stopped:
            self.running = [r for r in self.running if r.status is _RUNNING]

    def _scheduled_by_id(self, scheduler_output: SchedulerOutput) -> dict[str, Request] | None:
        """The step's Requests by id, where an id may name another request by now (one was
        released since the step was scheduled); None where every id still names its own."""
        if self._num_released == scheduler_output.num_released_requests:
            return None
        return {r.request_id: r for r in scheduler_output.scheduled_requests}

    def _settle_sample(
        self,
        request: Request,
        token_ids: list[int],
        scheduler_output: SchedulerOutput,
        discarded: set[str],
    ) -> EngineCoreOutput | None:
        """A sample off the fast path: a request finished, aborted or preempted during the
        step, one whose logits came from bad KV (None: nothing to emit), verified drafts."""
        req_id = request.request_id
        if request.num_output_placeholders:
            request.num_output_placeholders -= 1  # this step's sample is here
        status = request.status
        if (status is not _RUNNING and status is not _PREEMPTED) or req_id in discarded:
            return None
        if request.timing.first_token is None:
            request.timing.first_token = time.time()
        if status is _PREEMPTED:
            return self._append_to_preempted(request, token_ids)
        drafts = scheduler_output.scheduled_spec_decode_tokens.get(req_id)
        if drafts and self.speculator is not None:
            self.speculator.settle(request, len(drafts), len(token_ids) - 1)
        return self._append_tokens(request, token_ids)

    def _append_to_preempted(self, request: Request, token_ids: list[int]) -> EngineCoreOutput:
        """Preempted while this step was in flight (async scheduling): the sample is good
        (computed over KV it still held); it resumes with it, or ends here."""
        output = self._append_tokens(request, token_ids)
        if output.finish_reason is not None:
            self.waiting.remove_requests([request])
        return output

    def _append_tokens(self, request: Request, token_ids: list[int]) -> EngineCoreOutput:
        num_appended, status = append_until_stop(request, token_ids, self.max_model_len)
        if status is None:
            return EngineCoreOutput(request.request_id, token_ids)
        # what follows a stop is never emitted
        return self._finish_output(request, token_ids[:num_appended], status)

    def _finish_output(
        self, request: Request, new_token_ids: list[int], status: RequestStatus
    ) -> EngineCoreOutput:
        kv_transfer_params = self._finish(request, status)
        return EngineCoreOutput(
            request.request_id,
            new_token_ids,
            finish_reason_of(status),
            request.stop_reason,
            kv_transfer_params,
            request.num_cached_tokens or 0,
            timing=request.timing,
        )

    def _finish(self, request: Request, status: RequestStatus) -> dict | None:
        """Mark finished and release its blocks, unless the connector still needs them."""
        request.status = status
        request.timing.finished = time.time()
        self.finished_req_ids.add(request.request_id)
        self.queued_prompts.forget(request)
        self.kv_transfers.end_handoff(request.request_id)
        kv_transfer_params = None
        delay_free = False
        if self.connector is not None:
            block_ids = self.kv_cache_manager.get_block_ids(request.request_id)
            delay_free, kv_transfer_params = self.connector.request_finished(request, block_ids)
        if self.tier is not None and self.tier.is_loading(request.request_id):
            delay_free = True  # the tier's copy into its blocks ends first (finished_recving)
        if request.pin is not None and not delay_free:
            blocks = self.kv_cache_manager.get_blocks(request.request_id)
            self.pins.turn_finished(request, status, blocks)
        if not delay_free:
            self.free_request_blocks(request)
        return kv_transfer_params

    def free_request_blocks(self, request: Request) -> None:
        self.kv_cache_manager.free(request)
        if self.requests.pop(request.request_id, None) is not None:
            self._num_released += 1
        self.kv_transfers.forget(request.request_id)

    def fail_request(self, request: Request, error: str) -> None:
        """End a request with FINISHED_ERROR; its output goes out with the next update."""
        request.error = error
        self.finish_requests(request.request_id, RequestStatus.FINISHED_ERROR)
        self._pending_outputs.append(
            EngineCoreOutput(
                request.request_id, [], FinishReason.ERROR, error=error, timing=request.timing
            )
        )
