"""`pdserve bench index`: the cluster KV index's lookup cost and size at many replicas, in this
process (no Ray, no engines): the `PrefixIndex` the index actor runs, filled with snapshots of
replicas that each hold a few of a set of shared prefix chains, then asked for prompts along
those chains. What a routing decision costs in the index itself (the actor call around it,
~1 ms, is not counted)."""

from __future__ import annotations

import random
import time
import tracemalloc
from dataclasses import asdict, dataclass
from typing import Any

from deployments.cluster.kv_index import PrefixIndex
from engine.core.kv_events import KVSnapshot
from pdserve.bench.stats import summarize


@dataclass(frozen=True)
class IndexBenchConfig:
    replicas: int = 128
    """replicas the index knows"""
    chains: int = 32
    """distinct prefix chains (conversations, system prompts) across the cluster"""
    chain_blocks: int = 2000
    """blocks of each chain"""
    chains_per_replica: int = 4
    """chains each replica holds a leading run of (random lengths)"""
    max_prompt_blocks: int = 1000
    """a looked-up prompt follows one chain for up to this many blocks"""
    lookups: int = 2000
    """prompts looked up"""
    seed: int = 0
    """the random draws"""

    def __post_init__(self) -> None:
        for name in ("replicas", "chains", "chain_blocks", "lookups", "max_prompt_blocks"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
        if not 1 <= self.chains_per_replica <= self.chains:
            raise ValueError("chains_per_replica must be in [1, chains]")


def run(config: IndexBenchConfig) -> dict[str, Any]:
    rng = random.Random(config.seed)
    chains = [
        [(c * config.chain_blocks + i).to_bytes(8, "little") for i in range(config.chain_blocks)]
        for c in range(config.chains)
    ]
    tracemalloc.start()
    index = PrefixIndex()
    for r in range(config.replicas):
        held: list[bytes] = []
        for c in rng.sample(range(config.chains), config.chains_per_replica):
            # A copy of each hash per replica, as the actor gets them (one message each).
            held += (
                bytes(bytearray(h)) for h in chains[c][: rng.randrange(1, config.chain_blocks + 1)]
            )
        index.load_snapshot(f"replica-{r}", KVSnapshot(f"epoch-{r}", 0, tuple(held)))
    size, _ = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    entries = index.num_entries()
    times_us = []
    for _ in range(config.lookups):
        chain = rng.choice(chains)
        prompt = chain[: rng.randrange(1, config.max_prompt_blocks + 1)]
        start = time.perf_counter()
        index.match(prompt)
        times_us.append((time.perf_counter() - start) * 1e6)
    return {
        "benchmark": "index",
        "config": asdict(config),
        "match_us": summarize(times_us, (0.5, 0.99)),
        "entries": entries,
        "bytes": size,
        "bytes_per_entry": round(size / max(1, entries), 1),
    }


CONFIG = IndexBenchConfig
