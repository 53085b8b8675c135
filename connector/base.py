"""The KV connector contract, scheduler side.

The scheduler calls these hooks at fixed points of a step; a connector decides where KV comes
from (a remote prefill engine) and how long finished requests keep their blocks (until a remote
decode engine has read them). The worker side (the transfers themselves) reports back through
`KVConnectorOutput` in the model runner's output.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, Literal

from engine.core.kv_cache_utils import KVCacheBlock
from engine.core.sched_output import SchedulerOutput
from engine.request import Request

KVLoadFailurePolicy = Literal["recompute", "fail"]


class KVConnectorBase(ABC):
    """Scheduler-side hooks. Every method runs in the scheduler's thread, once per call site."""

    def __init__(self, load_failure_policy: KVLoadFailurePolicy = "recompute") -> None:
        if load_failure_policy not in ("recompute", "fail"):
            raise ValueError(
                f"load_failure_policy must be 'recompute' or 'fail', got {load_failure_policy!r}"
            )
        self.load_failure_policy: KVLoadFailurePolicy = load_failure_policy

    @abstractmethod
    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        """Tokens beyond the `num_computed_tokens` local hits whose KV can be loaded, and
        whether the load is asynchronous (the request then waits in WAITING_FOR_REMOTE_KVS).

        None means "not known yet, ask again next step".
        """

    @abstractmethod
    def update_state_after_alloc(
        self, request: Request, blocks: list[KVCacheBlock], num_external_tokens: int
    ) -> None:
        """Blocks were allocated for an admitted request; `blocks` is its whole block list,
        the last `cdiv(num_external_tokens, block_size)`-ish of which the load must fill."""

    @abstractmethod
    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> Any:
        """What the worker side needs this step (loads to start, saves to expose)."""

    @abstractmethod
    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        """A request finished. Returns (delay_free, kv_transfer_params): with delay_free the
        scheduler keeps the blocks until the worker reports the request in finished_sending
        (or finished_recving, for an abort while a load is in flight)."""
