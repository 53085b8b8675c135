"""One engine per Serve replica: the async engine with its KV connector, spoken to in tokens.

The router tokenizes and detokenizes (once, for both legs of a disaggregated request); an
engine replica only sees token ids and streams back token ids: an `EngineRequest` in
(deployments/protocol.py), `EngineCoreOutput`s out (engine/outputs.py), pickled by Ray.

PrefillServer, DecodeServer and ColocatedServer are this one class under three names: every
engine can produce and consume KV, and the role only names the replica in stats and traces.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import threading
from collections.abc import AsyncGenerator
from contextlib import aclosing
from typing import Any

import torch
from ray import serve

from deployments.cluster.request_routers import KV_COMPAT_HASH
from deployments.cluster.role_balance import RoleSwitching
from deployments.cluster.sla_autoscaling import DEFAULT_LOOK_BACK_S, RecentLatencies
from deployments.credentials import kv_secret
from deployments.protocol import EngineRequest, ReplicaProbe
from deployments.replica.core_pinning import (
    CoreClaim,
    pin_process_threads,
    place_engine,
    rank_0_cores,
)
from deployments.replica.kv_publisher import KVEventPublisher, ReplicaSignals
from deployments.replica.role_switch import RoleState, SwitchReport, moved_output, wait_switched
from deployments.replica.telemetry import EngineMetrics, record_engine_spans
from deployments.serve_context import replica_name, serve_replica_id
from deployments.telemetry import Tracing, request_attributes
from engine.async_engine import AsyncEngine
from engine.models.catalog import resolve_model
from engine.models.quantized_loading import auto_keeps_blocks
from engine.outputs import EngineCoreOutput
from engine.parallel.workers import TensorParallelError
from engine.request import RequestTiming

logger = logging.getLogger(__name__)


def node_ip() -> str:
    """This node's address as other nodes reach it (the side channel advertises it)."""
    try:
        import ray

        return str(ray.util.get_node_ip_address())
    except Exception:  # not inside Ray: a local engine
        return "127.0.0.1"


class EngineServer:
    """The body of the prefill, decode and colocated engine deployments."""

    role = "colocated"

    def __init__(
        self,
        model: str,
        engine_args: dict[str, Any],
        kv_transfer_config: dict[str, Any] | None = None,
        otlp_endpoint: str = "",
        pin_cores: bool = False,
        latency_window_s: float = DEFAULT_LOOK_BACK_S,
        role_switching: dict[str, Any] | None = None,
    ) -> None:
        # Before the engine exists: its threads and first-touched memory start on its cores.
        self._cores = _place(engine_args) if pin_cores else None
        kv = dict(kv_transfer_config) if kv_transfer_config else None
        if kv is not None:
            kv.setdefault("side_channel_host", node_ip())
            kv.setdefault("side_channel_port", 0)
            kv["secret"] = kv_secret(kv.get("secret", ""))
        engine_args = self.role_engine_args(model, engine_args)
        self.engine = AsyncEngine(model, **engine_args, kv_transfer_config=kv)
        self.engine.on_death = _exit_when_a_rank_died
        if self._cores is not None:
            _keep_rank_0_to_its_cores(self._cores, self.engine.core.rank_pids())
        core = self.engine.core
        self.model_name = model
        self.transport = core.kv_transport
        self.block_bytes = core.kv_block_bytes
        self.replica_id = replica_name()
        self.tracing = Tracing(self.role, self.replica_id, otlp_endpoint)
        self.metrics = _engine_metrics(self.transport, core.kv_tier)
        self._latencies = RecentLatencies(latency_window_s)
        self._sampler = _start_sampler(self) if self.metrics is not None else None
        self._lease_s = float((kv or {}).get("lease_seconds", 30.0))
        self.roles = RoleState(
            self.role, _drain_timeout_s(role_switching), enabled=role_switching is not None
        )
        signals = ReplicaSignals(self._latencies.with_means, role_switching, self._ordered)
        self._kv_publisher = _start_kv_publisher(self.engine, self.role, signals)
        if self._kv_publisher is not None:
            self.roles.announce = self._kv_publisher.announce_role
        logger.info(
            "%s engine %s ready (%d KV blocks)", self.role, self.replica_id, core.num_kv_blocks
        )

    @staticmethod
    def role_engine_args(model: str, engine_args: dict[str, Any]) -> dict[str, Any]:
        """The engine arguments this role runs with (the prefill role adjusts them)."""
        return engine_args

    async def generate(self, request: EngineRequest) -> AsyncGenerator[EngineCoreOutput, None]:
        """Stream a request's token ids. Bad input raises ValueError before anything runs; a
        caller that stops listening (cancelled by Serve) aborts the request."""
        num_output = 0
        key = self.roles.admit()
        try:
            async with aclosing(self._generate(request)) as outputs:
                async for output in outputs:
                    num_output += len(output.new_token_ids)
                    if output.timing is not None:
                        self._observe(request, output, output.timing, num_output)
                    yield output
                    if not output.finished and self.roles.must_move(key):
                        yield moved_output(output.request_id)  # closing aborts it here
                        return
        finally:
            self.roles.finish(key)

    async def switch_role(self, probe: ReplicaProbe | None, role: str) -> dict[str, Any]:
        """Take `role` ("prefill" or "decode") now, and return once the old role's requests
        have drained or moved and its handed-off KV is read (role_switch.py); ValueError for
        a role this replica cannot take. `probe` only steers the call to this replica (the
        request routers read a hint from the first argument, as for `stats`)."""
        previous = self.roles.role
        epoch = self.roles.switch(role)
        logger.info("engine %s: %s -> %s (epoch %d)", self.replica_id, previous, role, epoch)
        report = SwitchReport(role, previous, epoch)
        held = self._held_requests
        return await wait_switched(self.roles, report, held, self._lease_s)

    def _held_requests(self) -> int:
        return int(self.engine.stats.num_held_requests)

    def _ordered(self, role: str) -> None:
        """The KV index ordered a switch (the KV publisher's thread): take the role now; the
        drain runs on without anyone waiting on it."""
        try:
            epoch = self.roles.switch(role)
        except ValueError as exc:
            logger.warning("engine %s refused a switch to %s: %s", self.replica_id, role, exc)
            return
        logger.info("engine %s took the %s role (epoch %d)", self.replica_id, role, epoch)

    def _generate(self, request: EngineRequest) -> AsyncGenerator[EngineCoreOutput, None]:
        return self.engine.generate_tokens(
            request.prompt_token_ids,
            request.params,
            request.request_id,
            priority=request.priority,
            cache_salt=request.cache_salt,
            kv_transfer_params=request.kv_transfer_params,
            output_token_ids=request.output_token_ids,
            pin=request.pin,
            coalesce=True,  # a router that falls behind gets tokens in batches, not one by one
        )

    def record_replica_metadata(self) -> dict[str, str]:
        """Serve's static replica metadata, given to every request router once the replica is
        ready: its KV compatibility hash (request_routers.KV_COMPAT_HASH), so that decode
        requests go only to engines that can read the KV they bring."""
        return {KV_COMPAT_HASH: self.engine.core.kv_compat_hash}

    def record_autoscaling_stats(self) -> dict[str, float]:
        """Serve's custom autoscaling metrics hook: what deployments/cluster/sla_autoscaling.py
        scales on (TTFT and TPOT over its look-back period, where requests finished in it)."""
        stats = self.engine.stats
        return {
            "queued_prompt_tokens": float(stats.queued_prompt_tokens),
            "kv_cache_usage": stats.kv_cache_usage,
            "running_requests": float(stats.num_running),
            **self._latencies.means(),
        }

    def _observe(
        self,
        request: EngineRequest,
        output: EngineCoreOutput,
        timing: RequestTiming,
        num_output: int,
    ) -> None:
        """A finished request: its spans (with the engine's own timestamps) and metrics."""
        ttft = tpot = None
        if timing.first_token is not None:
            ttft = timing.first_token - timing.arrival
            if timing.finished is not None and num_output > 1:
                tpot = (timing.finished - timing.first_token) / (num_output - 1)
        self._latencies.observe(ttft, tpot)
        if self.metrics is not None:
            self.metrics.observe_transfer(timing, self.transport, self.block_bytes)
        if not self.tracing.enabled or not request.trace_context:
            return
        attributes = {
            **request_attributes(self.model_name, request.params),
            "gen_ai.usage.input_tokens": len(request.prompt_token_ids),
            "gen_ai.usage.output_tokens": num_output,
            "gen_ai.response.finish_reasons": [output.finish_reason or ""],
            "pdserve.cached_tokens": output.num_cached_tokens,
            "pdserve.replica_id": self.replica_id,
        }
        kv = {"transport": self.transport, "block_bytes": self.block_bytes}
        record_engine_spans(
            self.tracing.tracer,
            self.roles.role,  # the role it has now (it may have switched: role_switch.py)
            request.trace_context,
            timing,
            attributes,
            error=output.error,
            kv=kv,
        )

    def inject_kv_failure(self, after: int = 0) -> None:
        """Tests: the next KV read of this engine fails part-way (ValueError if it cannot)."""
        self.engine.core.inject_kv_load_failure(after)

    def sample_metrics(self) -> None:
        if self.metrics is not None:
            self.metrics.sample(self.engine.stats)

    def stats(self, probe: ReplicaProbe | None = None) -> dict[str, Any]:
        """KV blocks and queues (pdserve.v1.EngineStats), a snapshot that may lag a step.
        `probe` only steers the call to this replica (deployments/cluster/health.py)."""
        return {
            "role": self.roles.role,
            "role_epoch": self.roles.epoch,
            "moved_requests": self.roles.moved,
            "replica_id": self.replica_id,
            **self.engine.stats.health(),
        }

    async def step_trace(
        self,
        probe: ReplicaProbe | None = None,
        max_steps: int = 0,
        keep_steps: int = 0,
        max_bytes: int = 0,
    ) -> dict[str, Any]:
        """The scheduler's newest `max_steps` step records (0: all kept), each a JSON line,
        the oldest left out past `max_bytes` (0: no bound; `left_out` counts them);
        `keep_steps` as AsyncEngine.step_trace. Where it keeps none, `error` says so."""
        answer: dict[str, Any] = {"role": self.roles.role, "replica_id": self.replica_id}
        try:
            records = await asyncio.wrap_future(self.engine.step_trace(keep_steps))
        except ValueError as exc:
            return {**answer, "records": [], "left_out": 0, "error": str(exc)}
        kept = records[-max_steps:] if max_steps else records
        # Encoding a whole ring takes a while: not on the loop that streams tokens.
        lines, left_out = await asyncio.to_thread(_newest_lines, kept, max_bytes)
        return {**answer, "records": lines, "left_out": left_out}

    def rank_pids(self) -> list[int]:
        """The processes of this replica's other tensor-parallel ranks (none at one rank)."""
        return self.engine.core.rank_pids()

    def check_health(self) -> None:
        """Serve's health probe: a dead engine loop restarts the replica."""
        if self.engine.dead is not None:
            raise RuntimeError(f"engine loop has stopped: {self.engine.dead}")
        # A rank that died while the engine had nothing to do: no step has failed yet.
        failure = self.engine.core.tensor_parallel_failure()
        if failure is not None:
            raise RuntimeError(failure)

    def __del__(self) -> None:
        # Serve calls this on a graceful replica shutdown: stop the loop, then the side channel.
        # Each part may be missing (a constructor that failed half-way).
        for part, stop in (
            ("_sampler", "set"),
            ("_kv_publisher", "stop"),
            ("engine", "shutdown"),
            ("tracing", "shutdown"),
            ("_cores", "release"),
        ):
            held = getattr(self, part, None)
            if held is not None:
                getattr(held, stop)()


def _exit_when_a_rank_died(failure: BaseException) -> None:
    """A tensor-parallel rank of this replica died: the replica cannot compute again, so its
    process ends now, as a SIGKILLed replica's would. Serve sees the actor gone at once (not
    at its next health check) and replaces it, and the Router moves the requests it was
    serving (deployments/router/migration.py) instead of sending them back here."""
    if isinstance(failure, TensorParallelError):
        logger.error("a tensor-parallel rank of this replica failed (%s): it exits", failure)
        logging.shutdown()
        os._exit(1)


def _newest_lines(records: list[dict[str, Any]], max_bytes: int) -> tuple[list[str], int]:
    """`records` as JSON lines, the newest that fit `max_bytes` (0: all); how many did not."""
    lines: list[str] = []
    size = 0
    for record in reversed(records):
        line = json.dumps(record, separators=(",", ":"))
        size += len(line)
        if max_bytes and size > max_bytes:
            break
        lines.append(line)
    lines.reverse()
    return lines, len(records) - len(lines)


def _engine_metrics(transport: str, tier: str) -> EngineMetrics | None:
    """Metrics inside a Serve replica; None elsewhere (an engine embedded in a test)."""
    return EngineMetrics(transport, tier=tier) if serve_replica_id() is not None else None


def _start_sampler(server: EngineServer, period_s: float = 1.0) -> threading.Event:
    """A daemon thread setting the gauges every `period_s`; set the event to stop it."""
    stop = threading.Event()

    def run() -> None:
        while not stop.wait(period_s):
            try:
                server.sample_metrics()
            except Exception:  # metrics must never take the engine down
                logger.exception("sampling engine metrics")

    threading.Thread(target=run, name="engine-metrics", daemon=True).start()
    return stop


def _keep_rank_0_to_its_cores(claim: CoreClaim, followers: list[int]) -> None:
    """A replica of several ranks claimed the cores of all of them; its followers pinned
    themselves to the last ones (engine/parallel/workers.py). This process, rank 0, keeps to
    the first share, so that no rank's threads run where another rank computes."""
    if not followers:
        return
    share = rank_0_cores(claim.cores, len(followers) + 1)
    if share:
        pin_process_threads(share)
        logger.info("tensor-parallel rank 0 pinned to cores %s", list(share))


def _on_cpu(engine_args: dict[str, Any]) -> bool:
    device = engine_args.get("device", "auto")
    return device == "cpu" or (device == "auto" and not torch.cuda.is_available())


def _place(engine_args: dict[str, Any]) -> CoreClaim | None:
    """Inside a Serve replica on a CPU: threads = its CPUs, pinned to cores of its own
    (deployments/replica/core_pinning.py; the claim, to keep while the replica lives). GPU
    engines are placed by their GPU, as Ray assigns it."""
    if serve_replica_id() is None or not _on_cpu(engine_args):
        return None
    import ray

    num_cpus = ray.get_runtime_context().get_assigned_resources().get("CPU", 0.0)
    # A replica of several ranks holds a bundle per rank (deployments/app.py): it claims the
    # cores of all of them, and its ranks split them (engine/parallel/workers.py).
    ranks = int(engine_args.get("tensor_parallel_size", 1))
    return place_engine(num_cpus * ranks)[1]


def _drain_timeout_s(role_switching: dict[str, Any] | None) -> float:
    if not role_switching:
        return RoleSwitching().drain_timeout_s
    return RoleSwitching.from_spec(role_switching).drain_timeout_s


def _start_kv_publisher(
    engine: AsyncEngine, role: str, signals: ReplicaSignals
) -> KVEventPublisher | None:
    """Inside a Serve replica whose engine numbers its KV events: publish them to the app's
    index (the KV-aware request routers read it)."""
    replica_id = serve_replica_id()
    core = engine.core
    if replica_id is None or core.kv_events is None:
        return None
    app = serve.get_replica_context().app_name
    return KVEventPublisher(engine, replica_id, app, role, core.side_channel, signals=signals)


class PrefillServer(EngineServer):
    """Runs prompts (max_tokens=1) and holds their KV blocks for a decode replica."""

    role = "prefill"

    @staticmethod
    def role_engine_args(model: str, engine_args: dict[str, Any]) -> dict[str, Any]:
        """On CPUs a prefill-only engine packs its float32 linears for oneDNN, whose GEMM runs
        long prompts ~1.3x faster than the decode-tuned blocked kernel `auto` picks (and it
        never takes the fused decode step). A GGUF file's quantized blocks stay what `auto`
        makes of them: faster still (SmolLM2 Q4_1, 8 x 512 tokens: 1,043 tokens/s against
        oneDNN's 705), and the decode replicas compute the same KV. An explicit
        `linear_backend` wins."""
        if engine_args.get("linear_backend", "auto") != "auto":
            return engine_args
        if not _on_cpu(engine_args) or not torch.backends.mkldnn.is_available():
            return engine_args
        float32 = engine_args.get("dtype", "auto") in ("auto", "float32")  # auto: float32 here
        if auto_keeps_blocks(str(resolve_model(model)), "cpu", float32):
            return engine_args
        return {**engine_args, "linear_backend": "onednn"}


class DecodeServer(EngineServer):
    """Reads a prompt's KV from a prefill replica, then generates the rest."""

    role = "decode"


class ColocatedServer(EngineServer):
    """One engine doing both (the colocated mode, for comparison)."""

    role = "colocated"


PrefillDeployment = serve.deployment(name="PrefillServer")(PrefillServer)
DecodeDeployment = serve.deployment(name="DecodeServer")(DecodeServer)
ColocatedDeployment = serve.deployment(name="EngineServer")(ColocatedServer)
