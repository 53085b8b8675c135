"""EngineStats: the one shape in which an engine's statistics leave it.

One is built from the scheduler after every step (`scheduler_stats`, on the engine's own thread)
and `EngineCore.step` ships it with the step's outputs. Everything that wants to know how an
engine is doing reads that object — metrics, the load published to the KV index, Serve's
autoscaling stats, health, the benchmarks — never the scheduler, from any thread: it is frozen,
and replaced whole.

Counters run from the engine's start (a reader that wants rates keeps the last reading);
gauges are as of the step.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from typing import TYPE_CHECKING, Any

from engine.core.kv_events import EngineLoad
from engine.spec_decode.ngram import SpecDecodeStats

if TYPE_CHECKING:
    from engine.core.scheduler import Scheduler

# Connector counters Health carries as kv_<name> (protos/pdserve/v1/generate.proto).
_KV_HEALTH = (
    "reads_failed",
    "fenced_reads",
    "unanswered_reads",
    "faults_lost",
    "faults_died",
    "timed_out_reads",
    "pieces_direct",
    "pieces_staged",
)


@dataclass(frozen=True)
class EngineStats:
    num_blocks: int  # usable KV blocks (the null block is not counted)
    num_free_blocks: int  # free or only cached (evictable)
    num_running: int
    num_waiting: int  # waiting to be scheduled, reading remote KV included
    num_held_requests: int  # finished, blocks held for a remote reader
    queued_prompt_tokens: int  # prompt tokens of unfinished requests not computed nor being read
    num_preemptions: int = 0  # counter
    prefix_cache_queries: int = 0  # counter: prompt tokens looked up in the prefix cache
    prefix_cache_hits: int = 0  # counter: prompt tokens found there
    spec_decode: SpecDecodeStats = field(default_factory=SpecDecodeStats)  # counters
    # The KV connector's counters (KVConnectorBase.stats: loads, blocks read and verified,
    # checksum failures...); empty without KV transfer.
    kv_transfer: dict[str, int] = field(default_factory=dict)
    # The KV tier's counters (engine/offload/tier_index.py TierStats); empty without a tier.
    kv_tier: dict[str, int] = field(default_factory=dict)
    # Finished turns' pins (engine/core/pins.py PinStats: counters), and those held now.
    kv_pins: dict[str, int] = field(default_factory=dict)
    tensor_parallel_size: int = 1
    # Counter: rank 0's time in all-reduce and all-gather (exchanging, and waiting for the
    # slower ranks), microseconds; 0 at one rank.
    tp_collective_us: int = 0

    @property
    def kv_cache_usage(self) -> float:
        return 1.0 - self.num_free_blocks / max(1, self.num_blocks)

    @property
    def load(self) -> EngineLoad:
        """The work ahead of the engine, as a KV-aware router weighs it against cache hits
        (usage to 3 places: the index hears of a change that matters, not of every block)."""
        return EngineLoad(
            num_running=self.num_running,
            num_waiting=self.num_waiting,
            queued_prompt_tokens=self.queued_prompt_tokens,
            kv_cache_usage=round(self.kv_cache_usage, 3),
        )

    def health(self) -> dict[str, Any]:
        """The fields of pdserve.v1.EngineStats (protos/pdserve/v1/generate.proto)."""
        return {
            "num_blocks": self.num_blocks,
            "num_free_blocks": self.num_free_blocks,
            "num_running": self.num_running,
            "num_waiting": self.num_waiting,
            "num_held_requests": self.num_held_requests,
            "kv_cache_usage": self.kv_cache_usage,
            "tensor_parallel_size": self.tensor_parallel_size,
            "tp_collective_seconds": self.tp_collective_us / 1e6,
            "kv_checksum_failures": self.kv_transfer.get("checksum_failures", 0),
            "kv_faults_injected": self.kv_transfer.get("faults_injected", 0),
            **{f"kv_{name}": self.kv_transfer.get(name, 0) for name in _KV_HEALTH},
        }


def scheduler_stats(scheduler: Scheduler) -> EngineStats:
    """The engine's statistics as of now, from its scheduler (engine thread only)."""
    pool = scheduler.kv_cache_manager.block_pool
    unfinished = scheduler.get_num_unfinished_requests()
    prefix = scheduler.kv_cache_manager.prefix_cache_stats
    speculator = scheduler.speculator
    connector = scheduler.connector
    return EngineStats(
        num_blocks=pool.num_blocks - 1,
        num_free_blocks=pool.get_num_free_blocks(),
        num_running=len(scheduler.running),
        num_waiting=unfinished - len(scheduler.running),
        num_held_requests=len(scheduler.requests) - unfinished,
        queued_prompt_tokens=scheduler.queued_prompts.count(),
        num_preemptions=scheduler.preemption.num_preemptions,
        prefix_cache_queries=prefix.queries,
        prefix_cache_hits=prefix.hits,
        spec_decode=replace(speculator.stats) if speculator else SpecDecodeStats(),
        kv_transfer=dict(connector.stats) if connector is not None else {},
        kv_tier=asdict(scheduler.tier.stats) if scheduler.tier is not None else {},
        kv_pins={
            **asdict(scheduler.pins.stats),
            "held": scheduler.pins.num_pins,
            "held_blocks": scheduler.pins.num_blocks,
        },
    )
