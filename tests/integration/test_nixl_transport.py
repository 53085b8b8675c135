"""NixlTransport between real processes: a prefill process serves a patterned cache
(connector.testing.serve_prefill_cache), this process reads from it over real NIXL/UCX.

Every wait has a deadline (wait_for / expect raise TimeoutError), so a broken transport fails
a test instead of hanging it.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, replace
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess

import pytest
import torch

from connector import testing
from connector.nixl_regions import PeerMetadata
from connector.nixl_transport import FAIL_AFTER_DESCRIPTORS_ENV, NixlTransport
from connector.testing import CacheSpec, PeerInfo, expect, holds_blocks, reap, wait_for
from connector.transport import BlockRead, contiguous_runs
from pdserve.bench import kv
from tests.integration.processes import peer_context

NUM_BLOCKS = 64
BLOCK_BYTES = 4096
STEP_TIMEOUT_S = 30.0
PREFILL = "prefill"


@dataclass
class Prefill:
    process: BaseProcess
    conn: Connection
    peer: PeerInfo

    def stop(self) -> None:
        if self.process.is_alive():
            with contextlib.suppress(OSError):
                self.conn.send(("stop", None))
        reap(self.process)


@dataclass
class Decode:
    transport: NixlTransport
    cache: torch.Tensor


def _unique(role: str) -> str:
    return f"test-{role}-{uuid.uuid4().hex[:8]}"


def start_prefill() -> Prefill:
    ctx = peer_context()
    conn, child_end = ctx.Pipe()
    spec = CacheSpec("nixl", _unique("prefill"), NUM_BLOCKS, BLOCK_BYTES, timeout_s=120.0)
    process = ctx.Process(target=testing.serve_prefill_cache, args=(child_end, spec), daemon=True)
    process.start()
    child_end.close()
    try:
        peer = expect(conn, "ready", STEP_TIMEOUT_S, "prefill process")
    except BaseException:
        reap(process, 1.0)
        raise
    return Prefill(process, conn, peer)


def make_decode(peer: PeerInfo, engine_id: str = PREFILL, **kwargs: float) -> Decode:
    cache = torch.zeros((NUM_BLOCKS, BLOCK_BYTES), dtype=torch.uint8)
    transport = NixlTransport(_unique("decode"), **kwargs)
    transport.register(cache)
    transport.add_remote(engine_id, peer.transport_metadata)
    return Decode(transport, cache)


@pytest.fixture(scope="module")
def prefill() -> Iterator[Prefill]:
    served = start_prefill()
    yield served
    served.stop()


@pytest.fixture(scope="module")
def decode(prefill: Prefill) -> Iterator[Decode]:
    side = make_decode(prefill.peer)
    yield side
    side.transport.close()


def read(transfer_id: str, local: list[int], remote: list[int], engine: str = PREFILL) -> BlockRead:
    return BlockRead(transfer_id, engine, local, remote, lease_id="lease")


# -- contiguous_runs (pure) --------------------------------------------------------------------


def test_contiguous_runs_edge_cases() -> None:
    assert contiguous_runs([], []) == []
    assert contiguous_runs([3], [7]) == [(3, 7, 1)]
    assert contiguous_runs([0, 1, 2, 3, 4], [10, 11, 12, 13, 14]) == [(0, 10, 5)]
    assert contiguous_runs([5, 3, 1], [0, 1, 2]) == [(5, 0, 1), (3, 1, 1), (1, 2, 1)]
    # Consecutive on one side only is not a run.
    assert contiguous_runs([0, 1, 2], [4, 2, 0]) == [(0, 4, 1), (1, 2, 1), (2, 0, 1)]
    assert contiguous_runs([4, 5, 6, 9], [10, 11, 12, 13]) == [(4, 10, 3), (9, 13, 1)]
    with pytest.raises(ValueError):
        contiguous_runs([1, 2], [1])


# -- reads -------------------------------------------------------------------------------------


@pytest.mark.integration
def test_read_copies_exact_bytes_one_descriptor_per_run(decode: Decode) -> None:
    local = [0, 1, 2, 10, 11, 20, 30, 31, 32, 33]
    remote = [5, 6, 7, 40, 41, 3, 60, 61, 62, 63]
    decode.cache.zero_()
    decode.transport.start_read(read("runs", local, remote))
    assert wait_for(decode.transport, "runs", STEP_TIMEOUT_S) is None
    assert decode.transport.last_num_descriptors == len(contiguous_runs(local, remote)) == 4
    assert holds_blocks(decode.cache, local, remote)
    untouched = [b for b in range(NUM_BLOCKS) if b not in local]
    assert not decode.cache[untouched].any()
    assert decode.transport.poll().done == set()  # reported exactly once


@pytest.mark.integration
def test_whole_cache_is_one_descriptor(decode: Decode) -> None:
    every = list(range(NUM_BLOCKS))
    decode.cache.zero_()
    decode.transport.start_read(read("all", every, every))
    assert wait_for(decode.transport, "all", STEP_TIMEOUT_S) is None
    assert decode.transport.last_num_descriptors == 1
    assert holds_blocks(decode.cache, every, every)


@pytest.mark.integration
def test_zero_blocks_done_at_next_poll(decode: Decode) -> None:
    decode.transport.start_read(read("empty", [], []))
    assert decode.transport.last_num_descriptors == 0
    results = decode.transport.poll()
    assert results.done == {"empty"} and not results.failed


@pytest.mark.integration
@pytest.mark.parametrize(
    ("local", "remote", "engine"),
    [
        ([NUM_BLOCKS], [0], PREFILL),  # local id out of range
        ([0], [NUM_BLOCKS], PREFILL),  # remote id out of range
        ([0], [-1], PREFILL),
        ([0, 1], [0], PREFILL),  # lengths differ
        ([2, 2], [0, 1], PREFILL),  # one local block written twice
        ([0], [0], "nobody"),  # never added
    ],
)
def test_bad_reads_raise_value_error(
    decode: Decode, local: list[int], remote: list[int], engine: str
) -> None:
    with pytest.raises(ValueError):
        decode.transport.start_read(read("bad", local, remote, engine))
    assert decode.transport.poll().failed == {}  # nothing was started


@pytest.mark.integration
def test_duplicate_transfer_id_in_flight_raises(decode: Decode) -> None:
    decode.transport.start_read(read("twice", [], []))
    with pytest.raises(ValueError, match="in flight"):
        decode.transport.start_read(read("twice", [], []))
    assert decode.transport.poll().done == {"twice"}


# -- failures ----------------------------------------------------------------------------------


@pytest.mark.integration
def test_injected_failure_mid_read_is_reported_once(decode: Decode) -> None:
    decode.cache.zero_()
    decode.transport.inject_failure(1)
    decode.transport.start_read(read("broken", [0, 1, 5], [10, 11, 30]))
    reason = wait_for(decode.transport, "broken", STEP_TIMEOUT_S)
    assert reason is not None and "injected" in reason
    assert holds_blocks(decode.cache, [0, 1], [10, 11])  # the first run arrived ...
    assert not decode.cache[5].any()  # ... the second never did
    assert decode.transport.poll().failed == {}
    # One-shot: the next read is whole again.
    decode.transport.start_read(read("healed", [5], [30]))
    assert wait_for(decode.transport, "healed", STEP_TIMEOUT_S) is None


@pytest.mark.integration
def test_env_var_arms_failure_of_first_read(
    prefill: Prefill, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(FAIL_AFTER_DESCRIPTORS_ENV, "0")
    side = make_decode(prefill.peer)
    try:
        side.transport.start_read(read("env", [3], [3]))
        assert wait_for(side.transport, "env", STEP_TIMEOUT_S) is not None
        assert not side.cache.any()  # no descriptor was posted
    finally:
        side.transport.close()
    with pytest.raises(RuntimeError, match="closed"):
        side.transport.start_read(read("after-close", [], []))
    side.transport.close()  # idempotent
    monkeypatch.setenv(FAIL_AFTER_DESCRIPTORS_ENV, "soon")
    with pytest.raises(ValueError, match=FAIL_AFTER_DESCRIPTORS_ENV):
        NixlTransport(_unique("decode"))


@pytest.mark.integration
def test_cancel_is_reported_as_failed(decode: Decode) -> None:
    decode.transport.start_read(read("cancel-me", [7, 8], [7, 8]))
    decode.transport.cancel("cancel-me")
    decode.transport.cancel("never-started")  # unknown: a no-op
    assert wait_for(decode.transport, "cancel-me", STEP_TIMEOUT_S) == "cancelled"
    assert decode.transport.poll().failed == {}


# -- peers -------------------------------------------------------------------------------------


@pytest.mark.integration
def test_add_remote_is_idempotent_and_checks_layout(prefill: Prefill, decode: Decode) -> None:
    metadata = prefill.peer.transport_metadata
    decode.transport.add_remote(PREFILL, metadata)  # again: nothing changes
    decode.transport.start_read(read("after-readd", [9], [9]))
    assert wait_for(decode.transport, "after-readd", STEP_TIMEOUT_S) is None
    peer = PeerMetadata.from_bytes(metadata)
    wider = replace(peer, regions=(replace(peer.regions[0], block_bytes=2 * BLOCK_BYTES),))
    with pytest.raises(ValueError, match="incompatible"):
        decode.transport.add_remote("wider", wider.to_bytes())
    with pytest.raises(ValueError, match="malformed"):
        decode.transport.add_remote("garbage", b"not json")
    ourselves = replace(peer, agent_name=decode.transport.agent_name)
    with pytest.raises(ValueError, match="own agent name"):
        decode.transport.add_remote("ourselves", ourselves.to_bytes())


@pytest.mark.integration
def test_read_from_killed_peer_fails_without_hanging() -> None:
    doomed = start_prefill()
    side = make_decode(doomed.peer, engine_id="doomed", read_timeout_s=5.0)
    try:
        side.transport.start_read(read("before", [1], [1], "doomed"))
        assert wait_for(side.transport, "before", STEP_TIMEOUT_S) is None
        doomed.process.kill()
        doomed.process.join(STEP_TIMEOUT_S)
        try:
            side.transport.start_read(read("after", [2], [2], "doomed"))
        except (ValueError, RuntimeError):
            return  # a clear error at once is acceptable too
        reason = wait_for(side.transport, "after", STEP_TIMEOUT_S)
        assert reason is not None
        assert not side.cache[2].any()
    finally:
        side.transport.close()
        doomed.stop()


@pytest.mark.integration
def test_read_from_frozen_peer_ends_by_deadline() -> None:
    """A peer that is alive but never answers (SIGSTOP before the first connection): the read
    cannot be left in flight forever; it ends (failed, or done if UCX needed no answer)."""
    frozen = start_prefill()
    side = make_decode(frozen.peer, engine_id="frozen", read_timeout_s=1.0)
    os.kill(frozen.process.pid or 0, signal.SIGSTOP)
    try:
        started = time.monotonic()
        side.transport.start_read(read("frozen", [4], [4], "frozen"))
        reason = wait_for(side.transport, "frozen", STEP_TIMEOUT_S)
        assert time.monotonic() - started < STEP_TIMEOUT_S
        if reason is None:
            assert holds_blocks(side.cache, [4], [4])
    finally:
        side.transport.close()
        frozen.process.kill()
        reap(frozen.process)


# -- the bench ---------------------------------------------------------------------------------


@pytest.mark.integration
def test_bench_kv_tiny_nixl_run() -> None:
    config = kv.KVBenchConfig(
        transports=("nixl",), num_blocks=32, block_bytes=64 << 10, repeats=2, timeout_s=60.0
    )
    report = kv.run(config)
    assert report["benchmark"] == "kv" and report["memcpy_gbps"] > 0
    nixl = report["transports"]["nixl"]
    assert nixl["integrity"] == "ok"
    assert nixl["bytes"] == 32 * (64 << 10) and nixl["blocks"] == 32
    assert nixl["descriptors"] == 1 and nixl["descriptors_per_block"] == 1 / 32
    assert nixl["gbps"] > 0 and nixl["seconds"] > 0 and nixl["ratio_to_memcpy"] > 0
    # The reader's checksum pass, timed: the verified throughput is the read's with it added.
    assert nixl["checksum_seconds"] > 0 and nixl["checksum_gbps"] > 0
    verified = nixl["bytes"] / (nixl["seconds"] + nixl["checksum_seconds"]) / 1e9
    assert nixl["gbps_verified"] == pytest.approx(verified, abs=0.0015)


@pytest.mark.integration
def test_bench_kv_tiny_grpc_run_reports_the_tcp_ceiling() -> None:
    config = kv.KVBenchConfig(
        transports=("grpc",), num_blocks=16, block_bytes=256 << 10, repeats=2, timeout_s=60.0
    )
    report = kv.run(config)
    grpc = report["transports"]["grpc"]
    assert grpc["integrity"] == "ok" and grpc["bytes"] == 16 * (256 << 10)
    assert report["tcp_loopback_gbps"] > 0
    # The report rounds both figures and the ratio (from the unrounded ones) to 3 places.
    ratio = grpc["gbps"] / report["tcp_loopback_gbps"]
    assert grpc["ratio_to_tcp_loopback"] == pytest.approx(ratio, abs=0.0015)


def test_bench_config_validation() -> None:
    with pytest.raises(ValueError):
        kv.KVBenchConfig(block_bytes=12)
    with pytest.raises(ValueError):
        kv.KVBenchConfig(transports=("carrier-pigeon",))
    with pytest.raises(ValueError):
        kv.KVBenchConfig(layout="diagonal")
