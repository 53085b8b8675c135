"""Faults injected into KV reads (`kv_transfer_config.fault_injection`), to prove the checks
catch them: after a read lands and before its blocks are verified, a block's bytes change as
a flaky NIC, a truncated transfer or a reused producer block would change them."""

from __future__ import annotations

import random
from collections.abc import Sequence

import torch

from engine.config import KVFaultInjection


class FaultInjector:
    def __init__(self, config: KVFaultInjection) -> None:
        self.config = config
        self._rng = random.Random(config.seed)

    def maybe_inject(self, kv_cache: torch.Tensor, block_ids: Sequence[int]) -> str | None:
        """With the configured chance, change one of `block_ids` (local blocks just read):
        the fault's name, or None when none was made (not drawn, or it would not have
        changed a byte — a truncated tail that was zeros already)."""
        if not block_ids or self._rng.random() >= self.config.rate:
            return None
        fault = self._rng.choice(self.config.faults)
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
        return None if torch.equal(block, before) else fault
