"""Where a KV tier keeps its blocks: slots of one block each, in host memory or in a file.

A slot holds a block's bytes exactly (every layer, K and V: the primary pool's block layout),
so a block comes back bit for bit and its checksum is the one it left with. Where the
tensor-parallel ranks keep a cache each, a slot holds the block of every rank's cache, one
after another (`offset`).
"""

from __future__ import annotations

import os
import tempfile
from typing import Protocol

import numpy as np
import torch

from engine.config import CacheConfig
from engine.worker.host_memory import zeros_on_huge_pages

GIB = 1 << 30


class TierStore(Protocol):
    """Slots of `block_bytes` each; `write` and `read` copy a block (a uint8 view of the
    primary pool's block, on its device), or one rank's part of it at `offset` in the slot."""

    name: str

    def write(self, slot: int, block: torch.Tensor, offset: int = 0) -> None: ...

    def read(self, slot: int, block: torch.Tensor, offset: int = 0) -> None: ...

    def close(self) -> None: ...


def num_tier_slots(config: CacheConfig, block_bytes: int, size_field: str) -> int:
    """Blocks of `block_bytes` in the tier of `size_field`'s GiB (ValueError: not one)."""
    size = getattr(config, size_field)
    slots = int(size * GIB) // block_bytes
    if slots < 1:
        raise ValueError(f"{size_field}={size} GiB holds no KV block of {block_bytes} bytes")
    return slots


def make_store(config: CacheConfig, block_bytes: int) -> TierStore:
    """The configured tier's slots: config.num_tier_blocks of host memory or a file, and
    config.num_disk_tier_blocks of a file after them where a third tier is configured."""
    num_slots = config.num_tier_blocks or 0
    if config.kv_offloading_backend == "disk":
        return DiskStore(num_slots, block_bytes, config.kv_offloading_path)
    host = HostStore(num_slots, block_bytes)
    if not config.num_disk_tier_blocks:
        return host
    disk = DiskStore(config.num_disk_tier_blocks, block_bytes, config.kv_offloading_path)
    return StackedStore(host, num_slots, disk)


class StackedStore:
    """A tier over another, as one store: slots [0, n) are the upper one's, [n, ...) the
    lower one's (TierIndex numbers them so; a demotion reads one and writes the other)."""

    def __init__(self, upper: TierStore, upper_slots: int, lower: TierStore) -> None:
        self.name = f"{upper.name}+{lower.name}"
        self._upper, self._upper_slots, self._lower = upper, upper_slots, lower

    def _at(self, slot: int) -> tuple[TierStore, int]:
        if slot < self._upper_slots:
            return self._upper, slot
        return self._lower, slot - self._upper_slots

    def write(self, slot: int, block: torch.Tensor, offset: int = 0) -> None:
        store, local = self._at(slot)
        store.write(local, block, offset)

    def read(self, slot: int, block: torch.Tensor, offset: int = 0) -> None:
        store, local = self._at(slot)
        store.read(local, block, offset)

    def close(self) -> None:
        self._upper.close()
        self._lower.close()


class HostStore:
    """One host tensor of every slot (huge pages where Linux offers them)."""

    name = "cpu"

    def __init__(self, num_slots: int, block_bytes: int) -> None:
        self.slots = zeros_on_huge_pages((num_slots, block_bytes), torch.uint8)
        self._array = self.slots.numpy()

    # Host to host through numpy: one thread's memcpy, where torch's copy would start
    # OpenMP workers beside the ones computing the step.
    def write(self, slot: int, block: torch.Tensor, offset: int = 0) -> None:
        end = offset + block.numel()
        if block.device.type == "cpu":
            np.copyto(self._array[slot, offset:end], block.numpy())
        else:
            self.slots[slot, offset:end].copy_(block)

    def read(self, slot: int, block: torch.Tensor, offset: int = 0) -> None:
        end = offset + block.numel()
        if block.device.type == "cpu":
            np.copyto(block.numpy(), self._array[slot, offset:end])
        else:
            block.copy_(self.slots[slot, offset:end])

    def close(self) -> None:
        return None


class DiskStore:
    """One file of every slot, its space reserved up front (a full disk fails at start-up,
    not mid-copy) and unlinked at once: nothing is left behind by a process that dies."""

    name = "disk"

    def __init__(self, num_slots: int, block_bytes: int, directory: str | None) -> None:
        self.block_bytes = block_bytes
        fd, path = tempfile.mkstemp(prefix="pdserve-kv-tier-", dir=directory)
        try:
            os.unlink(path)
            os.posix_fallocate(fd, 0, num_slots * block_bytes)
        except OSError as exc:
            os.close(fd)
            raise ValueError(
                f"no room for a {num_slots * block_bytes} byte KV tier in "
                f"{directory or 'the temporary directory'}: {exc.strerror}"
            ) from exc
        self._fd = fd
        self._staging = torch.empty(block_bytes, dtype=torch.uint8)  # for blocks on a GPU

    def write(self, slot: int, block: torch.Tensor, offset: int = 0) -> None:
        size = block.numel()
        host = block if block.device.type == "cpu" else self._staging[:size].copy_(block)
        written = os.pwrite(self._fd, host.numpy().data, slot * self.block_bytes + offset)
        if written != size:
            raise OSError(f"short write to the KV tier ({written} of {size} bytes)")

    def read(self, slot: int, block: torch.Tensor, offset: int = 0) -> None:
        size = block.numel()
        host = block if block.device.type == "cpu" else self._staging[:size]
        got = os.preadv(self._fd, [host.numpy().data], slot * self.block_bytes + offset)
        if got != size:
            raise OSError(f"short read from the KV tier ({got} of {size} bytes)")
        if host is not block:
            block.copy_(host)

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
