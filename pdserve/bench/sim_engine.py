"""A simulated engine replica for `pdserve bench router-sim`: a prefix cache of chained block
hashes with LRU eviction that emits the KV events a real engine emits (numbered batches,
engine/core/kv_events.py), and a timing model on a simulated clock — prefill at a fixed rate
behind the work queued before it, decode steps that slow with the batch.

Nothing of a model runs: what the simulator measures is the routing (the real index and
scoring code, deployments/cluster/) against what it does to caches and queues."""

from __future__ import annotations

from collections import OrderedDict
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


class SimEngine:
    def __init__(self, name: str, role: str, model: EngineModel, block_size: int) -> None:
        self.name, self.role, self.model, self.block_size = name, role, model, block_size
        self._cache: OrderedDict[bytes, None] = OrderedDict()  # oldest use first
        self._events: list[KVCacheEvent] = []
        self._seq = 0
        self.free_at = 0.0  # when the prefill work queued here is done
        self._queued: list[tuple[float, int]] = []  # (start, tokens) of prefills not started
        self._decoding: list[tuple[float, int]] = []  # each running decode's end, its blocks
        self.ongoing = 0  # requests the router has in flight here (its own count)

    # ------------------------------------------------------------------ cache

    def held_blocks(self, hashes: list[bytes]) -> int:
        """The leading run of `hashes` in the cache (the engine's own lookup)."""
        run = 0
        for block_hash in hashes:
            if block_hash not in self._cache:
                break
            run += 1
        return run

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
        self._queued.append((start, tokens))
        return self.free_at

    def decode(self, start: float, output_len: int, blocks: int) -> float:
        """Decode `output_len` tokens from `start` beside what runs then, holding `blocks` KV
        blocks meanwhile; the time per output token."""
        running = [(end, held) for end, held in self._decoding if end > start]
        tpot = self.model.step_s + self.model.step_per_seq_s * len(running)
        running.append((start + tpot * output_len, blocks))
        self._decoding = running
        return tpot

    def load(self, now: float) -> EngineLoad:
        """As the engine reports it: KV usage counts the blocks running requests hold (cached
        blocks nobody uses are free to evict)."""
        self._queued = [(s, t) for s, t in self._queued if s > now]
        running = [held for end, held in self._decoding if end > now]
        return EngineLoad(
            num_running=len(running),
            num_waiting=len(self._queued),
            queued_prompt_tokens=sum(t for _, t in self._queued),
            kv_cache_usage=round(min(1.0, sum(running) / self.model.capacity_blocks), 3),
        )
