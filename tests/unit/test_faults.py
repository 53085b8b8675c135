"""Injected KV read faults (connector/faults.py): a data fault changes one block of the read
and is reported only when it changed a byte — so that every one reported must be caught; a
transport fault delays, loses or fails the read's completion (over a stand-in transport whose
reads are done at once: the faults act on what a completion reports)."""

from __future__ import annotations

import pytest
import torch

from connector.faults import FaultInjector, FaultyTransport
from connector.transport import BlockRead, KVTransport, TransferResults
from engine.block_checksums import block_checksums
from engine.config import KVFaultInjection
from tests.waiting import wait_until


@pytest.mark.parametrize("fault", ["flip", "truncate", "stale"])
def test_each_data_fault_changes_one_block_of_the_read(fault):
    torch.manual_seed(1)
    cache = torch.randn(6, 2, 8, 4)
    before = block_checksums(cache, range(6))
    injector = FaultInjector(KVFaultInjection(rate=1.0, faults=(fault,), seed=2))
    assert injector.draw() == fault
    assert injector.corrupt(cache, [2, 3], fault)
    after = block_checksums(cache, range(6))
    changed = [b for b in range(6) if before[b] != after[b]]
    assert len(changed) == 1 and changed[0] in (2, 3)


def test_a_fault_that_would_change_nothing_is_not_made():
    cache = torch.zeros(4, 64)
    cache[:, :32] = 1.0  # every block's second half is zeros already
    injector = FaultInjector(KVFaultInjection(rate=1.0, faults=("truncate",)))
    assert not injector.corrupt(cache, [0, 1], "truncate")
    assert torch.equal(cache[:, 32:], torch.zeros(4, 32))


def test_rate_zero_draws_nothing_and_the_draws_follow_the_seed():
    assert FaultInjector(KVFaultInjection(rate=0.0)).draw() is None
    injectors = [FaultInjector(KVFaultInjection(rate=0.5, seed=9)) for _ in range(2)]
    draws = [[injector.draw() for _ in range(20)] for injector in injectors]
    assert draws[0] == draws[1] and None in draws[0] and set(draws[0]) - {None}


class _Instant(KVTransport):
    """A transport whose every read is done at the next poll (nothing to move: the faults
    act on what the completion reports)."""

    name = "instant"

    def __init__(self) -> None:
        self.done: set[str] = set()
        self.cancelled: list[str] = []

    def register(self, kv_cache: torch.Tensor) -> None: ...

    def local_metadata(self) -> bytes:
        return b""

    def add_remote(self, engine_id: str, metadata: bytes) -> None: ...

    def start_read(self, read: BlockRead) -> None:
        self.done.add(read.transfer_id)

    def poll(self) -> TransferResults:
        done, self.done = self.done, set()
        return TransferResults(done=done)

    def cancel(self, transfer_id: str) -> None:
        self.cancelled.append(transfer_id)


def _faulty(fault: str, **config) -> tuple[FaultyTransport, torch.Tensor]:
    cache = torch.ones(8, 16)
    transport = FaultyTransport(_Instant(), KVFaultInjection(rate=1.0, faults=(fault,), **config))
    transport.register(cache)
    transport.start_read(BlockRead("r", "remote", [2, 3, 4, 5], [1, 2, 3, 4], "lease"))
    return transport, cache


def test_a_delayed_completion_is_reported_late_and_once():
    transport, _ = _faulty("delay", delay_s=0.2)
    assert transport.poll() == TransferResults()  # done below, not reported yet
    assert wait_until(lambda: "r" in transport.poll().done, 10)
    assert transport.poll() == TransferResults()
    assert transport.counts()["faults_delayed"] == 1


def test_a_lost_completion_is_reported_only_once_cancelled():
    transport, _ = _faulty("lose")
    assert transport.poll() == TransferResults()
    assert transport.poll() == TransferResults()  # never, by itself
    transport.cancel("r")  # the reader's deadline
    assert transport.poll().failed == {"r": "cancelled"}
    assert transport.inner.cancelled == []  # the inner transport had reported it done
    assert transport.counts()["faults_lost"] == 1


def test_a_remote_dying_mid_read_fails_it_with_its_tail_unwritten():
    transport, cache = _faulty("die")
    results = transport.poll()
    assert not results.done and "died mid-read" in results.failed["r"]
    assert cache[[4, 5]].eq(0).all() and cache[[2, 3]].eq(1).all()
    assert transport.counts() == {
        "faults_injected": 0,
        "faults_delayed": 0,
        "faults_lost": 0,
        "faults_died": 1,
    }


def test_a_data_fault_is_counted_and_the_read_reported_done():
    transport, cache = _faulty("flip", seed=3)
    before = block_checksums(cache, range(8))
    assert transport.poll().done == {"r"}
    after = block_checksums(cache, range(8))
    assert [b for b in range(8) if before[b] != after[b]] in ([2], [3], [4], [5])
    assert transport.counts()["faults_injected"] == 1
