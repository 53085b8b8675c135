"""Cores of its own per engine replica: claims between real processes, and threads pinned as
the kernel sees them (deployments/replica/core_pinning.py)."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from deployments.replica.core_pinning import (
    claim_cores,
    pin_process_threads,
    place_engine,
    rank_0_cores,
)

pytestmark = pytest.mark.integration

HOLDER = """
import sys
from pathlib import Path
from deployments.replica.core_pinning import claim_cores
claim = claim_cores(int(sys.argv[2]), [0, 1, 2, 3], Path(sys.argv[1]))
print(",".join(map(str, claim.cores)) if claim else "none", flush=True)
sys.stdin.read()  # holds the claim until killed (or its stdin closes)
"""


def holder(lock_dir: Path, count: int) -> tuple[subprocess.Popen[str], str]:
    """Another process claiming `count` of the cores 0-3; it holds them until it dies."""
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(lock_dir), str(count)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        cwd=Path(__file__).resolve().parents[2],
    )
    assert proc.stdout is not None
    return proc, proc.stdout.readline().strip()


def test_processes_claim_disjoint_cores_and_a_killed_holder_frees_them(tmp_path):
    first, cores = holder(tmp_path, 2)
    try:
        assert cores == "0,1"
        # All or nothing: three are not free, and the two that are stay free after the try.
        assert claim_cores(3, [0, 1, 2, 3], tmp_path) is None
        claim = claim_cores(2, [0, 1, 2, 3], tmp_path)
        assert claim is not None and claim.cores == (2, 3)
        second, cores = holder(tmp_path, 1)
        second.kill()
        second.wait()
        assert cores == "none"
        first.kill()  # SIGKILL: no clean-up runs, the kernel drops its locks
        first.wait()
        again = claim_cores(2, [0, 1, 2, 3], tmp_path)
        assert again is not None and again.cores == (0, 1)
        claim.release()
        assert claim_cores(4, [0, 1, 2, 3], tmp_path) is None  # 0, 1 still held by `again`
        again.release()
        every = claim_cores(4, [0, 1, 2, 3], tmp_path)
        assert every is not None
        every.release()
    finally:
        first.kill()
        first.wait()


def test_a_lock_directory_it_cannot_use_leaves_the_replica_unpinned(tmp_path):
    blocked = tmp_path / "not-a-directory"
    blocked.write_text("")
    assert claim_cores(1, [0], blocked / "cores") is None


@pytest.fixture
def restore_affinity():
    allowed, threads = os.sched_getaffinity(0), torch.get_num_threads()
    yield allowed
    pin_process_threads(sorted(allowed))
    torch.set_num_threads(threads)


def task_affinities() -> list[set[int]]:
    """The CPU mask of every thread of this process alive now (one that ends between the
    listing and the read is left out: it no longer runs anywhere)."""
    masks = []
    for tid in os.listdir("/proc/self/task"):
        try:
            masks.append(os.sched_getaffinity(int(tid)))
        except ProcessLookupError:
            continue
    return masks


def test_pinning_moves_every_thread_and_those_started_after(restore_affinity, tmp_path):
    core = min(restore_affinity)
    stop = threading.Event()
    before = threading.Thread(target=stop.wait)
    before.start()
    try:
        placement, claim = place_engine(1, tmp_path)
        assert claim is not None and placement.cores == (core,) and placement.num_threads == 1
        assert torch.get_num_threads() == 1
        seen: list[set[int]] = []
        after = threading.Thread(target=lambda: seen.append(os.sched_getaffinity(0)))
        after.start()
        after.join()
        assert seen == [{core}]
        assert all(mask == {core} for mask in task_affinities())
        claim.release()
    finally:
        stop.set()
        before.join()


def test_a_replica_with_a_fraction_of_a_cpu_or_no_free_core_shares_them(restore_affinity, tmp_path):
    placement, claim = place_engine(0.5, tmp_path)
    assert claim is None and placement.cores == () and placement.num_threads == 1
    assert "0.5 CPU" in placement.why
    assert all(mask == restore_affinity for mask in task_affinities())
    every = sorted(restore_affinity)
    held = claim_cores(len(every), every, tmp_path)  # another replica has them all
    assert held is not None
    placement, claim = place_engine(1, tmp_path)
    assert claim is None and placement.num_threads == 1 and "free" in placement.why
    assert all(mask == restore_affinity for mask in task_affinities())
    held.release()
    placement, claim = place_engine(len(every), tmp_path)
    assert claim is not None and placement.cores == tuple(every)
    assert torch.get_num_threads() == len(every)
    claim.release()


def test_rank_0_of_a_split_replica_keeps_to_the_first_share_of_its_cores():
    # Followers pin themselves to the last shares (engine/parallel/workers.py): no overlap.
    assert rank_0_cores((7, 4, 6, 5), 2) == (4, 5)
    assert rank_0_cores((4, 5, 6, 7), 3) == (4,)
    assert rank_0_cores((4, 5), 3) == ()  # fewer cores than ranks: nobody is pinned
