"""Injected KV read faults (connector/faults.py): each changes one block of the read, and is
reported only when it changed a byte — so that every one reported must be caught."""

from __future__ import annotations

import pytest
import torch

from connector.checksums import block_checksums
from connector.faults import FaultInjector
from engine.config import KVFaultInjection


@pytest.mark.parametrize("fault", ["flip", "truncate", "stale"])
def test_each_fault_changes_one_block_of_the_read(fault):
    torch.manual_seed(1)
    cache = torch.randn(6, 2, 8, 4)
    before = block_checksums(cache, range(6))
    injector = FaultInjector(KVFaultInjection(rate=1.0, faults=(fault,), seed=2))
    assert injector.maybe_inject(cache, [2, 3]) == fault
    after = block_checksums(cache, range(6))
    changed = [b for b in range(6) if before[b] != after[b]]
    assert len(changed) == 1 and changed[0] in (2, 3)


def test_a_fault_that_would_change_nothing_is_not_reported():
    cache = torch.zeros(4, 64)
    cache[:, :32] = 1.0  # every block's second half is zeros already
    injector = FaultInjector(KVFaultInjection(rate=1.0, faults=("truncate",)))
    assert injector.maybe_inject(cache, [0, 1]) is None
    assert torch.equal(cache[:, 32:], torch.zeros(4, 32))


def test_rate_zero_injects_nothing_and_the_draws_follow_the_seed():
    cache = torch.randn(4, 16)
    assert FaultInjector(KVFaultInjection(rate=0.0)).maybe_inject(cache, [0, 1]) is None
    draws = [
        [FaultInjector(KVFaultInjection(rate=0.5, seed=9)).maybe_inject(cache.clone(), [0, 1])]
        for _ in range(2)
    ]
    assert draws[0] == draws[1]
