"""One engine per Serve replica: the async engine with its KV connector, spoken to in tokens.

The router tokenizes and detokenizes (once, for both legs of a disaggregated request); an
engine replica only sees token ids and streams back token ids. `EngineRequest` and
`EngineChunk` are what travels between the router and the replicas (pickled by Ray).
"""

from __future__ import annotations

import logging
import os
from collections.abc import AsyncGenerator
from dataclasses import dataclass
from typing import Any

from engine.async_engine import AsyncEngine
from engine.core.sched_output import TokenLogprobs
from engine.outputs import RequestOutput
from engine.request import SamplingParams

logger = logging.getLogger(__name__)


@dataclass
class EngineRequest:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    priority: int = 0
    cache_salt: str | None = None
    kv_transfer_params: dict[str, Any] | None = None


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

    @classmethod
    def from_output(cls, output: RequestOutput, num_logprobs_seen: int) -> EngineChunk:
        completion = output.outputs[0]
        logprobs = None
        if completion.logprobs is not None:
            logprobs = completion.logprobs[num_logprobs_seen:]
        return cls(
            new_token_ids=list(completion.new_token_ids),
            finish_reason=completion.finish_reason,
            stop_reason=completion.stop_reason,
            kv_transfer_params=output.kv_transfer_params,
            num_cached_tokens=output.num_cached_tokens,
            error=output.error,
            new_logprobs=logprobs,
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
    ) -> None:
        kv = dict(kv_transfer_config) if kv_transfer_config else None
        if kv is not None:
            kv.setdefault("side_channel_host", node_ip())
            kv.setdefault("side_channel_port", 0)
        self.engine = AsyncEngine(model, **engine_args, kv_transfer_config=kv)
        self.replica_id = _replica_id()
        logger.info(
            "%s engine %s ready (%d KV blocks)", self.role, self.replica_id, self.num_blocks
        )

    @property
    def num_blocks(self) -> int:
        return self.engine.core.num_blocks - 1  # block 0 is the null block

    async def generate(self, request: EngineRequest) -> AsyncGenerator[EngineChunk, None]:
        """Stream a request's tokens. Bad input raises ValueError before anything runs; a
        caller that stops listening (cancelled by Serve) aborts the request."""
        seen = 0
        async for output in self.engine.generate(
            request.prompt_token_ids,
            request.params,
            request.request_id,
            priority=request.priority,
            cache_salt=request.cache_salt,
            kv_transfer_params=request.kv_transfer_params,
        ):
            chunk = EngineChunk.from_output(output, seen)
            seen += len(chunk.new_logprobs or ())
            yield chunk

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
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.shutdown()
            engine.core.close()


def _replica_id() -> str:
    try:
        from ray import serve

        return str(serve.get_replica_context().replica_id.unique_id)
    except Exception:  # outside a replica (tests, local use)
        return f"pid-{os.getpid()}"
