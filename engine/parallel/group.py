"""The collectives a tensor-parallel model calls: all-reduce (after row-parallel projections
and the vocab-parallel embedding) and all-gather (of the vocab-parallel logits).

Three implementations behind one contract:
- `SingleRank`: one rank, nothing to exchange (every engine at tensor_parallel_size 1);
- `ShmGroup`: ranks on one host exchange through shared memory (csrc/shm_collectives.h):
  the default on CPUs, ~10 us a decode step's all-reduce where gloo takes ~1 ms;
- `TorchGroup`: torch.distributed's process groups, gloo on CPUs and NCCL on GPUs.

Both multi-rank groups give every rank the same bits (the shared-memory sum runs in rank
order on every rank; gloo's and NCCL's ring all-reduce computes each element once and copies
it), so the ranks sample the same tokens from the same logits.
"""

from __future__ import annotations

import datetime
import os
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

_SLOT_BYTES = 4 << 20  # a chunk of a collective; two banks of one slot per rank
# How long rank 0 waits for its followers to join (each first imports torch), and gloo for a
# collective.
_STORE_TIMEOUT = datetime.timedelta(seconds=120)


class TPGroup(ABC):
    """This rank's view of its engine's tensor-parallel group. `seconds` is the time this
    rank spent in collectives (exchanging, and waiting for slower ranks): `pdserve bench tp`
    reports it as a share of the step."""

    rank: int
    size: int
    seconds: float = 0.0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of every rank's `x` (x may be overwritten with it)."""
        start = time.perf_counter()
        out = self._all_reduce(x.contiguous())
        self.seconds += time.perf_counter() - start
        return out

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """[rows, cols] from every rank -> [rows, size * cols], rank r's columns at r * cols."""
        start = time.perf_counter()
        out = self._all_gather(x.contiguous())
        self.seconds += time.perf_counter() - start
        return out

    @abstractmethod
    def _all_reduce(self, x: torch.Tensor) -> torch.Tensor: ...

    @abstractmethod
    def _all_gather(self, x: torch.Tensor) -> torch.Tensor: ...

    def abort(self) -> None:  # noqa: B027 - most groups have nothing to wake
        """Fail every rank waiting in a collective (a rank died)."""

    def close(self) -> None:  # noqa: B027 - nor anything to let go of
        """Let go of what the group holds (shared memory, sockets)."""


class SingleRank(TPGroup):
    rank, size = 0, 1

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        return x  # not even timed: every one-rank engine calls this twice a layer

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def _all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def _all_gather(self, x: torch.Tensor) -> torch.Tensor:
        return x


SINGLE_RANK = SingleRank()


@dataclass(frozen=True)
class GroupSpec:
    """How a rank joins its group: what the engine process (rank 0) sends each follower."""

    kind: str  # "shm" | "torch"
    size: int
    parent_pid: int
    shm_path: str = ""
    slot_bytes: int = _SLOT_BYTES
    store_port: int = 0
    device: str = "cpu"


def rank_device(device: str, rank: int) -> torch.device:
    """Where rank `rank` computes: the same CPU, or the rank-th GPU after the configured one
    (a replica of N ranks sees its N GPUs: deployments/app.py reserves them)."""
    base = torch.device(device)
    if base.type != "cuda":
        return base
    return torch.device("cuda", (base.index or 0) + rank)


def choose_collectives(collectives: str, device: torch.device, dtype: str) -> str:
    """`auto`: shared memory for float32 on CPUs (what it sums), torch.distributed otherwise."""
    shm_fits = device.type == "cpu" and dtype == "float32"
    if collectives == "shm" and not shm_fits:
        raise ValueError("collectives 'shm' are for float32 models on CPUs")
    if collectives == "auto":
        return "shm" if shm_fits else "torch"
    return collectives


class ShmGroup(TPGroup):
    def __init__(self, spec: GroupSpec, rank: int, kernel: Any) -> None:
        self.rank, self.size, self.spec = rank, spec.size, spec
        self._kernel = kernel
        nbytes = kernel.shm_region_bytes(spec.size, spec.slot_bytes)
        self.region = torch.from_file(spec.shm_path, shared=True, size=nbytes, dtype=torch.uint8)
        # Rank 0 watches its followers; a follower watches its engine process.
        self._parent = 0 if rank == 0 else spec.parent_pid

    @classmethod
    def create(
        cls, size: int, kernel: Any, slot_bytes: int = _SLOT_BYTES
    ) -> tuple[ShmGroup, GroupSpec]:
        """Rank 0's group and the spec its followers join with. The file lives in /dev/shm
        until every rank has mapped it (`unlink`)."""
        from engine.worker.kv_cache import reserve_shared_file

        nbytes = kernel.shm_region_bytes(size, slot_bytes)
        path = reserve_shared_file("pdserve-tp-", nbytes, "the collectives' slots")
        spec = GroupSpec("shm", size, os.getpid(), shm_path=path, slot_bytes=slot_bytes)
        return cls(spec, 0, kernel), spec

    def unlink(self) -> None:
        Path(self.spec.shm_path).unlink(missing_ok=True)

    def _all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        self._kernel.shm_all_reduce(
            self.region, self.rank, self.size, self.spec.slot_bytes, self._parent, x
        )
        return x

    def _all_gather(self, x: torch.Tensor) -> torch.Tensor:
        out = x.new_empty(x.shape[0], self.size * x.shape[1])
        self._kernel.shm_all_gather(
            self.region, self.rank, self.size, self.spec.slot_bytes, self._parent, x, out
        )
        return out

    def fused_join_args(self) -> tuple[torch.Tensor, int, int, int, int]:
        """What the fused decode step's `join` takes to all-reduce in this group."""
        return self.region, self.rank, self.size, self.spec.slot_bytes, self._parent

    def abort(self) -> None:
        self._kernel.shm_abort(self.region, self.size, self.spec.slot_bytes)

    def close(self) -> None:
        if self.rank == 0:
            self.unlink()


class TorchGroup(TPGroup):
    """torch.distributed: gloo for CPU tensors, NCCL for CUDA ones (a group of its own, not
    the process's default group: a test process may hold several engines)."""

    def __init__(self, spec: GroupSpec, rank: int, store: Any | None = None) -> None:
        import torch.distributed as dist

        self.rank, self.size = rank, spec.size
        if store is None:
            store = dist.TCPStore(
                "127.0.0.1", spec.store_port, spec.size, False, timeout=_STORE_TIMEOUT
            )
        self._store = store
        if torch.device(spec.device).type == "cuda":
            options = dist.ProcessGroupNCCL.Options()
            self._pg: Any = dist.ProcessGroupNCCL(store, rank, spec.size, options)
        else:
            self._pg = dist.ProcessGroupGloo(store, rank, spec.size, _STORE_TIMEOUT)

    @staticmethod
    def host_store(size: int, device: torch.device) -> tuple[Any, GroupSpec]:
        """Rank 0's rendezvous store and the spec its followers join with; rank 0 builds its
        group (`TorchGroup(spec, 0, store)`) once they are started: building it waits for them."""
        import torch.distributed as dist

        store = dist.TCPStore(
            "127.0.0.1", 0, size, True, timeout=_STORE_TIMEOUT, wait_for_workers=False
        )
        return store, GroupSpec(
            "torch", size, os.getpid(), store_port=store.port, device=str(device)
        )

    def _all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        self._pg.allreduce([x]).wait()
        return x

    def _all_gather(self, x: torch.Tensor) -> torch.Tensor:
        parts = [torch.empty_like(x) for _ in range(self.size)]
        self._pg.allgather([parts], [x]).wait()
        return torch.cat(parts, dim=1)


def join_group(spec: GroupSpec, rank: int) -> TPGroup:
    """A follower's side of the group rank 0 created."""
    if spec.kind == "shm":
        from engine.layers import cpu_kernels

        return ShmGroup(spec, rank, cpu_kernels.load())
    return TorchGroup(spec, rank)
