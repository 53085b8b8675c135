"""One engine per Serve replica: the async engine with its KV connector, spoken to in tokens.

The router tokenizes and detokenizes (once, for both legs of a disaggregated request); an
engine replica only sees token ids and streams back token ids. `EngineRequest` and
`EngineChunk` are what travels between the router and the replicas (pickled by Ray).
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import AsyncGenerator
from dataclasses import dataclass
from typing import Any

from deployments.telemetry import (
    EngineMetrics,
    Tracing,
    record_engine_spans,
    request_attributes,
)
from engine.async_engine import AsyncEngine
from engine.core.sched_output import TokenLogprobs
from engine.outputs import RequestOutput
from engine.request import RequestTiming, SamplingParams

logger = logging.getLogger(__name__)


@dataclass
class EngineRequest:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    priority: int = 0
    cache_salt: str | None = None
    kv_transfer_params: dict[str, Any] | None = None
    trace_context: dict[str, str] | None = None  # W3C carrier: the router's span


@dataclass
class EngineChunk:
    """What one engine step added to a request."""

    new_token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    kv_transfer_params: dict[str, Any] | None = None
    num_cached_tokens: int = 0
    error: str | None = None
    new_logprobs: list[TokenLogprobs] | None = None
    timing: RequestTiming | None = None  # the last chunk only

    @classmethod
    def from_output(cls, output: RequestOutput) -> EngineChunk:
        completion = output.outputs[0]
        return cls(
            new_token_ids=list(completion.new_token_ids),
            finish_reason=completion.finish_reason,
            stop_reason=completion.stop_reason,
            kv_transfer_params=output.kv_transfer_params,
            num_cached_tokens=output.num_cached_tokens,
            error=output.error,
            new_logprobs=completion.new_logprobs,
            timing=output.timing,
        )


def node_ip() -> str:
    """This node's address as other nodes reach it (the side channel advertises it)."""
    try:
        import ray

        return str(ray.util.get_node_ip_address())
    except Exception:  # not inside Ray: a local engine
        return "127.0.0.1"


class EngineServer:
    """The body of PrefillServer, DecodeServer and the colocated EngineServer deployment.

    Every engine can produce and consume KV; the role only names the replica in stats and
    decides nothing else (the router decides which kv_transfer_params each leg gets).
    """

    role = "colocated"

    def __init__(
        self,
        model: str,
        engine_args: dict[str, Any],
        kv_transfer_config: dict[str, Any] | None = None,
        otlp_endpoint: str = "",
    ) -> None:
        kv = dict(kv_transfer_config) if kv_transfer_config else None
        if kv is not None:
            kv.setdefault("side_channel_host", node_ip())
            kv.setdefault("side_channel_port", 0)
        self.engine = AsyncEngine(model, **engine_args, kv_transfer_config=kv)
        self.model_name = model
        self.transport = kv["connector"] if kv else ""
        kv_cache = self.engine.core.runner.kv_cache
        self.block_bytes = kv_cache[0].nbytes if kv_cache is not None else 0
        self.replica_id = replica_name()
        self.tracing = Tracing(self.role, self.replica_id, otlp_endpoint)
        self.metrics = _engine_metrics()
        self._sampler = _start_sampler(self) if self.metrics is not None else None
        logger.info(
            "%s engine %s ready (%d KV blocks)", self.role, self.replica_id, self.num_blocks
        )

    @property
    def num_blocks(self) -> int:
        return self.engine.core.num_blocks - 1  # block 0 is the null block

    async def generate(self, request: EngineRequest) -> AsyncGenerator[EngineChunk, None]:
        """Stream a request's tokens. Bad input raises ValueError before anything runs; a
        caller that stops listening (cancelled by Serve) aborts the request."""
        async for output in self.engine.generate(
            request.prompt_token_ids,
            request.params,
            request.request_id,
            priority=request.priority,
            cache_salt=request.cache_salt,
            kv_transfer_params=request.kv_transfer_params,
            coalesce=True,  # a router that falls behind gets tokens in batches, not one by one
        ):
            chunk = EngineChunk.from_output(output)
            if chunk.timing is not None:
                self._observe(request, chunk, chunk.timing, len(output.outputs[0].token_ids))
            yield chunk

    def _observe(
        self, request: EngineRequest, chunk: EngineChunk, timing: RequestTiming, num_output: int
    ) -> None:
        """A finished request: its spans (with the engine's own timestamps) and metrics."""
        if self.metrics is not None:
            self.metrics.observe_transfer(timing, self.transport, self.block_bytes)
        if not self.tracing.enabled or not request.trace_context:
            return
        attributes = {
            **request_attributes(self.model_name, request.params),
            "gen_ai.usage.input_tokens": len(request.prompt_token_ids),
            "gen_ai.usage.output_tokens": num_output,
            "gen_ai.response.finish_reasons": [chunk.finish_reason or ""],
            "pdserve.cached_tokens": chunk.num_cached_tokens,
            "pdserve.replica_id": self.replica_id,
        }
        kv = {"transport": self.transport, "block_bytes": self.block_bytes}
        record_engine_spans(
            self.tracing.tracer,
            self.role,
            request.trace_context,
            timing,
            attributes,
            error=chunk.error,
            kv=kv,
        )

    def inject_kv_failure(self, after_descriptors: int = 0) -> None:
        """Tests: the next KV read of this engine fails part-way (NIXL transport only)."""
        connector = self.engine.core.connector
        transport = getattr(getattr(connector, "worker", None), "transport", None)
        inject = getattr(transport, "inject_failure", None)
        if inject is None:
            raise ValueError("this engine's transport cannot inject failures (NIXL only)")
        inject(after_descriptors)

    def sample_metrics(self) -> None:
        if self.metrics is None:
            return
        scheduler = self.engine.core.scheduler
        prefix = scheduler.kv_cache_manager.take_prefix_cache_stats()
        self.metrics.sample(self.stats(), prefix, scheduler.num_preemptions)

    def stats(self) -> dict[str, Any]:
        """KV blocks and queues, read from the loop thread's state (a snapshot, may lag a step)."""
        scheduler = self.engine.core.scheduler
        pool = scheduler.kv_cache_manager.block_pool
        free = pool.get_num_free_blocks()
        unfinished = scheduler.get_num_unfinished_requests()
        return {
            "role": self.role,
            "replica_id": self.replica_id,
            "num_blocks": self.num_blocks,
            "num_free_blocks": free,
            "num_running": len(scheduler.running),
            "num_waiting": unfinished - len(scheduler.running),
            "num_held_requests": max(0, len(scheduler.requests) - unfinished),
            "kv_cache_usage": 1.0 - free / max(1, self.num_blocks),
        }

    def check_health(self) -> None:
        """Serve's health probe: a dead engine loop restarts the replica."""
        if self.engine.dead is not None:
            raise RuntimeError(f"engine loop has stopped: {self.engine.dead}")

    def __del__(self) -> None:
        # Serve calls this on a graceful replica shutdown: stop the loop, then the side channel.
        sampler = getattr(self, "_sampler", None)
        if sampler is not None:
            sampler.set()
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.shutdown()
            engine.core.close()
        tracing = getattr(self, "tracing", None)
        if tracing is not None:
            tracing.shutdown()


def _engine_metrics() -> EngineMetrics | None:
    """Serve metrics inside a replica; None elsewhere (an engine embedded in a test)."""
    return EngineMetrics() if serve_replica_id() is not None else None


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


def serve_replica_id() -> str | None:
    """This Serve replica's id; None outside a replica (tests, local use)."""
    try:
        from ray import serve

        return str(serve.get_replica_context().replica_id.unique_id)
    except Exception:
        return None


def replica_name() -> str:
    """The replica id, or the process id where there is no replica (names spans and stats)."""
    return serve_replica_id() or f"pid-{os.getpid()}"
