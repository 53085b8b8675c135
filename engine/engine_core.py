"""EngineCore: the step loop (schedule -> execute -> update) over one model and one KV pool.

It is also the engine's facade: `LLM`, `AsyncEngine` and the Serve replica ask it what they
need (KV cache size, transport, failure injection for tests) instead of reaching into the
scheduler, the runner or the connector; its statistics come with each step's outputs.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import replace

from engine.config import EngineConfig
from engine.core.admission import QueueFull, check_admission, displaceable
from engine.core.kv_events import KVEventStream
from engine.core.sched_output import ModelRunnerOutput, SchedulerOutput
from engine.core.scheduler import Scheduler
from engine.inputs import InputProcessor, ReasoningTokens
from engine.kv_connector import KVConnectorBase, create_kv_connector
from engine.layers.quantized import quantizes_activations
from engine.models import ModelArchConfig
from engine.offload.stores import num_tier_slots
from engine.offload.tier_loans import load_for_loan
from engine.outputs import EngineCoreOutput, EngineCoreOutputs
from engine.parallel.rank0 import Rank0Runner
from engine.parallel.workers import start_followers
from engine.request import Request, RequestStatus
from engine.stats import EngineStats, scheduler_stats
from engine.step_timer import StepTimer
from engine.tokenizer import Tokenizer
from engine.worker.model_runner import ModelRunner

_IDLE_POLL_S = 0.002
# An engine whose KV pool is this full lends no prefix blocks (they would be kept from eviction).
_LEND_MAX_USAGE = 0.9


class EngineCore:
    def __init__(
        self,
        config: EngineConfig,
        arch: ModelArchConfig,
        reasoning: ReasoningTokens | None = None,
        connector: KVConnectorBase | None = None,
        tokenizer: Tokenizer | None = None,
    ) -> None:
        self.config = config
        self.displaced: list[str] = []  # refused for higher-priority requests (take_displaced)
        self.arch = arch
        self.followers = start_followers(config, arch)
        try:
            self._build(config, arch, reasoning, connector, tokenizer)
        except BaseException:
            if self.followers is not None:
                self.followers.close()
            raise
        # As of the last step (engine/stats.py): shipped with its outputs, read by anyone.
        self.stats: EngineStats = self._make_stats()

    def _build(
        self,
        config: EngineConfig,
        arch: ModelArchConfig,
        reasoning: ReasoningTokens | None,
        connector: KVConnectorBase | None,
        tokenizer: Tokenizer | None,
    ) -> None:
        """The runner, the KV pool and the scheduler (every rank's runner loaded first)."""
        reasoning = reasoning or ReasoningTokens()
        if self.followers is None:
            self.runner = ModelRunner(config, arch, reasoning, tokenizer)
        else:
            self.runner = Rank0Runner(config, arch, reasoning, tokenizer, self.followers)
        self.runner.load_model()
        num_blocks = self.runner.determine_num_blocks()
        cache = replace(config.cache, num_blocks=num_blocks)
        block_bytes = self.runner.kv_cache_spec().bytes_per_block
        if not self.runner.shares_kv_cache:  # a tier slot holds a block of every rank's cache
            block_bytes *= self.runner.layout.size
        if cache.kv_offloading_size:
            slots = num_tier_slots(cache, block_bytes, "kv_offloading_size")
            cache = replace(cache, num_tier_blocks=slots)
        if cache.kv_offloading_disk_size:
            slots = num_tier_slots(cache, block_bytes, "kv_offloading_disk_size")
            cache = replace(cache, num_disk_tier_blocks=slots)
        if connector is None and config.kv_transfer is not None:
            connector = create_kv_connector(config, arch)
        self.connector = connector
        # The scheduler refuses a pool too small for one max_model_len sequence.
        stepwise = quantizes_activations(self.runner.model) and not config.model.batch_invariant
        scheduling = replace(config.scheduler, stepwise_recompute=stepwise)
        self.scheduler = Scheduler(scheduling, cache, connector, config.speculative)
        self.runner.connector = connector
        self.runner.initialize_kv_cache(num_blocks)
        if cache.num_tier_blocks:
            self.runner.start_tier(cache)
        self.num_blocks = num_blocks
        self._async = AsyncRunner(self) if config.scheduler.async_scheduling else None
        # The prefix cache's events, numbered for a cluster index (kv_events_config).
        self.kv_events: KVEventStream | None = None
        if config.cache.enable_kv_cache_events:
            manager = self.scheduler.kv_cache_manager
            self.kv_events = KVEventStream(
                manager.block_pool.take_events,
                manager.cached_block_hashes,
                manager.tier_block_hashes,
            )

    @classmethod
    def from_inputs(
        cls, inputs: InputProcessor, connector: KVConnectorBase | None = None
    ) -> EngineCore:
        """The engine for a model whose inputs `inputs` processes (its configuration, its
        tokenizer's reasoning tokens)."""
        return cls(inputs.config, inputs.arch, inputs.reasoning_tokens, connector, inputs.tokenizer)

    # ------------------------------------------------------------------ requests

    def add_request(self, request: Request) -> None:
        """Validate against the model, then queue. Raises ValueError on bad input."""
        vocab = self.arch.vocab_size
        bad = next((t for t in request.all_token_ids if t >= vocab), None)
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
        bound = self.config.scheduler.max_queued_prompt_tokens
        try:
            check_admission(request, self.scheduler.requests.values(), bound)
        except QueueFull:
            victims = displaceable(request, self.scheduler.requests.values(), bound)
            if not victims:
                raise
            ids = [victim.request_id for victim in victims]
            self.scheduler.finish_requests(ids, RequestStatus.FINISHED_ABORTED)
            self.displaced.extend(ids)
        self.scheduler.add_request(request)

    def take_displaced(self) -> list[str]:
        """Requests refused since the last call to make room for higher-priority ones (their
        callers hear QueueFull, as if refused at admission)."""
        displaced, self.displaced = self.displaced, []
        return displaced

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

    def step(self) -> EngineCoreOutputs:
        """One step's outputs, and the engine's statistics after it. With async scheduling the
        step after it is scheduled and sent to the runner first, so it computes while this
        one's outputs are settled and handed out (`AsyncRunner`)."""
        outputs = self._async.step() if self._async is not None else self._step()
        return EngineCoreOutputs(outputs, self.refresh_stats())

    def refresh_stats(self) -> EngineStats:
        """The statistics again, where something happened between steps (engine thread)."""
        self.stats = self._make_stats()
        return self.stats

    def _make_stats(self) -> EngineStats:
        stats = scheduler_stats(self.scheduler)
        group = self.runner.group
        if group.size == 1:
            return stats
        return replace(
            stats, tensor_parallel_size=group.size, tp_collective_us=int(group.seconds * 1e6)
        )

    def _step(self) -> list[EngineCoreOutput]:
        timer = self.runner.step_timer
        if timer is not None:
            timer.start()
        scheduler_output = self.scheduler.schedule()
        if timer is not None:
            timer.mark("schedule")
        started = time.perf_counter()
        runner_output = self.runner.execute_model(scheduler_output)
        self._note_step_time(scheduler_output, time.perf_counter() - started)
        self._idle_wait(scheduler_output)
        if timer is not None:
            timer.mark("kv_connector")
        outputs = self.scheduler.update_from_output(scheduler_output, runner_output)
        if timer is not None:
            timer.end_step()
        return outputs

    def _note_step_time(self, scheduler_output: SchedulerOutput, seconds: float) -> None:
        """The tier's swap-or-recompute choice weighs a step's time per token (synchronous
        steps only: with async scheduling a step's time overlaps the next one's schedule)."""
        tier = self.scheduler.tier
        if tier is not None:
            tier.costs.note_step(scheduler_output.total_num_scheduled_tokens, seconds)

    def _idle_wait(self, scheduler_output: SchedulerOutput) -> None:
        if scheduler_output.total_num_scheduled_tokens == 0 and self._waiting_on_transfers():
            time.sleep(_IDLE_POLL_S)  # nothing to compute until a transfer moves: do not spin

    def time_steps(self, timer: StepTimer | None) -> None:
        """Measure where each step's time goes into `timer` (None: stop measuring). Phases
        are marked in step order: steps run synchronously while measured."""
        self.set_async_scheduling(timer is None and self.config.scheduler.async_scheduling)
        self.runner.step_timer = timer

    @property
    def async_scheduling(self) -> bool:
        return self._async is not None

    def set_async_scheduling(self, on: bool) -> None:
        """Switch step modes on an idle engine (benchmarks compare both on one engine)."""
        if on == (self._async is not None):
            return
        if self.has_requests():
            raise RuntimeError("async scheduling can only be switched on an idle engine")
        if self._async is not None:
            self._async.close()
        self._async = AsyncRunner(self) if on else None

    def has_requests(self) -> bool:
        """Anything to step for: requests, outputs not handed out, transfers in flight, a
        step in flight."""
        return self.scheduler.has_requests() or self._waiting_on_transfers() or self.step_in_flight

    def seconds_to_pin_expiry(self) -> float | None:
        """When an idle engine must step again to release an expired pin (None: no pin)."""
        return self.scheduler.pins.seconds_to_expiry()

    def expire_pins(self) -> None:
        """Release pins past their TTL now (an idle engine's; a step does it too)."""
        self.scheduler.pins.expire()

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    @property
    def step_in_flight(self) -> bool:
        """Async scheduling: a step was scheduled ahead; the next step() settles it."""
        return self._async is not None and self._async.in_flight

    def _waiting_on_transfers(self) -> bool:
        """Copies in flight: a connector's transfers, or the KV tier's (blocks held for them
        are let go of only when a step hears they are done)."""
        tier = self.scheduler.tier
        if tier is not None and tier.busy:
            return True
        return self.connector is not None and self.connector.has_pending_transfers()

    # ------------------------------------------------------------------ what callers ask

    @property
    def supports_kv_transfer(self) -> bool:
        return self.connector is not None

    @property
    def kv_transport(self) -> str:
        """The KV transport's name ("nixl", "grpc"), "" without KV transfer."""
        kv = self.config.kv_transfer
        return kv.connector if kv is not None else ""

    @property
    def kv_tier(self) -> str:
        """The KV tier below the pool ("cpu", "disk"), "" without one."""
        tier = self.scheduler.tier
        return tier.name if tier is not None else ""

    @property
    def side_channel_port(self) -> int | None:
        return self.connector.side_channel_port if self.connector is not None else None

    @property
    def kv_compat_hash(self) -> str:
        """The KV compatibility hash the handshake compares ("" without KV transfer)."""
        return self.connector.compat_hash if self.connector is not None else ""

    @property
    def side_channel(self) -> str:
        """ "host:port" where other engines read this one's KV and borrow its prefixes ("" with
        no side channel)."""
        kv, port = self.config.kv_transfer, self.side_channel_port
        return f"{kv.side_channel_host}:{port}" if kv is not None and port else ""

    @property
    def num_kv_blocks(self) -> int:
        """Usable KV blocks (block 0 is the null block)."""
        return self.num_blocks - 1

    @property
    def kv_block_bytes(self) -> int:
        """Bytes of one block, all layers, K and V, of each head once (where ranks keep caches
        of their own, summed over them): what a transfer between engines of one layout moves
        per block (a staged read of a larger remote shard moves more)."""
        per_heads: dict[tuple[int, int], int] = {}
        for shard in self.runner.kv_shards:
            per_heads.setdefault((shard.first_head, shard.num_heads), shard.cache[0].nbytes)
        return sum(per_heads.values())

    def pin_prefix(self, block_hashes: list[bytes], lease_request_id: str) -> list[int]:
        """Lend the cached blocks of the hashes' leading run (the connector leases them under
        `lease_request_id`; its end frees them), the pool's and then its tier's (copied back
        and verified first: offload/tier_loans.py). Engine thread only. Nothing while a step is
        in flight (blocks it caches may not hold their KV yet), nor while the pool is nearly
        full or half of it is lent already: loans must not cost this engine's own requests."""
        manager = self.scheduler.kv_cache_manager
        if self.step_in_flight or manager.usage >= _LEND_MAX_USAGE:
            return []
        if manager.num_lent_blocks + len(block_hashes) > self.num_kv_blocks // 2:
            return []
        blocks = manager.lend_prefix(block_hashes, lease_request_id)
        tier, worker = self.scheduler.tier, self.runner.tier
        if tier is not None and worker is not None and len(blocks) < len(block_hashes):
            pool = manager.block_pool
            loaded = load_for_loan(tier, worker, pool, block_hashes, len(blocks), lease_request_id)
            manager.extend_loan(lease_request_id, loaded)
            blocks = [*blocks, *loaded]
        return [block.block_id for block in blocks]

    def kv_transfer_stats(self) -> dict[str, int]:
        """The connector's counters (loads and blocks requested, blocks read, reads failed,
        releases); empty without KV transfer."""
        return dict(self.connector.stats) if self.connector is not None else {}

    def tensor_parallel_failure(self) -> str | None:
        """Why a rank of this engine failed (None: none did, or one rank only)."""
        return self.followers.failure() if self.followers is not None else None

    def rank_pids(self) -> list[int]:
        """The processes of ranks 1..n-1 (tensor parallelism; none at one rank)."""
        return self.followers.pids if self.followers is not None else []

    def inject_kv_load_failure(self, after: int) -> None:
        """Tests: the next KV load of this engine fails part-way (ValueError if it cannot)."""
        if self.connector is None:
            raise ValueError("this engine has no KV connector")
        self.connector.inject_load_failure(after)

    def close(self) -> None:
        if self._async is not None:
            self._async.close()
        if self.runner.tier is not None:
            self.runner.tier.close()
        if self.connector is not None:
            self.connector.close()
        if self.followers is not None:
            self.followers.close()


class AsyncRunner:
    """Async scheduling: the model runner works in a thread of its own, one step behind the
    scheduler.

    Each `step()` sends step N+1 to the runner before it waits for step N, so the runner goes
    from one forward pass straight into the next while this thread settles step N's outputs,
    hands them out and takes new requests and aborts. Step N+1 is scheduled without N's
    samples: each request that N makes sample owes a placeholder (`num_output_placeholders`),
    which the scheduler counts as a token, and the runner, which runs the steps in order,
    already holds the sample when N+1 reads its inputs. Outputs are those of synchronous
    scheduling, token for token: samples depend on (seed, output position), never on the
    step. The scheduler declines to run ahead where a step's outputs decide the next one
    (`Scheduler.may_schedule_ahead`); then a step is synchronous.

    Blocks freed while a step is in flight (an abort, a stop) may be handed to a request of
    the next step: the runner writes into them only after the step in flight is done.
    """

    def __init__(self, core: EngineCore) -> None:
        self._core = core
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pdserve-runner")
        self._pending: tuple[SchedulerOutput, Future[ModelRunnerOutput]] | None = None

    @property
    def in_flight(self) -> bool:
        """A step scheduled ahead is with the runner."""
        return self._pending is not None

    def step(self) -> list[EngineCoreOutput]:
        scheduler = self._core.scheduler
        pending = self._pending or self._schedule()
        self._pending = None
        scheduler_output, future = pending
        if scheduler_output.total_num_scheduled_tokens and scheduler.may_schedule_ahead():
            self._pending = self._schedule()
        try:
            runner_output = future.result()
        except BaseException:
            self._drop_pending()  # built on a step that failed: the engine is done for
            raise
        self._core._idle_wait(scheduler_output)
        return scheduler.update_from_output(scheduler_output, runner_output)

    def _schedule(self) -> tuple[SchedulerOutput, Future[ModelRunnerOutput]]:
        scheduler_output = self._core.scheduler.schedule()
        return scheduler_output, self._pool.submit(
            self._core.runner.execute_model, scheduler_output
        )

    def _drop_pending(self) -> None:
        pending, self._pending = self._pending, None
        if pending is not None and not pending[1].cancel():
            pending[1].exception()  # wait for it to stop; its own failure is the same story

    def close(self) -> None:
        self._pool.shutdown(wait=True)
