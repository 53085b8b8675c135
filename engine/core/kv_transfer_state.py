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
from typing import TYPE_CHECKING

from engine.core.kv_cache_utils import cdiv
from engine.core.sched_output import KVConnectorOutput
from engine.request import Request, RequestStatus

if TYPE_CHECKING:
    from engine.core.scheduler import Scheduler


class KVTransferState:
    def __init__(self, scheduler: Scheduler) -> None:
        self._scheduler = scheduler
        # req_id -> num_computed_tokens the request will have once its load has landed.
        self._load_targets: dict[str, int] = {}
        self._finished_recving: set[str] = set()
        self._failed_recving: set[str] = set()
        # Requests whose external KV is loaded inside this very step (synchronous loads).
        self._sync_loads: set[str] = set()

    def start_async_load(self, request: Request, num_local_computed_tokens: int) -> None:
        request.status = RequestStatus.WAITING_FOR_REMOTE_KVS
        request.num_computed_tokens = num_local_computed_tokens
        target = num_local_computed_tokens + request.num_external_computed_tokens
        self._load_targets[request.request_id] = target
        block_size = self._scheduler.block_size
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
        request.timing.kv_load_end = time.time()
        if req_id in self._failed_recving:
            self._failed_recving.discard(req_id)  # already rewound to the valid prefix
            request.timing.kv_load_outcome = "recovered"
        else:
            request.num_computed_tokens = target
            request.timing.kv_load_outcome = "ok"
        self._scheduler.kv_cache_manager.cache_blocks(request, request.num_computed_tokens)
        request.status = RequestStatus.WAITING
        return True

    def handle_invalid_blocks(self, invalid_block_ids: set[int]) -> set[str]:
        """Apply the load-failure policy. Returns requests whose sampled tokens of this step
        must be dropped (they were computed over bad KV)."""
        scheduler = self._scheduler
        connector = scheduler.connector
        policy = connector.load_failure_policy if connector is not None else "recompute"
        affected: set[str] = set()
        for req_id, target in self._loads_to_check():
            request = scheduler.requests.get(req_id)
            if request is None or request.is_finished:
                continue
            valid = self._valid_prefix(req_id, target, invalid_block_ids)
            if valid is None:
                continue
            affected.add(req_id)
            if policy == "fail":
                request.timing.kv_load_end = time.time()
                request.timing.kv_load_outcome = "failed"
                bad = sorted(invalid_block_ids)
                scheduler.fail_request(request, f"loading remote KV failed (invalid blocks {bad})")
                continue
            if req_id in self._load_targets:  # asynchronous: takes effect at promotion
                request.num_computed_tokens = valid
                self._failed_recving.add(req_id)
            else:  # synchronous: this step computed over the bad blocks
                request.num_computed_tokens = min(request.num_computed_tokens, valid)
        return affected

    def end_step(self) -> None:
        self._sync_loads.clear()

    def update_from_xfer_finished(self, kv_output: KVConnectorOutput) -> None:
        scheduler = self._scheduler
        for req_id in kv_output.finished_recving:
            request = scheduler.requests.get(req_id)
            if request is None:
                continue
            if request.is_finished:
                # Aborted while its read was in flight: the blocks are safe to reuse only now.
                scheduler.free_request_blocks(request)
            else:
                self._finished_recving.add(req_id)
        for req_id in kv_output.finished_sending:
            request = scheduler.requests.get(req_id)
            if request is not None and request.is_finished:
                scheduler.free_request_blocks(request)

    def forget(self, req_id: str) -> None:
        self._load_targets.pop(req_id, None)
        self._finished_recving.discard(req_id)
        self._failed_recving.discard(req_id)

    def _loads_to_check(self) -> list[tuple[str, int]]:
        loads = list(self._load_targets.items())
        requests = self._scheduler.requests
        for req_id in self._sync_loads:
            request = requests.get(req_id)
            if request is not None:
                loads.append((req_id, request.num_computed_tokens))
        return loads

    def _valid_prefix(self, req_id: str, target: int, invalid: set[int]) -> int | None:
        """Tokens before the first invalid block among the first `target` tokens, or None
        if none of the request's loaded blocks is invalid."""
        block_size = self._scheduler.block_size
        block_ids = self._scheduler.kv_cache_manager.get_block_ids(req_id)
        for index, block_id in enumerate(block_ids[: cdiv(target, block_size)]):
            if block_id in invalid:
                return min(index * block_size, target)
        return None
