"""PDConnector: prefill -> decode KV transfer (docs/ARCHITECTURE.md, "The KV flow").

Prefill side: a request sent with {"do_remote_decode": true} finishes holding its blocks under
a lease; its kv_transfer_params say where and which. Decode side: a request sent with those
params loads the blocks its local prefix cache lacks, asynchronously, then runs. The worker
side (PDWorker) owns the side channel, the transport and the reads.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable, Sequence
from typing import Any

import torch

from connector.metadata import (
    ConnectorMetadata,
    LoadSpec,
    RemoteKV,
    compatibility_hash,
    tokens_hash,
)
from connector.pd_worker import PDWorker
from connector.side_channel import Loan
from connector.transport import contiguous_runs
from engine.config import EngineConfig, KVTransferConfig
from engine.core.kv_cache_utils import KVCacheBlock, cdiv
from engine.core.sched_output import SchedulerOutput
from engine.kv_connector import KVConnectorBase, PinPrefix, RunOnEngineThread
from engine.models import ModelArchConfig
from engine.models.fingerprint import dummy_weights_fingerprint, weights_fingerprint
from engine.request import Request, RequestStatus
from engine.worker.kv_cache import KVShard

logger = logging.getLogger(__name__)

_HANDED_OFF = (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH_CAPPED)
# How long a LendPrefix call waits for the engine thread (a step in progress) to pin blocks.
_LEND_TIMEOUT_S = 5.0


class PDConnector(KVConnectorBase):
    def __init__(
        self, config: KVTransferConfig, engine_id: str, compat_hash: str, block_size: int
    ) -> None:
        super().__init__(config.kv_load_failure_policy)
        self.config = config
        self.engine_id = engine_id
        self.block_size = block_size
        self.worker = PDWorker(config, engine_id, compat_hash)
        # Decode side: request id -> (remote, local hit tokens, tokens to load).
        self._matched: dict[str, tuple[RemoteKV, int, int]] = {}
        self._meta = ConnectorMetadata()
        self._reading: set[str] = set()  # loads started and not yet reported finished
        # Decode-side counters (tests and metrics): what was asked, what the cache spared.
        self._stats = {"loads_requested": 0, "blocks_requested": 0, "releases_without_read": 0}

    @classmethod
    def from_engine_config(cls, config: EngineConfig, arch: ModelArchConfig) -> PDConnector:
        """The connector of an engine built from `config` (its kv_transfer part is set)."""
        kv = config.kv_transfer
        if kv is None:
            raise ValueError("PDConnector needs an engine config with kv_transfer set")
        compat = compatibility_hash(
            model=arch.architecture,
            vocab_size=arch.vocab_size,
            hidden_size=arch.hidden_size,
            dtype=config.model.dtype,
            num_layers=arch.num_hidden_layers,
            num_kv_heads=arch.num_key_value_heads,
            head_dim=arch.head_dim,
            block_size=config.cache.block_size,
            # Same architecture, other weights (a revision, a fine-tune, a quantization):
            # other KV for the same tokens. Speculation is not here: its drafts' KV (n-gram:
            # none; a draft model's: its own cache) never travels.
            weights=_weights_fingerprint(config),
        )
        engine_id = kv.engine_id or f"engine-{uuid.uuid4().hex[:12]}"
        return cls(kv, engine_id, compat, config.cache.block_size)

    # ------------------------------------------------------------------ scheduler side

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        params = request.kv_transfer_params
        if not params or not params.get("do_remote_prefill"):
            return 0, False
        remote = RemoteKV.from_params(params)
        # All the remote has of the prompt: the scheduler keeps the last token to compute
        # unless the request adopts its first token with the whole prompt's KV.
        num_external = min(remote.num_tokens, request.num_prompt_tokens) - num_computed_tokens
        self._matched[request.request_id] = (remote, num_computed_tokens, max(num_external, 0))
        return max(num_external, 0), num_external > 0

    def update_state_after_alloc(
        self, request: Request, blocks: list[KVCacheBlock], num_external_tokens: int
    ) -> None:
        matched = self._matched.pop(request.request_id, None)
        if matched is None:
            return
        remote, num_local, _ = matched
        # The params were consumed (a preempted and resumed request recomputes locally); a
        # prefill that borrowed a prefix still hands its KV on to a decode engine.
        request.kv_transfer_params = _handoff_only(request.kv_transfer_params)
        if num_external_tokens == 0:
            self._meta.releases.append(remote)  # a full local hit: nothing to read
            self._stats["releases_without_read"] += 1
            return
        first = num_local // self.block_size
        last = cdiv(num_local + num_external_tokens, self.block_size)
        local_ids = [b.block_id for b in blocks[first:last]]
        remote_ids = remote.block_ids[first:last]
        # A remote of another block size lists another number of blocks: its handshake
        # refuses the read (compatibility hash), and nothing moves.
        request.timing.kv_load_descriptors = (
            len(contiguous_runs(local_ids, remote_ids)) if len(remote_ids) == len(local_ids) else 0
        )
        self._meta.loads.append(
            LoadSpec(
                request.request_id,
                remote,
                local_ids,
                remote_ids,
                remote.block_checksums[first:last],
            )
        )
        self._reading.add(request.request_id)
        self._stats["loads_requested"] += 1
        self._stats["blocks_requested"] += len(local_ids)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> ConnectorMetadata:
        meta, self._meta = self._meta, ConnectorMetadata()
        return meta

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        request_id = request.request_id
        self._matched.pop(request_id, None)  # matched but never allocated (aborted waiting)
        if request_id in self._reading:
            # Aborted while its read is in flight: the blocks may still be written into.
            self._meta.cancels.append(request_id)
            return True, None
        params = request.kv_transfer_params or {}
        if not params.get("do_remote_decode") or request.status not in _HANDED_OFF:
            return False, None
        computed = request.all_token_ids[: request.num_computed_tokens]
        remote = self.worker.lease_blocks(request_id, block_ids, computed)
        return True, remote.to_params()

    def validate_request(self, request: Request) -> None:
        """Refuse unusable kv_transfer_params at admission (ValueError), not mid-step."""
        params = request.kv_transfer_params
        if not params or not params.get("do_remote_prefill"):
            return
        remote = RemoteKV.from_params(params)
        if (
            remote.num_tokens > request.num_prompt_tokens
            or tokens_hash(request.prompt_token_ids[: remote.num_tokens]) != remote.tokens_hash
        ):
            raise ValueError(
                f"request {request.request_id!r}: kv_transfer_params were made for another "
                "prompt (the remote KV does not match this prompt's tokens)"
            )
        # Block counts are not checked here: the remote's block size may differ from ours, and
        # then the handshake refuses the layout (and the load is recomputed or failed).

    def has_pending_transfers(self) -> bool:
        return bool(self._reading) or self.worker.has_pending()

    # ------------------------------------------------------------------ worker side

    def register_kv_caches(self, kv_cache: torch.Tensor | Sequence[KVShard]) -> None:
        self.worker.register(kv_cache)

    def start_load_kv(self, metadata: Any) -> None:
        if isinstance(metadata, ConnectorMetadata):
            self.worker.start(metadata)

    def get_finished(self) -> tuple[set[str], set[str]]:
        done_sending, done_recving = self.worker.get_finished()
        self._reading -= done_recving
        return done_sending, done_recving

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.worker.take_invalid_block_ids()

    def take_load_problems(self) -> dict[str, str]:
        return self.worker.take_load_problems()

    def cancel_request(self, request_id: str) -> None:
        self.worker.cancel_lease(request_id)

    def watch_block_generations(self, generation_of: Callable[[int], int]) -> None:
        self.worker.watch_generations(generation_of)

    def enable_prefix_lending(
        self, pin: PinPrefix, run_on_engine_thread: RunOnEngineThread
    ) -> None:
        """Serve LendPrefix on the side channel: pin on the engine thread, lease from there
        (so blocks pinned after the caller gave up waiting are still under a lease, which
        expires), answer from the side channel's thread within the call's deadline."""

        def lend(block_hashes: list[bytes], timeout_s: float) -> Loan | None:
            lease_request_id = f"lend-{uuid.uuid4().hex}"

            def on_engine_thread() -> Loan | None:
                block_ids = pin(block_hashes, lease_request_id)
                if not block_ids:
                    return None
                return self.worker.lease_lent_blocks(lease_request_id, block_ids)

            pinned = run_on_engine_thread(on_engine_thread)
            try:
                return pinned.result(timeout=min(timeout_s, _LEND_TIMEOUT_S))
            except TimeoutError:
                # A long step: lend nothing. Unless the pin has begun meanwhile, it never
                # will; if it has, its lease expires unread.
                pinned.cancel()
                logger.info("lending a prefix: the engine stayed busy")
                return None

        self.worker.serve_loans(lend)

    @property
    def stats(self) -> dict[str, int]:
        """Counters: loads and blocks requested, blocks read, reads failed, releases."""
        return {**self._stats, **self.worker.stats}

    @property
    def side_channel_port(self) -> int:
        return self.worker.port

    @property
    def compat_hash(self) -> str:
        return self.worker.compat_hash

    def inject_load_failure(self, after: int) -> None:
        self.worker.transport.inject_failure(after)

    def close(self) -> None:
        self.worker.close()


def _weights_fingerprint(config: EngineConfig) -> str:
    model = config.model
    if model.load_format == "dummy":
        device = torch.device(model.device)
        # CUDA's generator fills by a grid sized to the GPU: the model and its SM count too.
        where = device.type
        if device.type == "cuda":
            properties = torch.cuda.get_device_properties(device)
            where += f":{properties.name}:{properties.multi_processor_count}"
        tp_size = config.parallel.tensor_parallel_size
        return dummy_weights_fingerprint(model.model, where, tp_size)
    return weights_fingerprint(model.model)


def _handoff_only(params: dict[str, Any] | None) -> dict[str, Any] | None:
    """What is left of kv_transfer_params once their remote KV is taken care of."""
    return {"do_remote_decode": True} if params and params.get("do_remote_decode") else None
