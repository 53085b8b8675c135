"""The V1 scheduler: one token budget shared by prefills and decodes, running requests first.

There is no prefill phase and no decode phase. A request has `num_computed_tokens` and
`num_tokens`; each step hands out `{request_id: num_new_tokens}` so that the former catches up
with the latter. A decode is a request one token behind; a prefill chunk is one further behind.

Why this file is long: scheduling and settling a step's outputs are one state machine over
the same queues and request states (running, waiting, preempted, loading, finished); split
apart, each half would have to reach into the other's invariants.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import replace

from engine.config import CacheConfig, SchedulerConfig, SpeculativeConfig
from engine.core.kv_cache_manager import KVCacheManager
from engine.core.kv_cache_utils import KVCacheBlock, check_capacity
from engine.core.kv_transfer_state import KVTransferState
from engine.core.request_queue import RequestQueue, create_request_queue
from engine.core.sched_output import ModelRunnerOutput, SchedulerOutput
from engine.core.sched_step import Step, build_scheduler_output
from engine.core.stop import check_stop, reaches_length_limit
from engine.kv_connector import KVConnectorBase
from engine.outputs import EngineCoreOutput
from engine.request import FinishReason, Request, RequestStatus, finish_reason_of
from engine.spec_decode.ngram import SpecDecodeStats
from engine.spec_decode.scheduling import Speculator
from engine.stats import EngineStats

_WAITING = RequestStatus.WAITING
_RUNNING = RequestStatus.RUNNING
_PREEMPTED = RequestStatus.PREEMPTED
_WAITING_FOR_REMOTE_KVS = RequestStatus.WAITING_FOR_REMOTE_KVS
# A step's sample is kept for requests in these states (preempted: after the step was sent).
_SAMPLING = (_RUNNING, _PREEMPTED)


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
        self.kv_transfers = KVTransferState(
            self.kv_cache_manager,
            self.requests,
            connector.load_failure_policy if connector is not None else "recompute",
        )
        # Outputs produced outside a step (e.g. rejected on arrival), sent with the next one.
        self._pending_outputs: list[EngineCoreOutput] = []
        self.num_preemptions = 0

    # ---------------------------------------------------------------- requests in and out

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"duplicate request id {request.request_id!r}")
        if request.status != _WAITING or request.num_computed_tokens:
            raise ValueError(f"request {request.request_id!r} was already scheduled once")
        if request.output_token_ids and request.num_tokens >= self.max_model_len:
            raise ValueError(
                f"request {request.request_id!r}: its prompt and {request.num_output_tokens} "
                f"output tokens fill max_model_len={self.max_model_len}; nothing is left to "
                "generate"
            )
        if request.num_prompt_tokens > self.max_model_len:
            error = (
                f"prompt has {request.num_prompt_tokens} tokens, more than "
                f"max_model_len={self.max_model_len}"
            )
            request.status = RequestStatus.FINISHED_IGNORED
            request.error = error
            self._pending_outputs.append(
                EngineCoreOutput(request.request_id, [], FinishReason.LENGTH, error=error)
            )
            return
        request.set_block_hasher(self.kv_cache_manager.block_hasher, self.block_size)
        self.requests[request.request_id] = request
        self.waiting.add_request(request)

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

    def make_stats(self) -> EngineStats:
        """The engine's statistics as of now (after each step; engine thread only)."""
        pool = self.kv_cache_manager.block_pool
        unfinished = self.get_num_unfinished_requests()
        prefix = self.kv_cache_manager.prefix_cache_stats
        speculator = self.speculator
        return EngineStats(
            num_blocks=pool.num_blocks - 1,
            num_free_blocks=pool.get_num_free_blocks(),
            num_running=len(self.running),
            num_waiting=unfinished - len(self.running),
            num_held_requests=len(self.requests) - unfinished,
            queued_prompt_tokens=self._queued_prompt_tokens(),
            num_preemptions=self.num_preemptions,
            prefix_cache_queries=prefix.queries,
            prefix_cache_hits=prefix.hits,
            spec_decode=replace(speculator.stats) if speculator else SpecDecodeStats(),
        )

    def _queued_prompt_tokens(self) -> int:
        """Prompt tokens of unfinished requests still to compute (a prompt whose KV is being
        read from another engine is not computed here)."""
        queued = 0
        for queue in (self.running, self.waiting, self.skipped_waiting):
            for request in queue:
                if request.status != RequestStatus.WAITING_FOR_REMOTE_KVS:
                    queued += max(0, request.num_prompt_tokens - request.num_computed_tokens)
        return queued

    # ---------------------------------------------------------------- schedule

    def schedule(self) -> SchedulerOutput:
        self.kv_cache_manager.new_step_starts()
        step = Step(self.scheduler_config.max_num_batched_tokens)
        self._schedule_running(step)
        # A step that had to preempt is short of blocks: admitting now would only thrash.
        if not step.preempted:
            self._schedule_waiting(step)
        finished, self.finished_req_ids = self.finished_req_ids, set()
        output = build_scheduler_output(step, self.kv_cache_manager, finished)
        if self.connector is not None:
            output.kv_connector_metadata = self.connector.build_connector_meta(output)
        return output

    def _schedule_running(self, step: Step) -> None:
        threshold = self.scheduler_config.long_prefill_token_threshold
        running = self.running
        allocate_slots = self.kv_cache_manager.allocate_slots
        scheduled_running = step.scheduled_running
        num_scheduled = step.num_scheduled
        new_blocks_by_req = step.new_blocks
        i = 0
        while i < len(running) and step.budget > 0:
            request = running[i]
            placeholders = request.num_output_placeholders
            if placeholders and self._owes_its_last_token(request):
                i += 1  # async skip-ahead: the samples in flight end it, nothing to schedule
                continue
            # Drafts are computed with the last token, to be verified (num_tokens_with_spec);
            # placeholders are tokens sampled by a step still in flight (async scheduling).
            drafts = request.spec_token_ids
            num_tokens = len(request.all_token_ids) + placeholders + len(drafts)
            num_new_tokens = num_tokens - request.num_computed_tokens
            if 0 < threshold < num_new_tokens:
                num_new_tokens = threshold
            if num_new_tokens > step.budget:
                num_new_tokens = step.budget
            if num_new_tokens <= 0:
                i += 1
                continue
            new_blocks = allocate_slots(request, num_new_tokens, 0, (), self._lookahead(request))
            if new_blocks is None:
                new_blocks, i = self._preempt_until_fits(request, num_new_tokens, i, step)
                if new_blocks is None:
                    # It was the victim itself and left `running`: running[i] is the next one
                    # (under FCFS there is none; under priority a better one may now fit).
                    continue
            scheduled_running.append(request)
            num_scheduled[request.request_id] = num_new_tokens
            if new_blocks:
                new_blocks_by_req[request.request_id] = new_blocks
            if drafts:  # those that fit in this step's share of the budget
                fit = request.num_computed_tokens + num_new_tokens - len(request.all_token_ids)
                if fit > 0:
                    step.spec_tokens[request.request_id] = drafts[:fit]
            step.budget -= num_new_tokens
            i += 1

    def _lookahead(self, request: Request) -> int:
        speculator = self.speculator
        return speculator.lookahead_tokens(request) if speculator is not None else 0

    def _owes_its_last_token(self, request: Request) -> bool:
        """The steps in flight already sample up to a length limit (max_tokens or the
        context): scheduling the request again would compute tokens nobody reads."""
        return reaches_length_limit(request, self.max_model_len, request.num_output_placeholders)

    def may_schedule_ahead(self) -> bool:
        """Whether the next step may be scheduled before the outputs of the one in flight are
        back (async scheduling). Not while a step in flight loads KV synchronously (a failed
        load rewinds its requests), nor while a running request speculates: its drafts are
        proposed from its newest token, which is only known once the step is back. Nor when
        nothing is left to run."""
        if not self.has_unfinished_requests() or self.kv_transfers.has_sync_loads():
            return False
        speculator = self.speculator
        return speculator is None or not any(map(speculator.wants_drafts, self.running))

    def _preempt_until_fits(
        self, request: Request, num_new_tokens: int, index: int, step: Step
    ) -> tuple[list[KVCacheBlock] | None, int]:
        """Preempt victims until `request` fits. Returns its new blocks (None if the victim
        was `request` itself) and its index in `running`, which shifts left when a victim
        before it is removed."""
        while True:
            victim = self._choose_victim(request)
            victim_index = self.running.index(victim)
            del self.running[victim_index]
            if victim_index < index:  # only under priority
                if victim.request_id in step.num_scheduled:  # not if it was skipped
                    self._unschedule(victim, step)
                index -= 1
            self._preempt(victim)
            step.preempted.append(victim)
            if victim is request:
                return None, index
            new_blocks = self.kv_cache_manager.allocate_slots(
                request, num_new_tokens, num_lookahead_tokens=self._lookahead(request)
            )
            if new_blocks is not None:
                return new_blocks, index

    def _choose_victim(self, request: Request) -> Request:
        """FCFS: the most recently admitted; priority: the lowest priority. Never a request
        whose samples in flight end it (async scheduling): its blocks are free at the next
        update anyway, and a finished prefill must hand over its KV, not an empty lease.
        `request` itself is always a candidate."""
        candidates = [
            r
            for r in self.running
            if r is request or not (r.num_output_placeholders and self._owes_its_last_token(r))
        ]
        if self.scheduler_config.policy == "priority":
            return max(candidates, key=Request.sort_key)
        return candidates[-1]

    def _unschedule(self, victim: Request, step: Step) -> None:
        """Roll back what this step already granted a request that is now preempted."""
        req_id = victim.request_id
        step.scheduled_running.remove(victim)
        step.budget += step.num_scheduled.pop(req_id)
        step.new_blocks.pop(req_id, None)
        step.spec_tokens.pop(req_id, None)

    def _preempt(self, request: Request) -> None:
        """Preemption by recompute: drop every block; prefix caching may win some back."""
        self.kv_cache_manager.free(request)
        request.status = _PREEMPTED
        request.num_computed_tokens = 0
        request.spec_token_ids = []
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.prepend_request(request)

    def _schedule_waiting(self, step: Step) -> None:
        max_num_seqs = self.scheduler_config.max_num_seqs
        while (self.waiting or self.skipped_waiting) and step.budget > 0:
            if len(self.running) >= max_num_seqs:
                break
            queue = self._select_waiting_queue()
            request = queue.peek_request()
            if request.status == _WAITING_FOR_REMOTE_KVS and not self.kv_transfers.promote(request):
                queue.pop_request()
                step.skipped.append(request)
                continue
            admitted = self._try_admit(request, queue, step)
            if admitted is None:
                break
        if step.skipped:
            self.skipped_waiting.prepend_requests(step.skipped)

    def _select_waiting_queue(self) -> RequestQueue:
        if self.scheduler_config.policy == "fcfs":
            return self.skipped_waiting or self.waiting
        if self.waiting and self.skipped_waiting:
            head, skipped_head = self.waiting.peek_request(), self.skipped_waiting.peek_request()
            return (
                self.waiting if head.sort_key() < skipped_head.sort_key() else self.skipped_waiting
            )
        return self.waiting or self.skipped_waiting

    def _try_admit(self, request: Request, queue: RequestQueue, step: Step) -> bool | None:
        """Admit the head of `queue`. None: stop admitting this step (no room)."""
        kv = self.kv_cache_manager
        new_computed_blocks: list[KVCacheBlock] = []
        num_local = num_external = 0
        load_async = False
        if request.num_computed_tokens == 0:
            new_computed_blocks, num_local = kv.get_computed_blocks(request)
            if self.connector is not None:
                matched, load_async = self.connector.get_num_new_matched_tokens(request, num_local)
                if matched is None:  # the connector cannot tell yet
                    queue.pop_request()
                    step.skipped.append(request)
                    return False
                # At least one token is always computed here, for its logits.
                num_external = max(0, min(matched, request.num_tokens - 1 - num_local))
                load_async = load_async and num_external > 0
        num_computed = request.num_computed_tokens + num_local + num_external
        num_new_tokens = 0 if load_async else self._num_new_tokens(request, num_computed, step)
        if num_new_tokens is None:
            return None
        new_blocks = kv.allocate_slots(
            request,
            num_new_tokens,
            num_local,
            new_computed_blocks,
            num_lookahead_tokens=self._lookahead(request),
            num_external_computed_tokens=num_external,
            # KV that arrives from elsewhere is not cached until it has arrived intact.
            delay_cache_blocks=num_external > 0,
        )
        if new_blocks is None:
            return None
        queue.pop_request()
        if self.connector is not None:
            self.connector.update_state_after_alloc(
                request, kv.get_blocks(request.request_id), num_external
            )
        if request.num_cached_tokens is None:
            request.num_cached_tokens = num_local + num_external
        request.num_external_computed_tokens = num_external
        if load_async:
            self.kv_transfers.start_async_load(request, num_local)
            step.skipped.append(request)
            return True
        if num_external:
            self.kv_transfers.note_sync_load(request)
        self._start_running(request, num_computed, num_new_tokens, step)
        return True

    def _num_new_tokens(self, request: Request, num_computed: int, step: Step) -> int | None:
        num_new_tokens = request.num_tokens - num_computed
        threshold = self.scheduler_config.long_prefill_token_threshold
        if 0 < threshold < num_new_tokens:
            num_new_tokens = threshold
        if not self.scheduler_config.enable_chunked_prefill and num_new_tokens > step.budget:
            return None  # the prompt goes whole or not at all
        return min(num_new_tokens, step.budget)

    def _start_running(
        self,
        request: Request,
        num_computed: int,
        num_new_tokens: int,
        step: Step,
    ) -> None:
        if request.status == _PREEMPTED:
            step.scheduled_resumed.append(request)
        else:
            step.scheduled_new.append(request)
        request.status = _RUNNING
        if request.timing.first_scheduled is None:
            request.timing.first_scheduled = time.time()
        request.num_computed_tokens = num_computed
        self.running.append(request)
        step.num_scheduled[request.request_id] = num_new_tokens
        step.budget -= num_new_tokens

    # ---------------------------------------------------------------- results

    def update_from_output(
        self, scheduler_output: SchedulerOutput, model_runner_output: ModelRunnerOutput
    ) -> list[EngineCoreOutput]:
        """Append sampled tokens, apply stop conditions, settle KV transfers."""
        outputs, self._pending_outputs = self._pending_outputs, []
        kv_output = model_runner_output.kv_connector_output
        discarded: set[str] = set()
        if kv_output is not None and kv_output.invalid_block_ids:
            outcome = self.kv_transfers.handle_invalid_blocks(
                kv_output.invalid_block_ids, scheduler_output.num_scheduled_tokens
            )
            discarded = outcome.discarded
            for failed, error in outcome.failed:
                self.fail_request(failed, error)
        self.kv_transfers.end_step(scheduler_output.num_scheduled_tokens)
        requests = self.requests
        scheduled = scheduler_output.scheduled_requests
        max_model_len = self.max_model_len
        any_stopped = False
        first_output = len(outputs)
        for req_id, token_ids in zip(
            model_runner_output.req_ids, model_runner_output.sampled_token_ids, strict=True
        ):
            if not token_ids:
                continue  # a prefill chunk that did not reach the end of the prompt
            request = requests.get(req_id)
            if request is None or request is not scheduled.get(req_id):
                continue  # finished and gone (its id may name a new request by now)
            if request.num_output_placeholders:
                request.num_output_placeholders -= 1  # this step's sample is here
            if request.status not in _SAMPLING or req_id in discarded:
                continue  # aborted during the step, or its logits came from bad KV
            if request.timing.first_token is None:
                request.timing.first_token = time.time()
            if request.status == _PREEMPTED:
                # Preempted while this step was in flight (async scheduling): the sample is
                # good (computed over KV it still held); it resumes with it, or ends here.
                outputs.append(self._append_to_preempted(request, token_ids))
                continue
            drafts = scheduler_output.scheduled_spec_decode_tokens.get(req_id)
            if drafts and self.speculator is not None:
                self.speculator.settle(request, len(drafts), len(token_ids) - 1)
            if len(token_ids) == 1:  # the decode fast path: one token, usually no stop
                request.append_output_token_ids(token_ids[0])
                status = check_stop(request, token_ids[0], max_model_len)
                if status is None:
                    outputs.append(EngineCoreOutput(req_id, token_ids))
                    continue
                output = self._finish_output(request, token_ids, status)
            else:
                output = self._append_tokens(request, token_ids)
            any_stopped = any_stopped or output.finish_reason is not None
            outputs.append(output)
        if any_stopped:
            self.running = [r for r in self.running if r.status == _RUNNING]
        if self.speculator is not None:
            self.speculator.propose(
                self.requests, outputs[first_output:], model_runner_output.draft_token_ids
            )
        if model_runner_output.logprobs is not None:
            model_runner_output.attach_logprobs(outputs[first_output:])
        outputs.extend(self._pending_outputs)
        self._pending_outputs = []
        if kv_output is not None:
            for done in self.kv_transfers.update_from_xfer_finished(kv_output):
                self.free_request_blocks(done)
            if self.connector is not None:
                self.connector.update_connector_output(kv_output)
        return outputs

    def _append_to_preempted(self, request: Request, token_ids: list[int]) -> EngineCoreOutput:
        output = self._append_tokens(request, token_ids)
        if output.finish_reason is not None:
            self.waiting.remove_requests([request])
        return output

    def _append_tokens(self, request: Request, token_ids: list[int]) -> EngineCoreOutput:
        """Several tokens in one step (speculative decoding): stop at the first stop."""
        for n, token_id in enumerate(token_ids, 1):
            request.append_output_token_ids(token_id)
            status = check_stop(request, token_id, self.max_model_len)
            if status is not None:
                # what follows a stop is never emitted
                return self._finish_output(request, token_ids[:n], status)
        return EngineCoreOutput(request.request_id, token_ids)

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
        kv_transfer_params = None
        delay_free = False
        if self.connector is not None:
            block_ids = self.kv_cache_manager.get_block_ids(request.request_id)
            delay_free, kv_transfer_params = self.connector.request_finished(request, block_ids)
        if not delay_free:
            self.free_request_blocks(request)
        return kv_transfer_params

    def free_request_blocks(self, request: Request) -> None:
        self.kv_cache_manager.free(request)
        self.requests.pop(request.request_id, None)
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
