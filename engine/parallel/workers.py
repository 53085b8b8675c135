"""Rank 0 and its followers: one process per tensor-parallel rank.

The engine process is rank 0: it runs the scheduler and its own model runner. Ranks 1..n-1
are processes it starts (`multiprocessing`'s spawn: nothing of the engine's threads or
sockets is inherited). Each builds the same model runner over its slice of the model and
then, step after step, receives the scheduler's output from rank 0 through a pipe and runs
it: the same inputs, its own heads, the collectives in the model (engine/parallel/group.py)
join the ranks' halves. Every rank samples, from the same gathered logits with the same
seeds, so each keeps its own batch without being sent tokens; rank 0 still sends its
previous step's tokens with each step, and a rank that sampled different ones stops the
engine rather than compute a wrong token from a diverged batch.

A rank that dies fails the engine: rank 0 watches its followers' processes and aborts the
group's collectives (an error, not a hang), and a follower exits when rank 0's pipe closes.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import pickle
import threading
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from typing import Any

import torch

from engine.config import EngineConfig
from engine.models.config import ModelArchConfig
from engine.parallel.group import (
    GroupSpec,
    ShmGroup,
    TorchGroup,
    TPGroup,
    choose_collectives,
    join_group,
    rank_device,
)
from engine.parallel.layout import cores_by_rank
from engine.worker.kv_cache import allocate_kv_cache, create_shared_kv_file, map_shared_kv_cache

logger = logging.getLogger(__name__)

_JOIN_TIMEOUT_S = 300.0  # a follower imports torch and loads its slice of the model first
_CLOSE_TIMEOUT_S = 10.0
_SPAWN_HINT = (
    " before joining (a script that builds an engine with tensor_parallel_size > 1 must do so"
    ' under `if __name__ == "__main__":`: each rank\'s process imports the script again)'
)

# The previous step's sampled tokens, by request: what every rank must have sampled.
Sampled = tuple[list[str], list[list[int]]]


class TensorParallelError(RuntimeError):
    """A rank of this engine failed (died, or diverged); the engine cannot go on."""


@dataclass(frozen=True)
class FollowerArgs:
    config: EngineConfig
    arch: ModelArchConfig
    spec: GroupSpec
    rank: int
    threads: int
    cores: tuple[int, ...]  # empty: not pinned


class Followers:
    """Rank 0's handle on ranks 1..n-1."""

    def __init__(self, config: EngineConfig, arch: ModelArchConfig, size: int) -> None:
        self.size = size
        self.threads = max(1, torch.get_num_threads() // size)
        self._conns: list[Connection] = []
        self._procs: list[Any] = []
        self._failure: str | None = None
        self._closed = False
        self._lock = threading.Lock()  # the pipes are read from the watcher and the engine
        self._shm: ShmGroup | None = None
        try:
            self.group = self._start(config, arch)
            self._expect("joined")  # every rank has mapped the region: it may go
        except BaseException:
            self.close()
            raise
        if self._shm is not None:
            self._shm.unlink()
        self._watcher = threading.Thread(target=self._watch, name="pdserve-tp-watch", daemon=True)
        self._watcher.start()

    def _start(self, config: EngineConfig, arch: ModelArchConfig) -> TPGroup:
        """Start ranks 1..n-1; rank 0's side of their group."""
        device = torch.device(config.model.device)
        kind = choose_collectives(config.parallel.collectives, device, config.model.dtype)
        store = None
        if kind == "shm":
            from engine.layers import cpu_kernels

            self._shm, spec = ShmGroup.create(self.size, cpu_kernels.load())
        else:
            store, spec = TorchGroup.host_store(self.size, device)
        ctx = multiprocessing.get_context("spawn")
        # Followers pin themselves to their share; rank 0 is the caller's process, whose
        # threads are its own to place (a Serve replica keeps to rank 0's share).
        affinity = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
        cores = cores_by_rank(affinity, self.size, self.threads)
        for rank in range(1, self.size):
            ours, theirs = ctx.Pipe()
            args = FollowerArgs(config, arch, spec, rank, self.threads, cores[rank])
            process = ctx.Process(
                target=follower_main, args=(theirs, args), name=f"pdserve-tp{rank}", daemon=True
            )
            process.start()
            theirs.close()
            self._conns.append(ours)
            self._procs.append(process)
        return self._shm if self._shm is not None else TorchGroup(spec, 0, store)

    @property
    def pids(self) -> list[int]:
        return [process.pid for process in self._procs]

    # ------------------------------------------------------------------ set-up

    def wait_loaded(self) -> None:
        """Every follower has built its runner and loaded its slice of the model."""
        self._expect("loaded")

    def initialize_kv_cache(
        self, num_blocks: int, shared_path: str | None, share_back: bool = False
    ) -> list[torch.Tensor | str | None]:
        """Rank 0 sized the cache: every rank allocates as many blocks of its own heads, or
        maps the cache of every head rank 0 made at `shared_path`. `share_back`: each sends
        its own cache back, for this process to map (a /dev/shm file's path on CPUs, a CUDA
        IPC handle on GPUs): what each of ranks 1..n-1 sent, in rank order (None without)."""
        for conn in self._conns:
            conn.send((num_blocks, shared_path, share_back))
        return self._expect("kv_ready")

    def _expect(self, what: str) -> list[Any]:
        """Each follower's `what` message's detail, in rank order (an error: raised)."""
        details = []
        for rank, conn in enumerate(self._conns, start=1):
            if not conn.poll(_JOIN_TIMEOUT_S):
                raise TensorParallelError(f"tensor-parallel rank {rank} did not get {what} in time")
            try:
                kind, detail = conn.recv()
            except EOFError:
                hint = _SPAWN_HINT if what == "joined" else ""
                raise TensorParallelError(f"tensor-parallel rank {rank} exited{hint}") from None
            if kind != what:
                raise TensorParallelError(f"tensor-parallel rank {rank} failed: {detail}")
            details.append(detail)
        return details

    # ------------------------------------------------------------------ steps

    def send_step(self, scheduler_output: Any, previous: Sampled | None) -> None:
        """The step's inputs to every follower, before rank 0 runs it too."""
        if self._failure is not None:
            raise TensorParallelError(self._failure)
        message = pickle.dumps(
            (scheduler_output.for_workers(), previous), protocol=pickle.HIGHEST_PROTOCOL
        )
        try:
            for conn in self._conns:
                conn.send_bytes(message)
        except OSError:
            raise TensorParallelError(self.failure() or "a tensor-parallel rank exited") from None

    def failure(self, wait_s: float = 0.0) -> str | None:
        """Why the group failed, once a rank died or said why (None: it did not). `wait_s`:
        how long to wait for a rank's reason (rank 0 woke from an aborted collective: the
        rank that aborted it sends why just before)."""
        with self._lock:
            for rank, conn in enumerate(self._conns, start=1):
                try:
                    if self._failure is None and conn.poll(wait_s):
                        kind, detail = conn.recv()
                        if kind == "error":
                            self._failure = f"tensor-parallel rank {rank} failed: {detail}"
                except (EOFError, OSError):
                    continue
            return self._failure

    def _watch(self) -> None:
        """A follower that exits while the engine runs fails every rank's collectives."""
        sentinels = {p.sentinel: rank for rank, p in enumerate(self._procs, start=1)}
        ready = wait(list(sentinels))
        if self._closed:
            return
        rank = sentinels[ready[0]]
        process = self._procs[rank - 1]
        process.join(1.0)  # reaped: its exit code is known
        reason = self.failure() or f"tensor-parallel rank {rank} exited (code {process.exitcode})"
        with self._lock:
            self._failure = reason
        logger.error("%s; the engine stops", reason)
        self.group.abort()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._shm is not None:
            self._shm.unlink()  # gone already once every rank joined
        for conn in self._conns:
            with contextlib.suppress(OSError):
                conn.send_bytes(b"")  # the follower's loop ends
        for process in self._procs:
            process.join(_CLOSE_TIMEOUT_S)
            if process.is_alive():
                process.kill()
                process.join(_CLOSE_TIMEOUT_S)
        for conn in self._conns:
            conn.close()
        if hasattr(self, "group"):
            self.group.close()


def start_followers(config: EngineConfig, arch: ModelArchConfig) -> Followers | None:
    """Ranks 1..n-1 of an engine at tensor_parallel_size n, started (None at 1). Rank 0, the
    calling process, computes with as many threads as each follower."""
    size = config.parallel.tensor_parallel_size
    if size == 1:
        return None
    followers = Followers(config, arch, size)
    torch.set_num_threads(followers.threads)
    return followers


# ---------------------------------------------------------------------- follower process


def follower_main(conn: Connection, args: FollowerArgs) -> None:
    """A follower rank: join the group, load the slice, then run each step rank 0 sends."""
    logging.basicConfig(level=logging.WARNING)  # to stderr: stdout is the caller's
    torch.set_num_threads(args.threads)
    if args.cores:
        os.sched_setaffinity(0, args.cores)
    group: TPGroup | None = None
    try:
        device = rank_device(args.config.model.device, args.rank)
        if device.type == "cuda":
            torch.cuda.set_device(device)  # NCCL binds the group to the current device
        group = join_group(args.spec, args.rank)
        conn.send(("joined", None))
        runner = _build_runner(args, group)
        conn.send(("loaded", None))
        num_blocks, shared_path, share_back = conn.recv()
        cache, shared_back = _follower_cache(runner, num_blocks, shared_path, share_back)
        runner.initialize_kv_cache(num_blocks, cache)
        conn.send(("kv_ready", shared_back))
        _run_steps(conn, runner)
    except (EOFError, BrokenPipeError):
        pass  # rank 0 is gone: nothing to report to
    except BaseException as exc:  # reported to rank 0, which fails the engine
        logger.exception("tensor-parallel rank %d failed", args.rank)
        with contextlib.suppress(OSError):
            conn.send(("error", _one_line(exc)))  # first: rank 0 reads it once woken
        if group is not None:
            group.abort()
        raise SystemExit(1) from None


def _follower_cache(
    runner: Any, num_blocks: int, shared_path: str | None, share_back: bool
) -> tuple[torch.Tensor | None, Any]:
    """(the cache this rank uses — None: the runner makes its own —, what rank 0 maps it
    by). The cache every rank shares is at `shared_path`. One rank 0 is to map too: on CPUs
    a /dev/shm file of its own, its pages reserved now (a full /dev/shm is a ValueError at
    start, not a SIGBUS mid-step), sent as its path; on GPUs the tensor, sent as a CUDA IPC
    handle by torch's reductions."""
    spec = runner.kv_cache_spec()
    if shared_path is not None:
        return map_shared_kv_cache(shared_path, spec, num_blocks), None
    if not share_back:
        return None, None
    if runner.device.type == "cpu":
        path = create_shared_kv_file(spec, num_blocks)
        return map_shared_kv_cache(path, spec, num_blocks), path
    cache = allocate_kv_cache(spec, num_blocks, runner.device)
    return cache, cache


def _one_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0]}" if lines else type(exc).__name__


def _build_runner(args: FollowerArgs, group: TPGroup) -> Any:
    from engine.inputs import InputProcessor
    from engine.parallel.layout import TPLayout
    from engine.worker.model_runner import ModelRunner

    inputs = InputProcessor(args.config, args.arch)
    layout = TPLayout(args.arch, args.rank, args.spec.size)
    runner = ModelRunner(
        args.config, args.arch, inputs.reasoning_tokens, inputs.tokenizer, layout, group
    )
    runner.load_model()
    return runner


def _run_steps(conn: Connection, runner: Any) -> None:
    previous: Sampled | None = None
    while True:
        message = conn.recv_bytes()
        if not message:
            return
        scheduler_output, expected = pickle.loads(message)
        if expected is not None and expected != previous:
            raise TensorParallelError(
                "this rank sampled other tokens than rank 0 in the previous step"
            )
        output = runner.execute_model(scheduler_output)
        previous = (output.req_ids, output.sampled_token_ids)
