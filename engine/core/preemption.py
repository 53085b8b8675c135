"""Preemption by recompute: when a running request cannot get the blocks its share of a step
needs, other running requests give theirs back and go to the front of the waiting queue.

A preempted request keeps its tokens and drops its KV (prefix caching may win some back when
it is admitted again). The running list is the scheduler's, passed in per call because the
scheduler replaces it when requests finish.
"""

from __future__ import annotations

from engine.core.kv_cache_manager import KVCacheManager
from engine.core.kv_cache_utils import KVCacheBlock
from engine.core.queued_prompts import QueuedPromptTokens
from engine.core.request_queue import RequestQueue
from engine.core.sched_step import Step
from engine.core.stop import owes_its_last_token
from engine.request import Request, RequestStatus
from engine.spec_decode.scheduling import Speculator, lookahead_tokens


class Preemption:
    def __init__(
        self,
        policy: str,
        max_model_len: int,
        kv_cache_manager: KVCacheManager,
        waiting: RequestQueue,
        queued_prompts: QueuedPromptTokens,
        speculator: Speculator | None,
    ) -> None:
        self.policy = policy
        self.max_model_len = max_model_len
        self.kv_cache_manager = kv_cache_manager
        self.waiting = waiting
        self.queued_prompts = queued_prompts
        self.speculator = speculator
        self.num_preemptions = 0  # since the engine started

    def until_fits(
        self, running: list[Request], request: Request, num_new_tokens: int, index: int, step: Step
    ) -> tuple[list[KVCacheBlock] | None, int]:
        """Preempt victims until `request` (running[index]) fits. Returns its new blocks (None
        if the victim was `request` itself) and its index in `running`, which shifts left
        when a victim before it is removed. Pinned turns move down to the tier first, where
        there is one (pins hold no running request's tokens)."""
        while self._move_a_pin_down():
            new_blocks = self._allocate(request, num_new_tokens)
            if new_blocks is not None:
                return new_blocks, index
        while True:
            victim = self.choose_victim(running, request)
            victim_index = running.index(victim)
            del running[victim_index]
            if victim_index < index:  # only under priority
                if victim.request_id in step.num_scheduled:  # not if it was skipped
                    step.unschedule(victim)
                    self.kv_cache_manager.uncache_unwritten(victim)
                index -= 1
            self.preempt(victim)
            step.preempted.append(victim)
            if victim is request:
                return None, index
            new_blocks = self._allocate(request, num_new_tokens)
            if new_blocks is not None:
                return new_blocks, index

    def _allocate(self, request: Request, num_new_tokens: int) -> list[KVCacheBlock] | None:
        return self.kv_cache_manager.allocate_slots(
            request, num_new_tokens, num_lookahead_tokens=lookahead_tokens(self.speculator, request)
        )

    def _move_a_pin_down(self) -> bool:
        """Release the oldest pin into the tier below. False: no tier (pins then hold until
        their TTL), or no pin."""
        kv = self.kv_cache_manager
        return kv.tier is not None and kv.release_oldest_pin()

    def choose_victim(self, running: list[Request], request: Request) -> Request:
        """FCFS: the most recently admitted; priority: the lowest priority. Never a request
        whose samples in flight end it (async scheduling): its blocks are free at the next
        update anyway, and a finished prefill must hand over its KV, not an empty lease.
        `request` itself is always a candidate."""
        candidates = [
            r
            for r in running
            if r is request
            or not (r.num_output_placeholders and owes_its_last_token(r, self.max_model_len))
        ]
        if self.policy == "priority":
            return max(candidates, key=Request.sort_key)
        return candidates[-1]

    def preempt(self, request: Request) -> None:
        """Drop every block of `request` (already out of the running list) and queue it first."""
        self.kv_cache_manager.free(request, preempted=True)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.spec_token_ids = []
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.prepend_request(request)
        self.queued_prompts.watch(request)
