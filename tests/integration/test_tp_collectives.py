"""The tensor-parallel ranks' shared-memory collectives between real processes: sums and
gathers across slot-sized chunks, the same bits on every rank; ranks that disagree on a
collective fail instead of mixing unrelated numbers; a waiting rank woken with an error when
the group is aborted."""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch

from engine.layers import cpu_kernels
from engine.parallel.group import GroupSpec, ShmGroup, join_group
from tests.integration.processes import peer_context

SLOT_BYTES = 4096  # small: every collective below spans several chunks


def _inputs(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(rank)
    return torch.randn(10_001, generator=generator), torch.randn(7, 300, generator=generator)


def _follower(spec: GroupSpec, conn) -> None:
    group = join_group(spec, 1)
    summed_input, local = _inputs(1)
    summed = group.all_reduce(summed_input.clone())
    gathered = group.all_gather(local)
    conn.send((summed.numpy().tobytes(), gathered.numpy().tobytes()))


def _group_with_follower(target) -> tuple[ShmGroup, Any, Any]:
    """Rank 0's group here, rank 1 in a process running `target(spec, conn)`; our end of
    its pipe."""
    group, spec = ShmGroup.create(2, cpu_kernels.load(), SLOT_BYTES)
    context = peer_context()
    ours, theirs = context.Pipe()
    follower = context.Process(target=target, args=(spec, theirs))
    follower.start()
    return group, follower, ours


def test_shm_all_reduce_and_all_gather_agree_bit_for_bit_across_processes():
    group, follower, ours = _group_with_follower(_follower)
    try:
        x0, local0 = _inputs(0)
        x1, local1 = _inputs(1)
        summed = group.all_reduce(x0.clone())
        gathered = group.all_gather(local0)
        their_sum, their_gather = ours.recv()
        follower.join(30)
        assert follower.exitcode == 0
        # Rank order on both ranks: the same float additions, the same bits.
        assert torch.equal(summed, x0 + x1)
        assert summed.numpy().tobytes() == their_sum
        assert torch.equal(gathered, torch.cat([local0, local1], dim=1))
        assert gathered.numpy().tobytes() == their_gather
    finally:
        group.close()
        follower.kill()


def _gathering_follower(spec: GroupSpec, conn) -> None:
    group = join_group(spec, 1)
    try:
        group.all_gather(torch.ones(4, 4))  # 64 bytes, as rank 0's all-reduce of 16 floats
        conn.send("no error")
    except RuntimeError as exc:
        conn.send(str(exc))


def test_ranks_in_different_collectives_fail_rather_than_mix_numbers():
    group, follower, ours = _group_with_follower(_gathering_follower)
    try:
        with pytest.raises(RuntimeError, match="out of step"):
            group.all_reduce(torch.ones(16))
        assert ours.poll(30)
        assert "out of step" in ours.recv()
    finally:
        follower.join(30)
        group.close()


def test_an_aborted_group_wakes_a_waiting_rank_with_an_error():
    group, _ = ShmGroup.create(2, cpu_kernels.load(), SLOT_BYTES)
    try:
        # No other rank ever arrives; the engine's watcher would abort on its death.
        timer = threading.Thread(target=group.abort)
        with pytest.raises(RuntimeError, match="tensor-parallel rank of this engine failed"):
            timer.start()
            group.all_reduce(torch.ones(16))
        timer.join()
    finally:
        group.close()
