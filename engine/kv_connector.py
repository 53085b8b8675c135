"""The KV connector contract the engine drives: a scheduler side and a worker side.

The engine defines the contract and connector/ implements it (PDConnector). engine/ never
imports connector/: it names the implementation (`CONNECTOR_CLASS`) and imports it only
when a configuration asks for KV transfer (docs/ARCHITECTURE.md, "Layers").

The scheduler calls its hooks at fixed points of a step; a connector decides where KV comes
from (a remote prefill engine) and how long finished requests keep their blocks (until a remote
decode engine has read them). The worker side moves the bytes and reports back, once per step,
through `KVConnectorOutput` in the model runner's output.
"""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from engine.config import KVLoadFailurePolicy, check_load_failure_policy
from engine.core.kv_cache_utils import KVCacheBlock
from engine.core.sched_output import KVConnectorOutput, SchedulerOutput
from engine.request import Request

if TYPE_CHECKING:
    import torch

    from engine.config import EngineConfig
    from engine.models import ModelArchConfig
    from engine.worker.kv_cache import KVShard

T = TypeVar("T")
# The KV cache's block-contiguous layout (engine/worker/kv_cache.py), named in the transfer
# compatibility hash: engines with different layouts must not exchange blocks.
KV_CACHE_LAYOUT = "blocks-layers-kv-tokens-heads-dim/v1"
# Pins the cached blocks of a prompt's leading block hashes for a lease (engine thread only).
PinPrefix = Callable[[list[bytes], str], list[int]]


class RunOnEngineThread(Protocol):
    """Calls `fn` on the engine's own thread, from any other (AsyncEngine.run_on_loop)."""

    def __call__(self, fn: Callable[[], T]) -> Future[T]: ...


# Where the connector lives, by name: resolved at run time, like vLLM's KVConnectorFactory,
# so that the layer below (engine/) needs no import of the layer above (connector/).
CONNECTOR_CLASS = "connector.pd_connector:PDConnector"


class KVConnectorBase(ABC):
    """Scheduler-side hooks run in the scheduler's thread; worker-side ones in the worker's
    (one engine thread here). The default worker side does nothing: a scheduler-only
    connector (tests) needs no transport."""

    def __init__(self, load_failure_policy: KVLoadFailurePolicy = "recompute") -> None:
        check_load_failure_policy(load_failure_policy)
        self.load_failure_policy: KVLoadFailurePolicy = load_failure_policy

    # ------------------------------------------------------------------ scheduler side

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
        """Blocks were allocated for an admitted request (`blocks`: all of them, local hits
        first); the ones after the local hits receive the `num_external_tokens` loaded."""

    @abstractmethod
    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> Any:
        """What the worker side needs this step (loads to start, leases to release)."""

    @abstractmethod
    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        """A request finished. Returns (delay_free, kv_transfer_params): with delay_free the
        scheduler keeps the blocks until the worker reports the request in finished_sending
        (or finished_recving, for an abort while a load is in flight)."""

    def validate_request(self, request: Request) -> None:
        """Raise ValueError for kv_transfer_params this connector cannot serve."""
        return None

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        """The worker's report of this step, seen by the scheduler side (default: nothing)."""
        return None

    def has_pending_transfers(self) -> bool:
        """Reads in flight or blocks held for a reader: the engine must keep stepping."""
        return False

    # ------------------------------------------------------------------ worker side

    def register_kv_caches(self, kv_cache: torch.Tensor | Sequence[KVShard]) -> None:
        """The engine's KV cache, once, before the first step: one tensor, or one shard per
        tensor-parallel rank that keeps a cache of its own (engine/worker/kv_cache.py)."""
        return None

    def start_load_kv(self, metadata: Any) -> None:
        """Start the loads `build_connector_meta` asked for; returns at once."""
        return None

    def get_finished(self) -> tuple[set[str], set[str]]:
        """(done_sending, done_recving) since the last call: requests whose blocks a reader
        no longer needs, and requests whose load ended (successfully or not)."""
        return set(), set()

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Local blocks whose load failed since the last call (reported no later than the
        request's done_recving)."""
        return set()

    def take_load_problems(self) -> dict[str, str]:
        """Request id -> why its finished load was not used in full, since the last call, in
        a word: "checksum" (a block did not match), "fenced" (the producer no longer held the
        blocks as lent), "unreachable", "timed_out", "refused" (handshake refused, read not
        posted) or "failed" (the transport)."""
        return {}

    def cancel_request(self, request_id: str) -> None:
        """An abort reached a request whose blocks the connector holds (read or lease)."""
        return None

    def watch_block_generations(self, generation_of: Callable[[int], int]) -> None:
        """The engine's blocks' generations (BlockPool.generation_of, callable from any
        thread): a connector that lends blocks fences reads on them. Default: lends none."""
        return None

    def enable_prefix_lending(
        self, pin: PinPrefix, run_on_engine_thread: RunOnEngineThread
    ) -> None:
        """The engine can lend prefix-cache blocks to other engines: `pin(block_hashes,
        lease_request_id)` takes the blocks of the hashes' leading cached run for a reader and
        returns their ids (the engine frees them once `lease_request_id` is reported in
        `finished_sending`); it must run on the engine's thread, which
        `run_on_engine_thread` reaches from any other. Default: this connector does not lend."""
        return None

    def inject_load_failure(self, after: int) -> None:
        """Tests: the next load fails part-way (see KVTransport.inject_failure)."""
        raise ValueError("this engine's connector cannot inject load failures")

    @property
    def side_channel_port(self) -> int | None:
        """Where peers reach this engine for KV, if it serves a side channel."""
        return None

    @property
    def compat_hash(self) -> str:
        """What engines whose KV is interchangeable with this one's share ("" if none)."""
        return ""

    @property
    def stats(self) -> dict[str, int]:
        """Counters of this connector (tests, metrics)."""
        return {}

    def close(self) -> None:
        return None


def create_kv_connector(config: EngineConfig, arch: ModelArchConfig) -> KVConnectorBase:
    """The connector `config.kv_transfer` asks for (the caller checked it is set)."""
    module_name, _, class_name = CONNECTOR_CLASS.partition(":")
    connector_class = getattr(importlib.import_module(module_name), class_name)
    connector: KVConnectorBase = connector_class.from_engine_config(config, arch)
    return connector
