"""Host (CPU) buffers for KV caches, backed by transparent huge pages where Linux offers them.

Why: a KV cache is one large tensor read in scattered 2-16 KiB runs (attention) and handed
whole to NIXL, whose intra-node UCX path pins and walks the source pages. With 4 KiB pages
both pay per page (TLB misses, page-table walks); with 2 MiB pages a NIXL read of 256 MiB
runs at memcpy speed on the 2-core CI machine instead of ~60% of it (`pdserve bench kv`).
`madvise(MADV_HUGEPAGE)` is a hint: with THP set to "never", or off Linux, nothing changes.
"""

from __future__ import annotations

import ctypes
import sys

import torch

HUGE_PAGE_BYTES = 2 << 20
_MADV_HUGEPAGE = 14  # <sys/mman.h>, Linux


def advise_huge_pages(tensor: torch.Tensor) -> bool:
    """Ask the kernel to back the 2 MiB-aligned part of `tensor`'s memory with huge pages.
    Call it before the memory is first touched. True when the advice was taken."""
    if sys.platform != "linux" or tensor.device.type != "cpu":
        return False
    address = tensor.data_ptr()
    start = -(-address // HUGE_PAGE_BYTES) * HUGE_PAGE_BYTES
    end = (address + tensor.numel() * tensor.element_size()) // HUGE_PAGE_BYTES * HUGE_PAGE_BYTES
    if end <= start:
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return int(libc.madvise(start, end - start, _MADV_HUGEPAGE)) == 0


def zeros_on_huge_pages(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """torch.zeros on the CPU, its pages advised huge before they are faulted in."""
    tensor = torch.empty(shape, dtype=dtype)
    advise_huge_pages(tensor)
    return tensor.zero_()


def transparent_huge_pages_mode() -> str:
    """always | madvise | never (the bracketed entry of the sysfs setting), or unknown."""
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as setting:
            text = setting.read()
    except OSError:
        return "unknown"
    start, end = text.find("["), text.find("]")
    return text[start + 1 : end] if 0 <= start < end else "unknown"
