"""Admitting waiting requests into a step: which queue offers the next one, its prefix-cache
hits and remote KV, its first blocks.

The scheduler runs this after its running requests had their share of the step's budget, and
only when none of them had to be preempted. The queues are the scheduler's; so is the running
list, which admitted requests join in the order they were admitted.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from engine.config import SchedulerConfig
from engine.core.kv_cache_manager import KVCacheManager
from engine.core.kv_cache_utils import KVCacheBlock
from engine.core.kv_transfer_state import KVTransferState
from engine.core.queued_prompts import QueuedPromptTokens
from engine.core.recompute import stepwise_tokens
from engine.core.request_queue import RequestQueue
from engine.core.sched_step import Step
from engine.core.stop import adoptable_first_token, append_sampled
from engine.kv_connector import KVConnectorBase
from engine.outputs import EngineCoreOutput
from engine.request import Request, RequestStatus
from engine.spec_decode.scheduling import Speculator, lookahead_tokens

_RUNNING = RequestStatus.RUNNING
_PREEMPTED = RequestStatus.PREEMPTED
_WAITING_FOR_REMOTE_KVS = RequestStatus.WAITING_FOR_REMOTE_KVS


class Admitter:
    def __init__(
        self,
        config: SchedulerConfig,
        queues: tuple[RequestQueue, RequestQueue],
        kv_cache_manager: KVCacheManager,
        kv_transfers: KVTransferState,
        connector: KVConnectorBase | None,
        speculator: Speculator | None,
        queued_prompts: QueuedPromptTokens,
        emit: Callable[[EngineCoreOutput], None],
    ) -> None:
        self.config = config
        # Requests that could not be considered (blocked on a remote load, or the connector
        # asked to retry) wait in `skipped_waiting`, looked at before `waiting` under FCFS.
        self.waiting, self.skipped_waiting = queues
        self.kv_cache_manager = kv_cache_manager
        self.kv_transfers = kv_transfers
        self.connector = connector
        self.speculator = speculator
        self.queued_prompts = queued_prompts
        self.emit = emit  # an output made outside a step, sent with the next step's

    def schedule(self, step: Step, running: list[Request]) -> None:
        """Admit queue heads while the budget and `max_num_seqs` allow."""
        max_num_seqs = self.config.max_num_seqs
        while (self.waiting or self.skipped_waiting) and step.budget > 0:
            if len(running) >= max_num_seqs:
                break
            queue = self._select_queue()
            request = queue.peek_request()
            if request.status == _WAITING_FOR_REMOTE_KVS:
                if not self.kv_transfers.promote(request):
                    queue.pop_request()
                    step.skipped.append(request)
                    continue
                if request.num_computed_tokens == request.num_tokens:
                    self._adopt_first_token(request)
            if self._try_admit(request, queue, step, running) is None:
                break
        if step.skipped:
            self.skipped_waiting.prepend_requests(step.skipped)

    def _select_queue(self) -> RequestQueue:
        waiting, skipped = self.waiting, self.skipped_waiting
        if self.config.policy != "priority":
            return skipped or waiting
        if waiting and skipped:
            head, skipped_head = waiting.peek_request(), skipped.peek_request()
            return waiting if head.sort_key() < skipped_head.sort_key() else skipped
        return waiting or skipped

    def _try_admit(
        self, request: Request, queue: RequestQueue, step: Step, running: list[Request]
    ) -> bool | None:
        """Admit the head of `queue`. None: stop admitting this step (no room)."""
        kv = self.kv_cache_manager
        new_computed_blocks: list[KVCacheBlock] = []
        num_local = num_external = 0
        load_async = False
        tier_slots: list[int] = []
        if request.num_computed_tokens == 0:
            new_computed_blocks, num_local = kv.get_computed_blocks(request)
            if self.connector is not None:
                remote = self._remote_hits(request, num_local)
                if remote is None:  # the connector cannot tell yet
                    queue.pop_request()
                    step.skipped.append(request)
                    return False
                num_external, load_async = remote
            if num_external == 0 and kv.tier is not None:
                tier_slots = self._tier_hits(request, num_local)
                num_external = len(tier_slots) * kv.block_size
                load_async = bool(tier_slots)
        num_computed = request.num_computed_tokens + num_local + num_external
        num_new_tokens = 0 if load_async else self._num_new_tokens(request, num_computed, step)
        if num_new_tokens is None:
            return None
        hits = (num_local, new_computed_blocks, num_external)
        if self._allocate(request, num_new_tokens, hits, load_async, bool(running)) is None:
            return None
        queue.pop_request()
        self._note_admitted(request, num_local, num_external, bool(tier_slots))
        if load_async:
            if tier_slots:
                self._load_from_tier(request, num_local, tier_slots)
            tier = self.kv_cache_manager.tier
            tier_name = tier.name if tier_slots and tier is not None else ""
            self.kv_transfers.start_async_load(request, num_local, tier_name)
            step.skipped.append(request)
            step.started_loading.append(request)
            return True
        if num_external:
            self.kv_transfers.note_sync_load(request)
        _start_running(request, num_computed, num_new_tokens, step, running)
        return True

    def _allocate(
        self,
        request: Request,
        num_new_tokens: int,
        hits: tuple[int, list[KVCacheBlock], int],
        load_async: bool,
        running: bool,
    ) -> list[KVCacheBlock] | None:
        """Slots for an admitted request (`hits`: local hit tokens, their blocks, external
        tokens); None where the pool has no room."""
        num_local, new_computed_blocks, num_external = hits
        kv = self.kv_cache_manager
        # A load also takes the slot of the token computed once it lands: requests waiting
        # for their KV could otherwise hold the whole pool, none able to run.
        lookahead = lookahead_tokens(self.speculator, request) + (1 if load_async else 0)
        while True:
            new_blocks = kv.allocate_slots(
                request,
                num_new_tokens,
                num_local,
                new_computed_blocks,
                num_lookahead_tokens=lookahead,
                num_external_computed_tokens=num_external,
                # KV that arrives from elsewhere is not cached until it has arrived intact.
                delay_cache_blocks=num_external > 0,
            )
            # With nothing running, no block would come free but a pin's: pins give way
            # (oldest first) rather than hold the queue until their TTL.
            if new_blocks is not None or running or not kv.release_oldest_pin():
                return new_blocks

    def _remote_hits(self, request: Request, num_local: int) -> tuple[int, bool] | None:
        """Prompt tokens after the `num_local` hits whose KV the connector loads, and whether
        asynchronously; None while it cannot tell. At least one token is computed here, for
        its logits, unless the whole prompt's KV arrives with its first token
        (adoptable_first_token)."""
        assert self.connector is not None
        matched, load_async = self.connector.get_num_new_matched_tokens(request, num_local)
        if matched is None:
            return None
        max_model_len = self.config.max_model_len
        adopts = load_async and adoptable_first_token(request, max_model_len) is not None
        room = request.num_tokens - num_local - (0 if adopts else 1)
        num_external = max(0, min(matched, room))
        return num_external, load_async and num_external > 0

    def _adopt_first_token(self, request: Request) -> None:
        """The whole prompt's KV has landed: the request takes its forced first token as
        sampled, and computes that token next, as a colocated engine would after its prefill."""
        token = adoptable_first_token(request, self.config.max_model_len)
        assert token is not None, "only an adoptable request loads its whole prompt"
        append_sampled(request, token, self.config.max_model_len)  # it cannot stop it
        if request.timing.first_token is None:
            request.timing.first_token = time.time()
        request.timing.kv_load_adopted_first_token = True
        self.emit(EngineCoreOutput(request.request_id, [token]))

    def _tier_hits(self, request: Request, num_local: int) -> list[int]:
        """The tier's slots of the prompt's blocks after its `num_local` cached tokens: whole
        blocks, short of the last token (computed for its logits)."""
        tier = self.kv_cache_manager.tier
        assert tier is not None
        block_size = self.kv_cache_manager.block_size
        room = (request.num_tokens - 1 - num_local) // block_size
        return tier.match(request.block_hashes, num_local // block_size, room)

    def _load_from_tier(self, request: Request, num_local: int, slots: list[int]) -> None:
        kv = self.kv_cache_manager
        assert kv.tier is not None
        first = num_local // kv.block_size
        block_ids = kv.get_block_ids(request.request_id)[first : first + len(slots)]
        hashes = request.block_hashes[first : first + len(slots)]
        kv.tier.load(request.request_id, slots, block_ids, hashes, request.status == _PREEMPTED)

    def _note_admitted(
        self, request: Request, num_local: int, num_external: int, from_tier: bool = False
    ) -> None:
        if self.connector is not None:
            blocks = self.kv_cache_manager.get_blocks(request.request_id)
            # The tier's blocks are this engine's own: nothing for the connector to load.
            self.connector.update_state_after_alloc(
                request, blocks, 0 if from_tier else num_external
            )
        pins = self.kv_cache_manager.pins
        if request.pin is not None and pins is not None:
            pins.reuse(request.pin.key)  # it holds its prefix now: the pin's job is done
        if request.num_cached_tokens is None:
            request.num_cached_tokens = num_local + num_external
        request.num_external_computed_tokens = num_external
        self.queued_prompts.watch(request)  # its computed tokens move from here on

    def _num_new_tokens(self, request: Request, num_computed: int, step: Step) -> int | None:
        num_new_tokens = request.num_tokens - num_computed
        threshold = self.config.long_prefill_token_threshold
        if 0 < threshold < num_new_tokens:
            num_new_tokens = threshold
        if not self.config.enable_chunked_prefill and num_new_tokens > step.budget:
            return None  # the prompt goes whole or not at all
        if self.config.stepwise_recompute:  # known outputs, as decoding computed them
            num_new_tokens = stepwise_tokens(request, num_computed, num_new_tokens)
        return min(num_new_tokens, step.budget)


def _start_running(
    request: Request, num_computed: int, num_new_tokens: int, step: Step, running: list[Request]
) -> None:
    if request.status == _PREEMPTED:
        step.scheduled_resumed.append(request)
    else:
        step.scheduled_new.append(request)
    request.status = _RUNNING
    if request.timing.first_scheduled is None:
        request.timing.first_scheduled = time.time()
    request.num_computed_tokens = num_computed
    running.append(request)
    step.num_scheduled[request.request_id] = num_new_tokens
    step.budget -= num_new_tokens
