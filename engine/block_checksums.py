"""Checksums of KV blocks: what the producer wrote is what the reader computes from.

A block's checksum is a position-weighted sum of its 32-bit words, modulo 2**64:

    checksum(block) = sum_i  w_i * x_i   (mod 2**64),   x_i the i-th uint32, w_i odd uint32

Why this sum: it runs at memory speed (32 x 32 -> 64-bit products vectorise; a CPU kernel in
engine/layers/csrc/block_checksum.h, a Triton kernel over the blocks in GPU memory
(engine/block_checksum_triton.py), torch's integer ops elsewhere, all exact, so every device
computes the same value), and it catches what goes wrong with bytes in transit or at rest:
- any single flipped bit (it moves the sum by an odd multiple of a power of two below 2**64,
  never a multiple of 2**64);
- words moved or swapped within a block (their weights differ), a truncated read (the tail is
  whatever the reader's block held), a stale block (another prompt's KV): a random change goes
  unnoticed with probability about 2**-64.
It is not a cryptographic hash: it guards against faults, not against a forger (the side channel
is authenticated for that). It depends only on a block's bytes, so a block read into another
block id checks against the same value.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch is imported where blocks are summed: the router parses params only
    import torch

logger = logging.getLogger(__name__)

CHECKSUM_SCHEME = "wsum32-v1"  # in the KV compatibility hash: a new definition, a new name
CHECKSUM_HEX_DIGITS = 16  # kv_transfer_params carry each as 16 hex digits (JSON-safe)
_CHUNK_BYTES = 8 << 20  # blocks checked together; bounds the temporaries' size
_MASK64 = (1 << 64) - 1
_HEX_DIGITS = frozenset("0123456789abcdef")
_weights_cache: dict[tuple[int, str], torch.Tensor] = {}
_triton_failed = threading.Event()  # set once the Triton kernel failed: torch's ops after


def block_checksums(kv_cache: torch.Tensor, block_ids: Sequence[int]) -> list[str]:
    """The checksum of each block of a block-contiguous cache ([num_blocks, ...]), as hex."""
    return [to_hex(value) for value in block_sums(kv_cache, block_ids)]


def block_sums(kv_cache: torch.Tensor, block_ids: Sequence[int]) -> list[int]:
    """The checksum of each block of a block-contiguous cache ([num_blocks, ...])."""
    import torch

    if not block_ids:
        return []
    blocks = _block_bytes(kv_cache)
    ids = torch.tensor(list(block_ids), dtype=torch.int64)
    if ids.min() < 0 or ids.max() >= blocks.shape[0]:
        raise ValueError(f"block ids outside [0, {blocks.shape[0]})")
    weights = _weights(blocks.shape[1] // 4, blocks.device)
    return _sums(blocks, ids, weights)


def _sums(blocks: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> list[int]:
    """By the device's kernel: the CPU kernel, the Triton kernel on a GPU, else torch's ops."""
    if blocks.device.type == "cpu":
        kernel = _cpu_kernel()
        if kernel is not None:
            return list(kernel(blocks, ids, weights).tolist())
    elif blocks.device.type == "cuda":
        return _gpu_sums(blocks, ids.to(blocks.device), weights)
    return list(_torch_sums(blocks, ids.to(blocks.device), weights).tolist())


def _gpu_sums(blocks: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> list[int]:
    """The Triton kernel's sums; torch's ops where Triton is missing or its kernel failed."""
    if _triton_usable():
        from engine import block_checksum_triton as checksum_triton

        try:
            return checksum_triton.block_sums(blocks, ids, weights)
        except Exception:  # Triton's compile and launch errors share no base class
            # E.g. no C compiler for its launcher: torch's ops from now on, same values.
            logger.exception("the Triton checksum kernel failed; summing with torch's ops")
            _triton_failed.set()
    return list(_torch_sums(blocks, ids, weights).tolist())


def timed_block_checksums(
    kv_cache: torch.Tensor, block_ids: Sequence[int]
) -> tuple[list[str], int]:
    """block_checksums, and the microseconds it took (what the engines count as their cost)."""
    started = time.perf_counter()
    sums = block_checksums(kv_cache, block_ids)
    return sums, round((time.perf_counter() - started) * 1e6)


def parse_checksums(values: object, num_blocks: int) -> list[str]:
    """kv_transfer_params' checksums, checked: one 16-digit hex string per block (ValueError)."""
    if not isinstance(values, list) or len(values) != num_blocks:
        raise ValueError("remote_block_checksums must list one checksum per remote block")
    checked = [value.lower() for value in values if isinstance(value, str)]
    if len(checked) != num_blocks or not all(
        len(value) == CHECKSUM_HEX_DIGITS and set(value) <= _HEX_DIGITS for value in checked
    ):
        raise ValueError("remote_block_checksums must be 16-digit hex strings")
    return checked


def to_hex(value: int) -> str:
    """A checksum carried as an unsigned integer (protobuf fixed64) in the hex form."""
    return f"{value & _MASK64:016x}"


def from_hex(value: str) -> int:
    return int(value, 16)


def _block_bytes(kv_cache: torch.Tensor) -> torch.Tensor:
    """[num_blocks, block_bytes] uint8 view of the cache (same storage)."""
    import torch

    if kv_cache.dim() < 1 or not kv_cache.is_contiguous():
        raise ValueError("kv_cache must be a contiguous [num_blocks, ...] tensor")
    blocks = kv_cache.view(kv_cache.shape[0], -1).view(torch.uint8)
    if blocks.shape[1] % 4:
        raise ValueError("a KV block must be a whole number of 32-bit words")
    return blocks


def _torch_sums(blocks: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """The sums with torch's ops (any device): words widened to int64, whose wrapping
    arithmetic is arithmetic modulo 2**64. In chunks of blocks: the temporaries stay small."""
    import torch

    wide_weights = weights.to(torch.int64) & 0xFFFFFFFF
    per_chunk = max(1, _CHUNK_BYTES // blocks.shape[1])
    sums = []
    for start in range(0, len(ids), per_chunk):
        words = blocks[ids[start : start + per_chunk]].view(torch.int32).to(torch.int64)
        sums.append(((words & 0xFFFFFFFF) * wide_weights).sum(dim=1))
    return torch.cat(sums)


@functools.cache
def _cpu_kernel() -> Callable[..., torch.Tensor] | None:
    """The CPU kernel (memory speed), or None where the kernels cannot be built here (asked
    once: a failed build is not tried again on every transfer)."""
    from engine.layers import cpu_kernels

    try:
        kernel: Callable[..., torch.Tensor] = cpu_kernels.load().block_checksums
    except cpu_kernels.KernelBuildError:
        return None
    return kernel


def _triton_usable() -> bool:
    """The Triton kernel can be used: Triton is installed and the kernel has not failed."""
    return not _triton_failed.is_set() and _triton_installed()


@functools.cache
def _triton_installed() -> bool:
    try:
        from engine import block_checksum_triton  # noqa: F401 - imported to know it can be
    except ImportError:
        return False
    return True


def _weights(num_words: int, device: torch.device) -> torch.Tensor:
    """w_i as int32 bits: odd, pseudo-random (the low half of splitmix64(i)), the same
    everywhere; cached per size and device."""
    import torch

    key = (num_words, str(device))
    weights = _weights_cache.get(key)
    if weights is None:
        mixed = _splitmix64(torch.arange(num_words, dtype=torch.int64)) | 1
        low = mixed & 0xFFFFFFFF
        weights = torch.where(low >= 1 << 31, low - (1 << 32), low).to(torch.int32).to(device)
        _weights_cache[key] = weights
    return weights


def _splitmix64(x: torch.Tensor) -> torch.Tensor:
    """splitmix64's finaliser over int64 (wrapping arithmetic; logical shifts by masking)."""

    def shift_right(v: torch.Tensor, bits: int) -> torch.Tensor:
        return (v >> bits) & ((1 << (64 - bits)) - 1)

    x = x + _signed(0x9E3779B97F4A7C15)
    x = (x ^ shift_right(x, 30)) * _signed(0xBF58476D1CE4E5B9)
    x = (x ^ shift_right(x, 27)) * _signed(0x94D049BB133111EB)
    return x ^ shift_right(x, 31)


def _signed(value: int) -> int:
    """An unsigned 64-bit constant as the int64 with the same bits."""
    return value - (1 << 64) if value >= 1 << 63 else value
