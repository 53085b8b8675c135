"""EngineCore: the step loop (schedule -> execute -> update) over one model and one KV pool."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import replace

from connector.base import KVConnectorBase
from engine.config import EngineConfig
from engine.core.sched_output import EngineCoreOutput
from engine.core.scheduler import Scheduler
from engine.models import ModelArchConfig
from engine.request import Request, RequestStatus
from engine.worker.model_runner import ModelRunner, ReasoningTokens


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
        # The scheduler refuses a pool too small for one max_model_len sequence.
        self.scheduler = Scheduler(config.scheduler, cache, connector)
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
        self.scheduler.add_request(request)

    def abort_requests(
        self, request_ids: Iterable[str], status: RequestStatus = RequestStatus.FINISHED_ABORTED
    ) -> None:
        self.scheduler.finish_requests(list(request_ids), status)

    def step(self) -> list[EngineCoreOutput]:
        scheduler_output = self.scheduler.schedule()
        runner_output = self.runner.execute_model(scheduler_output)
        return self.scheduler.update_from_output(scheduler_output, runner_output)

    def has_requests(self) -> bool:
        return self.scheduler.has_requests()
