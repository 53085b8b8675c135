"""CPU KV caches are allocated zeroed, on transparent huge pages where the kernel offers them."""

from __future__ import annotations

import pytest
import torch

from engine.worker.host_memory import (
    HUGE_PAGE_BYTES,
    transparent_huge_pages_mode,
    zeros_on_huge_pages,
)
from engine.worker.kv_cache import KVCacheSpec, allocate_kv_cache


def huge_page_kib(tensor: torch.Tensor) -> int:
    """AnonHugePages of the mapping that holds the tensor's first aligned huge page."""
    address = -(-tensor.data_ptr() // HUGE_PAGE_BYTES) * HUGE_PAGE_BYTES
    inside = False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                low, high = (int(part, 16) for part in head.split("-"))
                inside = low <= address < high
            elif inside and head == "AnonHugePages:":
                return int(line.split()[1])
    return 0


def test_kv_cache_is_zeroed_and_backed_by_huge_pages_when_available():
    # A large tensor freed first raises glibc's mmap threshold, so torch's allocator would hand
    # the cache recycled heap memory already faulted in as small pages (the bug this guards).
    del_me = torch.ones(40 << 20, dtype=torch.uint8)
    del del_me
    spec = KVCacheSpec(
        num_layers=2, num_kv_heads=4, head_dim=64, block_size=16, dtype=torch.float32
    )
    cache = allocate_kv_cache(spec, num_blocks=256, device=torch.device("cpu"))  # 32 MiB
    assert cache.shape == (256, 2, 2, 16, 4, 64)
    assert not cache.any()
    if transparent_huge_pages_mode() in ("always", "madvise"):
        assert huge_page_kib(cache) >= HUGE_PAGE_BYTES // 1024
    else:  # THP off: the advice is a no-op and the cache is plain memory
        assert huge_page_kib(cache) == 0


def test_buffers_start_on_a_huge_page_boundary_and_outlive_nothing_they_need():
    tensor = zeros_on_huge_pages((3, 1000), torch.float16)
    assert tensor.data_ptr() % HUGE_PAGE_BYTES == 0
    tensor.fill_(2)  # the mapping stays alive as long as the tensor
    assert tensor.sum().item() == 6000
    assert zeros_on_huge_pages((0, 4), torch.float32).shape == (0, 4)


def test_zeros_on_huge_pages_matches_torch_zeros():
    tensor = zeros_on_huge_pages((5, HUGE_PAGE_BYTES // 4), torch.float32)
    assert torch.equal(tensor, torch.zeros(5, HUGE_PAGE_BYTES // 4))


def test_a_shared_file_that_does_not_fit_is_refused_by_name(monkeypatch):
    # tmpfs full (a container's 64 MiB /dev/shm): refused at start-up, not a SIGBUS mid-step.
    import errno
    import os

    from engine.worker import kv_cache

    def full(fd, offset, length):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(kv_cache.os, "posix_fallocate", full)
    before = set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()
    with pytest.raises(ValueError, match=r"no room in .* for the KV cache .*1024 MiB"):
        kv_cache.reserve_shared_file("pdserve-test-", 1 << 30, "the KV cache")
    after = set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()
    assert after == before  # the file made for it is gone
