"""Cores of its own for each engine replica on a CPU node.

An engine replica computes with as many threads as it has CPUs (Ray's `num_cpus` for it), and
on a CPU node those threads are pinned to cores no other engine replica on the node holds:
a prefill burst on one replica then cannot take cycles from a decode step on another, which
is the latency isolation disaggregation is for (unpinned, the kernel spreads every replica's
threads over every core, and each OpenMP barrier waits for the slowest thread).

Replicas on one node agree without a coordinator: each core has a lock file, and a replica
takes the cores whose files it can `flock` without waiting, all it needs or none. The kernel
drops a lock when its holder exits, however it exits (a SIGKILLed replica too), so a
replacement finds the cores free. A replica that finds too few free cores, or holds less than
one CPU, is not pinned: it shares the cores, with one thread per whole CPU (at least one).
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import math
import os
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

logger = logging.getLogger(__name__)


def default_lock_dir() -> Path:
    """Per machine, shared by every process on it (/dev/shm: memory, gone at reboot)."""
    base = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())
    return Path(os.environ.get("PDSERVE_CORE_LOCK_DIR", base / "pdserve-cores"))


@dataclass
class CoreClaim:
    """Cores held by this process (the locks live as long as the file descriptors)."""

    cores: tuple[int, ...]
    _fds: list[int] = field(default_factory=list, repr=False)

    def release(self) -> None:
        for fd in self._fds:
            os.close(fd)  # closing the descriptor drops its lock
        self._fds.clear()


def claim_cores(count: int, allowed: Sequence[int], lock_dir: Path) -> CoreClaim | None:
    """`count` cores of `allowed` that no other process holds, lowest first; None (holding
    nothing) when fewer are free."""
    if count < 1 or count > len(allowed):
        return None
    claim = CoreClaim(())
    cores: list[int] = []
    try:
        lock_dir.mkdir(parents=True, exist_ok=True)
        for core in sorted(allowed):
            fd = os.open(lock_dir / f"core-{core}.lock", os.O_RDONLY | os.O_CREAT, 0o666)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                continue
            claim._fds.append(fd)
            cores.append(core)
            if len(cores) == count:
                claim.cores = tuple(cores)
                return claim
    except OSError as exc:  # a lock directory we may not write, no descriptors left: unpinned
        logger.warning("cannot claim cores in %s: %s", lock_dir, exc)
    claim.release()
    return None


def pin_process_threads(cores: Sequence[int]) -> None:
    """Every thread of this process, and those it starts later (they inherit the mask of the
    thread that starts them), onto `cores`. `sched_setaffinity(0)` alone would move only the
    calling thread."""
    for tid in os.listdir("/proc/self/task"):
        with contextlib.suppress(ProcessLookupError):  # the thread ended meanwhile
            os.sched_setaffinity(int(tid), cores)


def rank_0_cores(cores: Sequence[int], ranks: int) -> tuple[int, ...]:
    """Rank 0's equal share of a replica's `cores` (the other ranks take the later shares:
    engine/parallel/layout.py's split, which they pin themselves by); none where there is
    not a core each.

    # cores (4, 5, 6, 7), 2 ranks -> (4, 5); 3 ranks -> (4,); 5 ranks -> ()
    """
    from engine.parallel.layout import cores_by_rank

    return cores_by_rank(list(cores), ranks, len(cores) // ranks)[0]


@dataclass(frozen=True)
class Placement:
    """Where an engine replica computes (logged)."""

    num_threads: int
    cores: tuple[int, ...] = ()  # () when not pinned
    why: str = ""  # why not pinned


def place_engine(
    num_cpus: float, lock_dir: Path | None = None, allowed: Sequence[int] | None = None
) -> tuple[Placement, CoreClaim | None]:
    """Pin this process to `num_cpus` free cores where it can; set torch's thread count to
    its whole CPUs either way. Keep the claim for the process's lifetime."""
    import torch

    cores = sorted(os.sched_getaffinity(0) if allowed is None else allowed)
    # Ray's CPUs are logical: never more threads than the cores this process may run on.
    threads = max(1, min(math.floor(num_cpus), len(cores)))
    claim = None
    why = ""
    if num_cpus < 1:
        why = f"holds {num_cpus:g} CPU"
    else:
        claim = claim_cores(threads, cores, lock_dir or default_lock_dir())
        if claim is None:
            why = f"fewer than {threads} of the node's {len(cores)} cores are free"
    if claim is not None:
        pin_process_threads(claim.cores)
    torch.set_num_threads(threads)
    placement = Placement(threads, claim.cores if claim else (), why)
    if claim is not None:
        logger.info("engine threads: %d, pinned to cores %s", threads, list(claim.cores))
    else:
        logger.info("engine threads: %d, not pinned (%s)", threads, why)
    return placement, claim
