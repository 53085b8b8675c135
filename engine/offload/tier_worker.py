"""The worker's side of a KV tier: a thread that makes the scheduler's copies in order.

Each store sums the block as it leaves the primary pool (engine/block_checksums.py);
each load sums it again once it is back in the pool, and a block whose sum differs is
reported invalid (the scheduler recomputes from it on). So bytes that went wrong anywhere on
the way — in the tier's memory, on disk, in a copy — are caught before a token is computed
from them.

Where the tensor-parallel ranks keep a cache each, rank 0 maps them all (engine/parallel/
rank0.py) and this worker copies a block of every one, each to its part of the slot, and
sums each: every rank's part comes back checked.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Sequence

import torch

from engine.block_checksums import block_sums
from engine.offload.copies import TierCopy, TierReport
from engine.offload.stores import TierStore

logger = logging.getLogger(__name__)


class TierWorker:
    def __init__(self, store: TierStore, kv_caches: Sequence[torch.Tensor], num_slots: int) -> None:
        """`kv_caches`: the engine's cache, or every rank's where each keeps its own (rank
        0's first); a slot holds a block of each, in this order."""
        self.store = store
        self._caches = list(kv_caches)
        # Per cache: its blocks as bytes, and where its part starts in a slot.
        self._blocks = [c.view(c.shape[0], -1).view(torch.uint8) for c in self._caches]
        self._offsets = [0]
        for blocks in self._blocks[:-1]:
            self._offsets.append(self._offsets[-1] + blocks.shape[1])
        self.slot_bytes = self._offsets[-1] + self._blocks[-1].shape[1]
        # A block on its way between two tiers (demotions), in host memory.
        self._staging = torch.empty(self.slot_bytes, dtype=torch.uint8)
        # Per slot: the version it was written at and its block's sums (one per cache) as it
        # left the pool. A load checks both: a slot read after its reuse fails, whatever the
        # copies' order.
        self._sums: list[tuple[int, tuple[int, ...]] | None] = [None] * num_slots
        self._queue: queue.SimpleQueue[tuple[list[TierCopy], threading.Event | None] | None] = (
            queue.SimpleQueue()
        )
        self._lock = threading.Lock()
        self._report = TierReport()
        # A stream of its own on each GPU holding a cache (the other ranks' through CUDA
        # IPC): copies run beside the steps' kernels, and a batch waits for its own only.
        self._streams = {c.device: torch.cuda.Stream(c.device) for c in self._caches if c.is_cuda}
        self._failure: str | None = None  # why the thread stopped, if it failed
        self._thread = threading.Thread(target=self._run, name="pdserve-kv-tier", daemon=True)
        self._thread.start()

    def submit(self, copies: Sequence[TierCopy], wait: bool = False) -> None:
        """Queue `copies` after those before; `wait`: return once they are made. Raises
        RuntimeError once the worker's thread has failed (the engine stops, clearly)."""
        self._check_alive()
        if not copies:
            return
        done = threading.Event() if wait else None
        self._queue.put((list(copies), done))
        while done is not None and not done.wait(1.0):
            self._check_alive()  # a thread that failed meanwhile sets no event
        self._check_alive()

    def report(self) -> TierReport:
        """What ended since the last report."""
        self._check_alive()
        with self._lock:
            report, self._report = self._report, TierReport()
        return report

    def corrupt_slot(self, slot: int, part: int = 0) -> None:
        """Tests: flip a bit of what slot `slot` holds, in cache `part`'s block (its recorded
        sum stays)."""
        block, offset = self._blocks[part][0].clone(), self._offsets[part]
        self.store.read(slot, block, offset)
        block[0] ^= 1
        self.store.write(slot, block, offset)

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=10)
        if not self._thread.is_alive():  # else it may still write: the store stays open
            self.store.close()

    def _check_alive(self) -> None:
        if self._failure is not None:
            raise RuntimeError(f"the KV tier's worker failed: {self._failure}")

    # ------------------------------------------------------------------ the thread

    def _run(self) -> None:
        try:
            for stream in self._streams.values():
                torch.cuda.set_stream(stream)  # the current stream of its device, here
            while (batch := self._queue.get()) is not None:
                copies, finished = batch
                try:
                    self._make(copies)
                finally:  # a waiting step goes on, and hears of a failure (set first)
                    if finished is not None:
                        finished.set()
        except BaseException as exc:  # submit() and report() say why from now on
            if self._failure is None:  # the set-up's (a batch's is recorded by _make)
                logger.exception("the KV tier's worker failed")
                self._failure = str(exc) or type(exc).__name__

    def _make(self, copies: list[TierCopy]) -> None:
        try:
            self._copy(copies)
        except BaseException as exc:  # not a copy's error (those are per block): the device's
            logger.exception("the KV tier's worker failed")
            self._failure = str(exc) or type(exc).__name__
            raise

    def _copy(self, copies: list[TierCopy]) -> None:
        started = time.perf_counter()
        done = TierReport(num_done=len(copies))
        for copy in copies:
            if copy.load_of:
                self._load(copy, done)
            elif copy.from_slot >= 0:
                self._demote(copy)
            else:
                self._store(copy, done)
        for stream in self._streams.values():
            stream.synchronize()
        done.copy_us = round((time.perf_counter() - started) * 1e6)
        done.bytes_copied = len(copies) * self.slot_bytes
        self._add(done)

    def _block_sums(self, block_id: int) -> tuple[int, ...]:
        return tuple(block_sums(cache, [block_id])[0] for cache in self._caches)

    def _store(self, copy: TierCopy, done: TierReport) -> None:
        try:
            for blocks, offset in zip(self._blocks, self._offsets, strict=True):
                self.store.write(copy.slot, blocks[copy.block_id], offset)
            self._sums[copy.slot] = (copy.version, self._block_sums(copy.block_id))
        except Exception:  # an I/O error: the slot reads as bad, the engine goes on
            logger.exception("storing a KV block in the %s tier failed", self.store.name)
            self._sums[copy.slot] = None
        if copy.held:
            done.stored.append(copy.block_id)

    def _demote(self, copy: TierCopy) -> None:
        recorded = self._sums[copy.from_slot]
        if recorded is None or recorded[0] != copy.from_version:
            self._sums[copy.slot] = None  # its store failed: the lower slot reads as bad
            return
        try:
            self.store.read(copy.from_slot, self._staging)
            self.store.write(copy.slot, self._staging)
            self._sums[copy.slot] = (copy.version, recorded[1])
        except Exception:
            logger.exception("moving a KV block down to the %s tier failed", self.store.name)
            self._sums[copy.slot] = None

    def _load(self, copy: TierCopy, done: TierReport) -> None:
        expected = self._sums[copy.slot]
        try:
            for blocks, offset in zip(self._blocks, self._offsets, strict=True):
                self.store.read(copy.slot, blocks[copy.block_id], offset)
            good = expected == (copy.version, self._block_sums(copy.block_id))
        except Exception:
            logger.exception("loading a KV block from the %s tier failed", self.store.name)
            good = False
        if good:
            done.num_loaded += 1
        else:
            done.invalid_block_ids.add(copy.block_id)
            done.bad_slots.append((copy.slot, copy.version))
        if copy.last:
            done.loaded.add(copy.load_of)

    def _add(self, done: TierReport) -> None:
        with self._lock:
            self._report.add(done)
