"""Faults injected into KV reads (`kv_transfer_config.fault_injection`), to prove the checks
catch them. `FaultyTransport` wraps an engine's transport; as each read completes, with the
configured chance one fault is done to it, as the transport would have delivered it:

- data faults, to one block of the read, after it landed: "flip" (a bit, a flaky NIC),
  "truncate" (the block's second half zeroed, a short transfer), "stale" (another block's
  bytes, a reused producer block) — each must be caught by its checksum;
- "delay": the completion is reported `delay_s` late — the read must still be used;
- "lose": the completion is never reported — the reader's deadline must end the read;
- "die": the remote dies mid-read — the read fails with part of its blocks zeroed.

Only data faults that change a byte are made and counted, so every one counted must show up
as a checksum failure.
"""

from __future__ import annotations

import random
import time
from collections import Counter
from collections.abc import Sequence
from types import MappingProxyType
from typing import Any

import torch

from connector.transport import BlockRead, KVTransport, TransferResults, as_shards, destination
from engine.config import KV_DATA_FAULTS, KVFaultInjection
from engine.core.block_pool import NULL_BLOCK_ID

_DIED = "injected fault: the remote engine died mid-read"
_KINDS = {"delay": "delayed", "lose": "lost", "die": "died"}
# FaultyTransport.counts() of an engine that injects nothing.
NO_FAULTS = MappingProxyType(
    dict.fromkeys(("faults_injected", *(f"faults_{kind}" for kind in _KINDS.values())), 0)
)


class FaultInjector:
    def __init__(self, config: KVFaultInjection) -> None:
        self.config = config
        self._rng = random.Random(config.seed)

    def draw(self) -> str | None:
        """The fault to do to a read that just completed, or None (not drawn)."""
        if self._rng.random() >= self.config.rate:
            return None
        return self._rng.choice(self.config.faults)

    def corrupt(self, kv_cache: torch.Tensor, block_ids: Sequence[int], fault: str) -> bool:
        """Do data fault `fault` to one of `block_ids`; False when it changed nothing (a
        truncated tail that was zeros already)."""
        if not block_ids:
            return False
        blocks = kv_cache.view(kv_cache.shape[0], -1).view(torch.uint8)
        block = blocks[self._rng.choice(list(block_ids))]
        before = block.clone()
        if fault == "flip":
            byte = self._rng.randrange(block.shape[0])
            block[byte] ^= 1 << self._rng.randrange(8)
        elif fault == "truncate":
            block[block.shape[0] // 2 :] = 0
        else:  # stale: the bytes of another block (the first that differs)
            for other in range(blocks.shape[0]):
                if not torch.equal(blocks[other], before):
                    block.copy_(blocks[other])
                    break
        return not torch.equal(block, before)


class FaultyTransport(KVTransport):
    """A transport whose completed reads get the injector's faults (see the module doc).
    Everything else is the wrapped transport's. `injected` counts the faults made."""

    def __init__(self, inner: KVTransport, config: KVFaultInjection) -> None:
        self.inner = inner
        self.name = inner.name
        self.injected: Counter[str] = Counter()
        self._faults = FaultInjector(config)
        self._delay_s = config.delay_s
        self._caches: list[torch.Tensor] = []
        self._reads: dict[str, BlockRead] = {}
        self._delayed: dict[str, float] = {}  # transfer id -> when to report it done
        self._lost: set[str] = set()  # done, never reported (until cancelled)
        self._cancelled: set[str] = set()  # held here, reported failed at the next poll
        self._cancel_asked: set[str] = set()  # asked of the inner transport: no notice fault

    def register(self, kv_cache: torch.Tensor | Sequence[torch.Tensor]) -> None:
        self._caches = as_shards(kv_cache)
        self.inner.register(kv_cache)

    def local_metadata(self) -> bytes:
        return self.inner.local_metadata()

    def add_remote(self, engine_id: str, metadata: bytes) -> None:
        self.inner.add_remote(engine_id, metadata)

    def start_read(self, read: BlockRead) -> None:
        self.inner.start_read(read)
        self._reads[read.transfer_id] = read

    def poll(self) -> TransferResults:
        found = self.inner.poll()
        results = TransferResults(failed=dict(found.failed), fenced=set(found.fenced))
        for transfer_id in found.failed:
            self._reads.pop(transfer_id, None)
            self._cancel_asked.discard(transfer_id)
        for transfer_id in found.done:
            self._completed(self._reads.pop(transfer_id), results)
        now = time.monotonic()
        for transfer_id, due in list(self._delayed.items()):
            if due <= now:
                del self._delayed[transfer_id]
                results.done.add(transfer_id)
        for transfer_id in self._cancelled:
            results.failed[transfer_id] = "cancelled"
        self._cancelled.clear()
        return results

    def cancel(self, transfer_id: str) -> None:
        if transfer_id in self._lost or transfer_id in self._delayed:
            self._lost.discard(transfer_id)
            self._delayed.pop(transfer_id, None)
            self._cancelled.add(transfer_id)
        else:
            # It may have ended already (then it is reported done): a lost or delayed notice
            # of it would leave a read its reader no longer watches the deadline of.
            self._cancel_asked.add(transfer_id)
            self.inner.cancel(transfer_id)

    def inject_failure(self, after: int) -> None:
        self.inner.inject_failure(after)

    def close(self) -> None:
        self.inner.close()

    def __getattr__(self, name: str) -> Any:
        # The wrapped transport's own extras (set_remote_client, forget_remote, stats).
        if name == "inner":  # not set yet: no recursion
            raise AttributeError(name)
        return getattr(self.inner, name)

    def counts(self) -> dict[str, int]:
        """The connector's fault counters: data faults (each a checksum failure to be),
        and each transport fault by kind."""
        data = sum(self.injected[f] for f in KV_DATA_FAULTS)
        kinds = {f"faults_{kind}": self.injected[name] for name, kind in _KINDS.items()}
        return {"faults_injected": data, **kinds}

    def _completed(self, read: BlockRead, results: TransferResults) -> None:
        cache = destination(read, self._caches)  # where the read landed: there the faults go
        transfer_id = read.transfer_id
        # Blocks read from the remote's null block are never checked: no fault goes there.
        pairs = zip(read.local_block_ids, read.remote_block_ids, strict=True)
        block_ids = [local for local, remote in pairs if remote != NULL_BLOCK_ID]
        fault = self._faults.draw() if block_ids else None
        if transfer_id in self._cancel_asked:
            self._cancel_asked.discard(transfer_id)
            fault = None if fault in _KINDS else fault
        if fault not in _KINDS:  # none, or a data fault: the read is reported done
            if fault is not None and self._faults.corrupt(cache, block_ids, fault):
                self.injected[fault] += 1
            results.done.add(transfer_id)
            return
        self.injected[fault] += 1
        if fault == "delay":
            self._delayed[transfer_id] = time.monotonic() + self._delay_s
        elif fault == "lose":
            self._lost.add(transfer_id)
        else:  # die: its tail blocks never arrived, zeroed as a fresh allocation holds them
            cache[block_ids[len(block_ids) // 2 :]] = 0
            results.failed[transfer_id] = _DIED
