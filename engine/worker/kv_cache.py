"""KV cache tensors in the block-contiguous layout.

One tensor [num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]: a block's K and V
for every layer are one contiguous region, so one transfer descriptor moves a whole block and
runs of consecutive block ids coalesce into one. Attention reads per-layer strided views.
"""

from __future__ import annotations

import math
import os
import tempfile
from dataclasses import dataclass

import torch

from engine.worker.host_memory import zeros_on_huge_pages

DEFAULT_CPU_KV_CACHE_BYTES = 1 << 30


@dataclass(frozen=True)
class KVCacheSpec:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype

    @property
    def bytes_per_block(self) -> int:
        element = torch.empty((), dtype=self.dtype).element_size()
        return self.num_layers * 2 * self.block_size * self.num_kv_heads * self.head_dim * element


@dataclass(frozen=True)
class KVShard:
    """What a KV connector reads and writes of one rank's cache: blocks of the model's KV
    heads [first_head, first_head + num_heads). An engine of one rank, or of ranks sharing one
    cache, has one shard of every head; ranks with caches of their own (GPUs, replicated KV
    heads, `tensor_parallel_kv_cache="per_rank"`) one each, all mapped in rank 0's process."""

    cache: torch.Tensor  # [num_blocks, num_layers, 2, block_size, num_heads, head_dim]
    first_head: int = 0

    @property
    def num_heads(self) -> int:
        return int(self.cache.shape[4])


def allocate_kv_cache(spec: KVCacheSpec, num_blocks: int, device: torch.device) -> torch.Tensor:
    # Zeroed: slots that are read before written (padding inside a block) must not hold NaNs.
    shape = (num_blocks, spec.num_layers, 2, spec.block_size, spec.num_kv_heads, spec.head_dim)
    if device.type == "cpu":
        return zeros_on_huge_pages(shape, spec.dtype)
    return torch.zeros(shape, dtype=spec.dtype, device=device)


def create_shared_kv_file(spec: KVCacheSpec, num_blocks: int) -> str:
    """A zeroed file in /dev/shm the size of a cache of `spec` (the tensor-parallel ranks of
    one engine on one host map it: one cache, each rank attending over its heads)."""
    return reserve_shared_file("pdserve-kv-", num_blocks * spec.bytes_per_block, "the KV cache")


def reserve_shared_file(prefix: str, nbytes: int, what: str) -> str:
    """A zeroed file of `nbytes` in /dev/shm, its pages reserved now: a sparse file on a full
    tmpfs would kill the first process to touch a missing page (SIGBUS) mid-step."""
    base = "/dev/shm" if os.path.isdir("/dev/shm") else None
    fd, path = tempfile.mkstemp(prefix=prefix, dir=base)
    try:
        os.posix_fallocate(fd, 0, nbytes)
    except OSError as exc:
        os.unlink(path)
        raise ValueError(
            f"no room in {base or tempfile.gettempdir()} for {what} the tensor-parallel ranks "
            f"share ({nbytes / 2**20:.0f} MiB): {exc.strerror}; give the container a larger "
            "/dev/shm (Kubernetes: an emptyDir of medium Memory) or a smaller KV cache"
        ) from None
    finally:
        os.close(fd)
    return path


def map_shared_kv_cache(path: str, spec: KVCacheSpec, num_blocks: int) -> torch.Tensor:
    """The cache in `path` (create_shared_kv_file's), shared with every process mapping it."""
    shape = (num_blocks, spec.num_layers, 2, spec.block_size, spec.num_kv_heads, spec.head_dim)
    numel = math.prod(shape)
    return torch.from_file(path, shared=True, size=numel, dtype=spec.dtype).view(shape)


def layer_views(kv_cache: torch.Tensor) -> list[torch.Tensor]:
    """[num_blocks, 2, block_size, H, D] views of each layer, sharing the cache's storage."""
    return [kv_cache[:, layer] for layer in range(kv_cache.shape[1])]


def cuda_kv_cache_budget(device: torch.device, gpu_memory_utilization: float) -> int:
    """What is left for KV out of `gpu_memory_utilization` of the card, after what is in use
    now (weights, other processes)."""
    free, total = torch.cuda.mem_get_info(device)
    used = total - free
    return max(0, int(total * gpu_memory_utilization) - used)


def check_cuda_kv_budget(
    budget: int, bytes_per_block: int, device: torch.device, gpu_memory_utilization: float
) -> None:
    """ValueError when `budget` holds fewer than two KV blocks: an engine that cannot hold a
    request must say why at start-up, not fail its first request."""
    if budget >= 2 * bytes_per_block:
        return
    free, total = torch.cuda.mem_get_info(device)
    raise ValueError(
        f"no GPU memory left for the KV cache: gpu_memory_utilization={gpu_memory_utilization} "
        f"of {total / 2**30:.1f} GiB, of which {(total - free) / 2**30:.1f} GiB is in use "
        "already (weights, other engines or processes on this GPU); raise "
        "gpu_memory_utilization, free the GPU, or set num_gpu_blocks_override"
    )
