"""A scheduler-side KV connector with no transport: stands in until the real one (NIXL/gRPC).

Requests say what they want through `kv_transfer_params`:
- {"remote_num_tokens": n, "async": bool}: n tokens of KV can be loaded from elsewhere.
- {"retry_steps": k}: answer "don't know yet" k times before matching.
- {"do_remote_decode": True}: keep the blocks after finishing, until finished_sending.
"""

from __future__ import annotations

from typing import Any

from engine.config import KVLoadFailurePolicy
from engine.core.kv_cache_utils import KVCacheBlock
from engine.core.sched_output import SchedulerOutput
from engine.kv_connector import KVConnectorBase
from engine.request import Request, RequestStatus


class FakeConnector(KVConnectorBase):
    def __init__(self, load_failure_policy: KVLoadFailurePolicy = "recompute") -> None:
        super().__init__(load_failure_policy)
        self.allocations: dict[str, tuple[list[int], int]] = {}
        self.loads_in_flight: set[str] = set()
        self.finished_calls: list[str] = []
        self._retries: dict[str, int] = {}

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        params = request.kv_transfer_params or {}
        retries = self._retries.setdefault(request.request_id, params.get("retry_steps", 0))
        if retries:
            self._retries[request.request_id] = retries - 1
            return None, False
        remote = params.get("remote_num_tokens", 0)
        return max(0, remote - num_computed_tokens), bool(params.get("async", True))

    def update_state_after_alloc(
        self, request: Request, blocks: list[KVCacheBlock], num_external_tokens: int
    ) -> None:
        self.allocations[request.request_id] = ([b.block_id for b in blocks], num_external_tokens)
        if num_external_tokens and request.status != RequestStatus.RUNNING:
            self.loads_in_flight.add(request.request_id)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> Any:
        return {"loads": sorted(self.loads_in_flight)}

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        self.finished_calls.append(request.request_id)
        if request.request_id in self.loads_in_flight:
            return True, None  # a read is in flight into these blocks
        params = request.kv_transfer_params or {}
        if params.get("do_remote_decode"):
            return True, {"remote_block_ids": block_ids, "do_remote_prefill": True}
        return False, None
