"""`pdserve bench kv`: KV block transfer between two processes, against a single-thread memcpy.

Over the harness of connector/testing.py: a "prefill" process serves a patterned cache; a
"decode" process registers its own cache, adds the prefill side as a remote and reads every
block, timed (one warm-up read of one block first: it pays for the connection). Every timed
read lands in a zeroed cache and is checked byte for byte. Layouts:
- contiguous: local block i <- remote block i, one run, so NIXL needs one descriptor;
- scattered: local ids a seeded permutation, about one descriptor per block.
The parent relays what a handshake would carry (NIXL: the transport metadata; gRPC: the side
channel's port and a lease over every block) and keeps time limits, so a stuck transport fails
the bench instead of hanging it. The reference is `dst.copy_(src)` of the same bytes between
two pre-touched buffers on one thread. With gRPC in the run, the bench also measures raw TCP
over loopback between two processes (`tcp_loopback_gbps`): the most any TCP transport can
carry here, and gRPC's `ratio_to_tcp_loopback`. After each timed read the decode process
checksums the blocks it read, as an engine does before computing from them
(engine/block_checksums.py): `gbps_verified` is the throughput with that pass,
`checksum_overhead` its time over the read's.
"""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing as mp
import statistics
import time
import uuid
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from multiprocessing.connection import Connection
from typing import Any

import torch

from connector.testing import (
    REMOTE_ENGINE_ID,
    CacheSpec,
    PeerInfo,
    connect,
    expect,
    holds_blocks,
    reap,
    send_error,
    serve_prefill_cache,
    wait_for,
)
from connector.transport import BlockRead, KVTransport
from engine.block_checksums import block_checksums
from engine.config import KV_TRANSPORTS, check_transport
from engine.worker.host_memory import zeros_on_huge_pages
from pdserve.bench.tcp_ceiling import tcp_loopback_gbps
from pdserve.flags import Flag

DEFAULT_BLOCK_BYTES = 1 << 20  # an 8B model's 16-token block is 2 MiB; 1 MiB sits near it
DEFAULT_TOTAL_BYTES = 256 << 20
TRANSPORTS = KV_TRANSPORTS
LAYOUTS = ("contiguous", "scattered")


@dataclass(frozen=True)
class KVBenchConfig:
    transports: tuple[str, ...] = TRANSPORTS
    """the transports to measure, one after the other (nixl, grpc, or both)"""
    num_blocks: int = 0
    """blocks to move (0: 256 MiB worth)"""
    block_bytes: int = DEFAULT_BLOCK_BYTES
    """bytes of one block (an 8B model's 16-token block is 2 MiB)"""
    repeats: int = 3
    """timed reads per transport"""
    layout: str = "contiguous"
    """contiguous (one run of block ids) or scattered (a seeded permutation)"""
    seed: int = 0
    """the scattered layout's permutation"""
    timeout_s: float = 120.0
    """seconds per step (start-up, one read): the bench fails instead of hanging"""

    def __post_init__(self) -> None:
        if self.num_blocks == 0 and self.block_bytes > 0:
            object.__setattr__(self, "num_blocks", max(1, DEFAULT_TOTAL_BYTES // self.block_bytes))
        if self.num_blocks < 1 or self.repeats < 1:
            raise ValueError(
                f"num_blocks and repeats must be >= 1, got {self.num_blocks}, {self.repeats}"
            )
        if self.block_bytes < 8 or self.block_bytes % 8:
            raise ValueError(
                f"block_bytes must be a positive multiple of 8, got {self.block_bytes}"
            )
        if self.layout not in LAYOUTS:
            raise ValueError(f"unknown layout {self.layout!r}; choose one of {LAYOUTS}")
        if not self.transports:
            raise ValueError(f"transports must be among {TRANSPORTS}, got none")
        for name in self.transports:
            check_transport(name)
        if self.timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {self.timeout_s}")

    @property
    def total_bytes(self) -> int:
        return self.num_blocks * self.block_bytes


def block_ids(config: KVBenchConfig) -> tuple[list[int], list[int]]:
    """(local ids, remote ids) of the read, per layout."""
    remote = list(range(config.num_blocks))
    if config.layout == "contiguous":
        return remote, remote
    generator = torch.Generator().manual_seed(config.seed)
    return torch.randperm(config.num_blocks, generator=generator).tolist(), remote


# -- the two processes ------------------------------------------------------------------------


def _decode_reads(conn: Connection, spec: CacheSpec, config: KVBenchConfig) -> dict[str, Any]:
    # Pre-touched, on huge pages where available, as engines allocate their KV caches.
    cache = zeros_on_huge_pages((spec.num_blocks, spec.block_bytes), torch.uint8)
    if not conn.poll(spec.timeout_s):
        raise TimeoutError("no word from the prefill process")
    peer: PeerInfo = conn.recv()[1]
    transport, close = connect(spec, cache, peer)
    local, remote = block_ids(config)
    lease = peer.lease_id
    t0 = time.perf_counter()
    _read(transport, "warm-up", ([0], [0]), lease, spec.timeout_s)  # pays for the connection
    connect_seconds = time.perf_counter() - t0
    seconds, verify_seconds, intact = [], [], True
    for repeat in range(config.repeats):
        cache.zero_()  # untimed: a stale copy from the previous repeat must not pass the check
        t0 = time.perf_counter()
        _read(transport, f"read-{repeat}", (local, remote), lease, spec.timeout_s)
        seconds.append(time.perf_counter() - t0)
        # What an engine adds before using the blocks: their checksums, to compare.
        t0 = time.perf_counter()
        block_checksums(cache, local)
        verify_seconds.append(time.perf_counter() - t0)
        intact = intact and holds_blocks(cache, local, remote)
    descriptors = getattr(transport, "last_num_descriptors", None)  # NIXL's, per read
    close()
    report = _report(config, seconds, connect_seconds, descriptors, intact)
    return {**report, **_verification(config, seconds, verify_seconds)}


def _verification(
    config: KVBenchConfig, seconds: list[float], verify_seconds: list[float]
) -> dict[str, Any]:
    """The reader's checksum pass over the blocks read (the producer makes the same pass once
    per prefill): its speed, and the transfer's throughput with it added."""
    read, verify = statistics.median(seconds), statistics.median(verify_seconds)
    return {
        "checksum_seconds": round(verify, 6),
        "checksum_gbps": round(config.total_bytes / verify / 1e9, 3),
        "gbps_verified": round(config.total_bytes / (read + verify) / 1e9, 3),
        "checksum_overhead": round(verify / read, 4),
    }


def _read(
    transport: KVTransport,
    transfer_id: str,
    ids: tuple[list[int], list[int]],
    lease_id: str,
    timeout_s: float,
) -> None:
    transport.start_read(BlockRead(transfer_id, REMOTE_ENGINE_ID, ids[0], ids[1], lease_id))
    failure = wait_for(transport, transfer_id, timeout_s)
    if failure is not None:
        raise RuntimeError(f"read {transfer_id} failed: {failure}")


def _report(
    config: KVBenchConfig,
    seconds: list[float],
    connect_seconds: float,
    descriptors: int | None,
    intact: bool,
) -> dict[str, Any]:
    median = statistics.median(seconds)
    return {
        "gbps": round(config.total_bytes / median / 1e9, 3),
        "gbps_best": round(config.total_bytes / min(seconds) / 1e9, 3),
        "seconds": round(median, 6),
        "seconds_all": [round(s, 6) for s in seconds],
        "connect_seconds": round(connect_seconds, 6),
        "bytes": config.total_bytes,
        "blocks": config.num_blocks,
        "descriptors": descriptors,
        "descriptors_per_block": None if descriptors is None else descriptors / config.num_blocks,
        "integrity": "ok" if intact else "mismatch",
    }


def decode_worker(conn: Connection, spec: CacheSpec, config: KVBenchConfig) -> None:
    """Child process: waits for ("remote", PeerInfo), reads, sends ("result", report)."""
    try:
        conn.send(("result", _decode_reads(conn, spec, config)))
    except Exception:
        send_error(conn)


# -- the parent -------------------------------------------------------------------------------


def _bench_transport(name: str, config: KVBenchConfig) -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    tag = uuid.uuid4().hex[:8]
    # Start-up, warm-up, then each repeat gets its own time limit; the prefill side outlives it.
    limit = config.timeout_s * (config.repeats + 2)
    shape = (config.num_blocks, config.block_bytes)
    prefill_spec = CacheSpec(name, f"kv-bench-prefill-{tag}", *shape, limit + config.timeout_s)
    decode_spec = CacheSpec(name, f"kv-bench-decode-{tag}", *shape, config.timeout_s)
    prefill_conn, prefill_end = ctx.Pipe()
    decode_conn, decode_end = ctx.Pipe()
    prefill = ctx.Process(target=serve_prefill_cache, args=(prefill_end, prefill_spec), daemon=True)
    decode = ctx.Process(target=decode_worker, args=(decode_end, decode_spec, config), daemon=True)
    try:
        prefill.start()
        decode.start()
        prefill_end.close()  # ours closed, a dead child reads as EOF instead of silence
        decode_end.close()
        peer = expect(prefill_conn, "ready", config.timeout_s, "prefill process")
        decode_conn.send(("remote", peer))
        report: dict[str, Any] = expect(decode_conn, "result", limit, "decode process")
        prefill_conn.send(("stop", None))
        return report
    finally:
        reap(decode)
        reap(prefill)


@contextlib.contextmanager
def _torch_threads(num_threads: int) -> Iterator[None]:
    previous = torch.get_num_threads()
    torch.set_num_threads(num_threads)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def memcpy_gbps(num_bytes: int, repeats: int) -> float:
    """Single-thread copy of `num_bytes` between two pre-touched buffers, median GB/s. The
    buffers get the same (huge) pages as the caches, so the page size favours neither side."""
    src = zeros_on_huge_pages((num_bytes,), torch.uint8).fill_(7)
    dst = zeros_on_huge_pages((num_bytes,), torch.uint8)
    seconds = []
    with _torch_threads(1):
        dst.copy_(src)  # warm-up
        for _ in range(repeats):
            t0 = time.perf_counter()
            dst.copy_(src)
            seconds.append(time.perf_counter() - t0)
    return num_bytes / statistics.median(seconds) / 1e9


def run(config: KVBenchConfig) -> dict[str, Any]:
    results = {name: _bench_transport(name, config) for name in config.transports}
    # Measured after the children are gone, so that nothing competes for the cores.
    repeats = max(3, config.repeats)
    reference = memcpy_gbps(config.total_bytes, repeats)
    for report in results.values():
        if "gbps" in report:
            report["ratio_to_memcpy"] = round(report["gbps"] / reference, 3)
    summary = {"benchmark": "kv", "config": asdict(config), "memcpy_gbps": round(reference, 3)}
    grpc = results.get("grpc", {})
    if "gbps" in grpc:
        # What the gRPC transport's wire can carry here at all (see tcp_ceiling).
        tcp = tcp_loopback_gbps(config.total_bytes, repeats, config.timeout_s)
        summary["tcp_loopback_gbps"] = round(tcp, 3)
        grpc["ratio_to_tcp_loopback"] = round(grpc["gbps"] / tcp, 3)
    return {**summary, "transports": results}


def _transports(text: str) -> tuple[str, ...]:
    if text == "both":
        return TRANSPORTS
    if text not in TRANSPORTS:
        raise argparse.ArgumentTypeError(f"--transport takes {', '.join(TRANSPORTS)} or both")
    return (text,)


CONFIG = KVBenchConfig
FLAGS = {
    "transports": Flag(name="--transport", parse=_transports, metavar="{nixl,grpc,both}"),
    "layout": Flag(choices=LAYOUTS),
    "timeout_s": Flag(name="--timeout"),
}
