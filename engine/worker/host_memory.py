"""Host (CPU) buffers for KV caches, backed by transparent huge pages where Linux offers them.

Why: a KV cache is one large tensor read in scattered 2-16 KiB runs (attention) and handed
whole to NIXL, whose intra-node UCX path pins and walks the source pages. With 4 KiB pages
both pay per page (TLB misses, page-table walks); with 2 MiB pages a NIXL read of 256 MiB
runs at memcpy speed on the 2-core CI machine instead of ~60% of it (`pdserve bench kv`).

The buffer is a fresh anonymous mapping, 2 MiB-aligned, advised `MADV_HUGEPAGE` before its
first touch. (Advising memory from torch's allocator is not enough: glibc may hand out heap
memory that earlier tensors already faulted in as small pages.) The advice is a hint: with THP
set to "never", or off Linux, the buffer is ordinary memory.
"""

from __future__ import annotations

import contextlib
import mmap

import torch

HUGE_PAGE_BYTES = 2 << 20


def zeros_on_huge_pages(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zeroed, pre-touched CPU tensor whose pages were advised huge before first use. It
    keeps its mapping alive (and unmapped once the last view is gone)."""
    element = torch.empty((), dtype=dtype).element_size()
    num_bytes = max(element, torch.Size(shape).numel() * element)  # an empty shape still maps
    # Private: an anonymous mmap is shared (shmem) by default, and THP for shmem is off here.
    mapping = mmap.mmap(
        -1, num_bytes + HUGE_PAGE_BYTES, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
    )
    # Start at the first 2 MiB boundary inside the mapping (mmap itself aligns to 4 KiB).
    address = torch.frombuffer(mapping, dtype=torch.uint8, count=1).data_ptr()
    offset = -address % HUGE_PAGE_BYTES
    if hasattr(mmap, "MADV_HUGEPAGE"):
        with contextlib.suppress(OSError):  # a hint: kernels without THP refuse it
            mapping.madvise(mmap.MADV_HUGEPAGE, offset, num_bytes)
    raw = torch.frombuffer(mapping, dtype=torch.uint8, count=num_bytes, offset=offset)
    # Anonymous memory reads as zeros; writing them faults every page in now, not mid-step.
    return raw.zero_().view(dtype)[: torch.Size(shape).numel()].view(shape)


def transparent_huge_pages_mode() -> str:
    """always | madvise | never (the bracketed entry of the sysfs setting), or unknown."""
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as setting:
            text = setting.read()
    except OSError:
        return "unknown"
    start, end = text.find("["), text.find("]")
    return text[start + 1 : end] if 0 <= start < end else "unknown"


def return_freed_memory() -> None:
    """Hand the heap's freed pages back to the system (glibc's malloc_trim). Loading a model
    frees what it parsed and staged (a GGUF's metadata, raw rows before packing) into the
    heap, where it would stay counted as the engine's memory; elsewhere a no-op."""
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    with contextlib.suppress(OSError, AttributeError):
        if name is not None:
            ctypes.CDLL(name).malloc_trim(0)
