"""Scheduler-side bookkeeping of KV that arrives from another engine.

Asynchronous loads: an admitted request waits in WAITING_FOR_REMOTE_KVS holding its blocks;
when the worker reports the load finished, the request goes back to WAITING with its computed
tokens counted, and its blocks enter the prefix cache only then.

Failed loads: the worker reports invalid block ids no later than the request's
`finished_recving`. Everything from the first invalid block on is treated as never computed:
policy "recompute" rewinds `num_computed_tokens` to the valid prefix, policy "fail" ends the
request with FINISHED_ERROR. Either way no invalid block enters the prefix cache.
"""

from __future__ import annotations

import time
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from engine.core.kv_cache_manager import KVCacheManager
from engine.core.kv_cache_utils import cdiv
from engine.core.sched_output import KVConnectorOutput
from engine.request import Request, RequestStatus

if TYPE_CHECKING:
    from engine.kv_connector import KVConnectorBase


@dataclass
class InvalidBlocksOutcome:
    """What the scheduler must do about blocks whose load failed."""

    # Requests whose sampled tokens of this step are dropped (computed over bad KV).
    discarded: set[str] = field(default_factory=set)
    # Requests to end with FINISHED_ERROR (policy "fail"), with the message.
    failed: list[tuple[Request, str]] = field(default_factory=list)


class KVTransferState:
    """The scheduler's requests are read, never owned: the scheduler acts on what this
    returns (requests to fail, requests whose blocks may be freed)."""

    def __init__(
        self,
        kv_cache_manager: KVCacheManager,
        requests: Mapping[str, Request],
        connector: KVConnectorBase | None,
    ) -> None:
        self._kv_cache_manager = kv_cache_manager
        self._requests = requests
        self._block_size = kv_cache_manager.block_size
        self._policy = connector.load_failure_policy if connector is not None else "recompute"
        if connector is not None:  # it fences reads of the blocks it lends on these
            connector.watch_block_generations(kv_cache_manager.block_pool.generation_of)
        # req_id -> num_computed_tokens the request will have once its load has landed.
        self._load_targets: dict[str, int] = {}
        self._finished_recving: set[str] = set()
        self._failed_recving: set[str] = set()
        # Requests whose external KV is loaded inside this very step (synchronous loads).
        self._sync_loads: set[str] = set()
        # Unfinished requests that hand their KV on (do_remote_decode): their blocks are
        # checksummed as they finish, so no step may be writing into them then.
        self._handoffs: set[str] = set()
        # Requests loading from the KV tier below the pool: a bad block is recomputed
        # whatever the connector's policy (it is this engine's own copy, not a remote's).
        self._tier_loads: set[str] = set()
        # Preempted requests loading their KV back: they resume (the worker kept their state).
        self._resuming: set[str] = set()

    def start_async_load(
        self, request: Request, num_local_computed_tokens: int, tier: str = ""
    ) -> None:
        """`tier`: the KV comes from this engine's tier of that name, not another engine."""
        if tier:
            self._tier_loads.add(request.request_id)
            request.timing.kv_load_tier = tier
        if request.status == RequestStatus.PREEMPTED:  # its KV comes back from the tier
            self._resuming.add(request.request_id)
        request.status = RequestStatus.WAITING_FOR_REMOTE_KVS
        request.num_computed_tokens = num_local_computed_tokens
        target = num_local_computed_tokens + request.num_external_computed_tokens
        self._load_targets[request.request_id] = target
        block_size = self._block_size
        request.timing.kv_load_start = time.time()
        request.timing.kv_load_blocks = (
            cdiv(target, block_size) - num_local_computed_tokens // block_size
        )

    def note_sync_load(self, request: Request) -> None:
        self._sync_loads.add(request.request_id)

    def promote(self, request: Request) -> bool:
        """Move a request whose load has ended back to WAITING. False if still loading."""
        req_id = request.request_id
        if req_id not in self._finished_recving:
            return False
        self._finished_recving.discard(req_id)
        target = self._load_targets.pop(req_id)
        self._tier_loads.discard(req_id)
        request.timing.kv_load_end = time.time()
        if req_id in self._failed_recving:
            self._failed_recving.discard(req_id)  # already rewound to the valid prefix
            request.timing.kv_load_outcome = "recovered"
        else:
            request.num_computed_tokens = target
            request.timing.kv_load_outcome = "ok"
        self._kv_cache_manager.cache_blocks(request, request.num_computed_tokens)
        resuming = req_id in self._resuming
        self._resuming.discard(req_id)
        request.status = RequestStatus.PREEMPTED if resuming else RequestStatus.WAITING
        return True

    def handle_invalid_blocks(
        self, kv_output: KVConnectorOutput, scheduled_req_ids: Collection[str]
    ) -> InvalidBlocksOutcome:
        """Apply the load-failure policy: rewind the requests that loaded an invalid block
        ("recompute"), or say which ones to fail ("fail"). Synchronous loads count only for
        the requests of the step reporting (not those of a step scheduled ahead)."""
        outcome = InvalidBlocksOutcome()
        invalid_block_ids = kv_output.invalid_block_ids
        for req_id, target in self._loads_to_check(scheduled_req_ids):
            request = self._requests.get(req_id)
            if request is None or request.is_finished:
                continue
            valid = self._valid_prefix(req_id, target, invalid_block_ids)
            if valid is None:
                continue
            outcome.discarded.add(req_id)
            request.timing.kv_load_problem = kv_output.load_problems.get(req_id, "unknown")
            if self._policy == "fail" and req_id not in self._tier_loads:
                request.timing.kv_load_end = time.time()
                request.timing.kv_load_outcome = "failed"
                bad = sorted(invalid_block_ids)
                outcome.failed.append((request, f"loading remote KV failed (invalid blocks {bad})"))
                continue
            if req_id in self._load_targets:  # asynchronous: takes effect at promotion
                request.num_computed_tokens = valid
                self._failed_recving.add(req_id)
            else:  # synchronous: this step computed over the bad blocks
                request.num_computed_tokens = min(request.num_computed_tokens, valid)
        return outcome

    def end_step(self, scheduled_req_ids: Iterable[str]) -> None:
        """A step's outputs are settled: its synchronous loads are over (a step scheduled
        ahead keeps its own)."""
        if self._sync_loads:  # rarely: not a walk over every step's ids for nothing
            self._sync_loads.difference_update(scheduled_req_ids)

    def note_handoff(self, request: Request) -> None:
        """A request that will hand its KV to another engine (see `holds_steps`) and may be
        scheduled after its last sample: with max_tokens 1 (a prefill leg) it never is."""
        params = request.kv_transfer_params
        if params and params.get("do_remote_decode") and request.sampling_params.max_tokens > 1:
            self._handoffs.add(request.request_id)

    def end_handoff(self, req_id: str) -> None:
        self._handoffs.discard(req_id)

    def holds_steps(self) -> bool:
        """Whether the next step must wait for the one in flight (async scheduling): a load
        inside that step may fail and rewind its request, and a request that hands its KV
        on is checksummed when it finishes — a step scheduled ahead of its last sample
        would write its next token's K/V into a leased block after the checksum."""
        return bool(self._sync_loads or self._handoffs)

    def update_from_xfer_finished(self, kv_output: KVConnectorOutput) -> list[Request]:
        """Note the loads that ended; returns the finished requests whose blocks no transfer
        needs any more (the scheduler frees them)."""
        releasable: dict[str, Request] = {}  # by id: one request may appear in both sets
        for req_id in kv_output.finished_recving:
            request = self._requests.get(req_id)
            if request is None:
                continue
            if request.is_finished:
                # Aborted while its read was in flight: the blocks are safe to reuse only now.
                releasable[req_id] = request
            else:
                self._finished_recving.add(req_id)
        for req_id in kv_output.finished_sending:
            if self._kv_cache_manager.return_loan(req_id):
                continue  # lent prefix blocks (EngineCore.pin_prefix), not a request's
            request = self._requests.get(req_id)
            if request is not None and request.is_finished:
                releasable[req_id] = request
        return list(releasable.values())

    def forget(self, req_id: str) -> None:
        self._load_targets.pop(req_id, None)
        self._tier_loads.discard(req_id)
        self._resuming.discard(req_id)
        self._finished_recving.discard(req_id)
        self._failed_recving.discard(req_id)

    def _loads_to_check(self, scheduled_req_ids: Collection[str]) -> list[tuple[str, int]]:
        loads = list(self._load_targets.items())
        for req_id in self._sync_loads.intersection(scheduled_req_ids):
            request = self._requests.get(req_id)
            if request is not None:
                loads.append((req_id, request.num_computed_tokens))
        return loads

    def _valid_prefix(self, req_id: str, target: int, invalid: set[int]) -> int | None:
        """Tokens before the first invalid block among the first `target` tokens, or None
        if none of the request's loaded blocks is invalid."""
        block_size = self._block_size
        block_ids = self._kv_cache_manager.get_block_ids(req_id)
        for index, block_id in enumerate(block_ids[: cdiv(target, block_size)]):
            if block_id in invalid:
                return min(index * block_size, target)
        return None
