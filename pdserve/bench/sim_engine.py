"""A simulated engine replica for `pdserve bench router-sim`: a prefix cache of chained block
hashes with LRU eviction that emits the KV events a real engine emits (numbered batches,
engine/core/kv_events.py), and a timing model on a simulated clock — prefill at a fixed rate
behind the work queued before it, decode steps that slow with the batch.

Nothing of a model runs: what the simulator measures is the routing (the real index and
scoring code, deployments/cluster/) against what it does to caches and queues."""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Container
from dataclasses import dataclass

from engine.core.kv_events import (
    BlockRemoved,
    BlockStored,
    EngineLoad,
    KVCacheEvent,
    KVEventBatch,
    KVSnapshot,
)


@dataclass(frozen=True)
class EngineModel:
    """How long an engine takes, on the simulated clock."""

    prefill_tokens_per_s: float = 30_000.0
    step_s: float = 0.012  # a decode step of one sequence
    step_per_seq_s: float = 0.00015  # what each further sequence in the batch adds
    capacity_blocks: int = 8192  # the prefix cache (KV pool) in blocks


def leading_run(hashes: list[bytes], held: Container[bytes]) -> int:
    """How many of a prompt's chained block hashes, from the first, `held` holds."""
    run = 0
    for block_hash in hashes:
        if block_hash not in held:
            break
        run += 1
    return run


class SimEngine:
    def __init__(self, name: str, role: str, model: EngineModel, block_size: int) -> None:
        self.name, self.role, self.model, self.block_size = name, role, model, block_size
        self._cache: OrderedDict[bytes, None] = OrderedDict()  # oldest use first
        self._events: list[KVCacheEvent] = []
        self._seq = 0
        self.free_at = 0.0  # when the prefill work queued here is done
        self._prefills: list[tuple[float, float, int]] = []  # (start, end, tokens)
        self._decodes: list[tuple[float, float, int]] = []  # (start, end, blocks held)
        # The load as last worked out, and until when it holds (the next start or end of a
        # prefill or decode here): every engine is asked each round, mostly unchanged, and
        # the simulator's own work must not crowd out the routing code it times.
        self._load: EngineLoad | None = None
        self._load_until = 0.0

    # ------------------------------------------------------------------ cache

    def held_blocks(self, hashes: list[bytes]) -> int:
        """The leading run of `hashes` in the cache (the engine's own lookup)."""
        return leading_run(hashes, self._cache)

    def store(self, hashes: list[bytes]) -> int:
        """Use `hashes` (a prompt's blocks): the held leading run is touched, the rest stored,
        the least recently used evicted past capacity. Returns the blocks it held."""
        held = self.held_blocks(hashes)
        cache = self._cache
        for block_hash in hashes[:held]:
            cache.move_to_end(block_hash)
        new = [h for h in hashes[held:] if h not in cache]
        for block_hash in new:
            cache[block_hash] = None
        if new:
            self._events.append(BlockStored(new, None, [], self.block_size))
        evicted = []
        while len(cache) > self.model.capacity_blocks:
            evicted.append(cache.popitem(last=False)[0])
        if evicted:
            self._events.append(BlockRemoved(evicted))
        return held

    def take_batch(self) -> KVEventBatch | None:
        if not self._events:
            return None
        batch = KVEventBatch(self.name, self._seq, tuple(self._events))
        self._seq += 1
        self._events = []
        return batch

    def cached(self) -> tuple[bytes, ...]:
        return tuple(self._cache)

    def snapshot(self) -> KVSnapshot:
        self._events = []  # covered by the snapshot, as the engine's stream drops them
        return KVSnapshot(self.name, self._seq, self.cached())

    # ------------------------------------------------------------------ time

    def prefill(self, now: float, tokens: int) -> float:
        """Queue `tokens` of prefill behind what is queued; when they are done."""
        start = max(now, self.free_at)
        self.free_at = start + tokens / self.model.prefill_tokens_per_s
        self._prefills.append((start, self.free_at, tokens))
        self._load = None
        return self.free_at

    def decode(self, now: float, start: float, output_len: int, blocks: int) -> float:
        """Decode `output_len` tokens from `start` (not before `now`) beside the decodes
        running then, holding `blocks` KV blocks meanwhile; the time per output token. (A
        prefill computed here meanwhile does not slow them: not modelled.)"""
        self._decodes = [d for d in self._decodes if d[1] > now]
        beside = sum(1 for s, e, _ in self._decodes if s <= start < e)
        tpot = self.model.step_s + self.model.step_per_seq_s * beside
        self._decodes.append((start, start + tpot * output_len, blocks))
        self._load = None
        return tpot

    def load(self, now: float) -> EngineLoad:
        """As the engine reports it: a prefill computing or a decode counts as running, a
        prefill not started as waiting; KV usage counts the blocks running requests hold
        (cached blocks nobody uses are free to evict)."""
        if self._load is not None and now < self._load_until:
            return self._load
        self._prefills = [p for p in self._prefills if p[1] > now]
        waiting = [tokens for start, _, tokens in self._prefills if start > now]
        decoding = [held for start, end, held in self._decodes if start <= now < end]
        self._load = EngineLoad(
            num_running=len(decoding) + len(self._prefills) - len(waiting),
            num_waiting=len(waiting),
            queued_prompt_tokens=sum(waiting),
            kv_cache_usage=round(min(1.0, sum(decoding) / self.model.capacity_blocks), 3),
        )
        work = (*self._prefills, *self._decodes)
        self._load_until = min((t for w in work for t in w[:2] if t > now), default=math.inf)
        return self._load
