"""`pdserve bench index`: the cluster KV index's lookup cost and size at many replicas, in this
process (no Ray, no engines): the `PrefixIndex` the index actor runs, filled with snapshots of
replicas that each hold a few of a set of shared prefix chains, then asked for prompts along
those chains. What a routing decision costs in the index itself (the actor call around it,
~1 ms, is not counted)."""

from __future__ import annotations

import random
import time
import tracemalloc
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass
from typing import Any

from deployments.cluster.prefix_index import PrefixIndex
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
    held: dict[str, list[bytes]] = {}
    for r in range(config.replicas):
        runs = rng.sample(range(config.chains), config.chains_per_replica)
        held[f"replica-{r}"] = [
            h for c in runs for h in chains[c][: rng.randrange(1, config.chain_blocks + 1)]
        ]
    index, size = built_index(held)
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


def built_index(held: Mapping[str, Iterable[bytes]]) -> tuple[PrefixIndex, int]:
    """An index of each replica's hashes, and the bytes it took: a copy of each hash per
    replica, as the actor gets them (each replica's in messages of its own)."""
    tracemalloc.start()
    try:
        index = PrefixIndex()
        for replica, hashes in held.items():
            copies = tuple(bytes(bytearray(h)) for h in hashes)
            index.load_snapshot(replica, KVSnapshot(replica, 0, copies))
        size, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    return index, size


CONFIG = IndexBenchConfig
