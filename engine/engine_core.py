"""EngineCore: the step loop (schedule -> execute -> update) over one model and one KV pool."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterable
from dataclasses import replace

from connector.base import KVConnectorBase
from engine.config import EngineConfig
from engine.core.sched_output import EngineCoreOutput
from engine.core.scheduler import Scheduler
from engine.models import ModelArchConfig
from engine.request import Request, RequestStatus
from engine.worker.model_runner import ModelRunner, ReasoningTokens

_IDLE_POLL_S = 0.002


class EngineCore:
    def __init__(
        self,
        config: EngineConfig,
        arch: ModelArchConfig,
        reasoning: ReasoningTokens | None = None,
        connector: KVConnectorBase | None = None,
    ) -> None:
        self.config = config
        self.arch = arch
        self.runner = ModelRunner(config, arch, reasoning or ReasoningTokens())
        self.runner.load_model()
        num_blocks = self.runner.determine_num_blocks()
        cache = replace(config.cache, num_blocks=num_blocks)
        if connector is None and config.kv_transfer is not None:
            connector = make_connector(config, arch)
        self.connector = connector
        # The scheduler refuses a pool too small for one max_model_len sequence.
        self.scheduler = Scheduler(config.scheduler, cache, connector)
        self.runner.connector = connector
        self.runner.initialize_kv_cache(num_blocks)
        self.num_blocks = num_blocks

    def add_request(self, request: Request) -> None:
        """Validate against the model, then queue. Raises ValueError on bad input."""
        vocab = self.arch.vocab_size
        bad = next((t for t in request.prompt_token_ids if t >= vocab), None)
        if bad is not None:
            raise ValueError(
                f"request {request.request_id!r}: token id {bad} is outside the "
                f"vocabulary (size {vocab})"
            )
        self.runner.validate_params(request.sampling_params)
        if request.kv_transfer_params:
            if self.connector is None:
                raise ValueError("kv_transfer_params need an engine with a kv_transfer_config")
            self.connector.validate_request(request)
        self.scheduler.add_request(request)

    def abort_requests(
        self, request_ids: Iterable[str], status: RequestStatus = RequestStatus.FINISHED_ABORTED
    ) -> None:
        ids = list(request_ids)
        if self.connector is not None:
            # A finished request whose blocks wait for a reader: the abort ends its lease.
            for request_id in ids:
                request = self.scheduler.requests.get(request_id)
                if request is not None and request.is_finished:
                    self.connector.cancel_request(request_id)
        self.scheduler.finish_requests(ids, status)

    def step(self) -> list[EngineCoreOutput]:
        scheduler_output = self.scheduler.schedule()
        runner_output = self.runner.execute_model(scheduler_output)
        if scheduler_output.total_num_scheduled_tokens == 0 and self._waiting_on_transfers():
            time.sleep(_IDLE_POLL_S)  # nothing to compute until a transfer moves: do not spin
        return self.scheduler.update_from_output(scheduler_output, runner_output)

    def has_requests(self) -> bool:
        return self.scheduler.has_requests() or self._waiting_on_transfers()

    def _waiting_on_transfers(self) -> bool:
        return self.connector is not None and self.connector.has_pending_transfers()

    def close(self) -> None:
        if self.connector is not None:
            self.connector.close()


def make_connector(config: EngineConfig, arch: ModelArchConfig) -> KVConnectorBase:
    from connector.metadata import compatibility_hash
    from connector.pd_connector import PDConnector

    kv = config.kv_transfer
    compat = compatibility_hash(
        model=arch.architecture,
        vocab_size=arch.vocab_size,
        hidden_size=arch.hidden_size,
        dtype=config.model.dtype,
        num_layers=arch.num_hidden_layers,
        num_kv_heads=arch.num_key_value_heads,
        head_dim=arch.head_dim,
        block_size=config.cache.block_size,
    )
    engine_id = kv.engine_id or f"engine-{uuid.uuid4().hex[:12]}"
    return PDConnector(kv, engine_id, compat, config.cache.block_size)
