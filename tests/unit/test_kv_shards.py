"""connector/kv_shards.py: how a read maps one engine's KV shards onto another's, and the
checksum of a block held in several shards (the engines and transports moving them:
tests/model/test_tp_disaggregation.py)."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch

from connector.grpc_transport import GrpcTransport
from connector.kv_reads import KVReads
from connector.kv_shards import Piece, ShardSet, combine, plan_pieces, shard_weight, wire_shards
from connector.metadata import ConnectorMetadata, LoadSpec
from connector.nixl_regions import CacheRegion, PeerMetadata
from connector.pd_connector import PDConnector
from connector.transport import BlockRead, KVTransport, TransferResults
from engine.block_checksums import block_checksums, block_sums
from engine.config import KVTransferConfig
from engine.worker.kv_cache import KVShard
from tests.waiting import wait_until


def test_engines_of_one_layout_read_every_piece_in_place():
    assert plan_pieces([], []) == [Piece(0, 0, True, 0, 0, 0)]  # one shard each side
    assert plan_pieces([(0, 2), (2, 2)], [(0, 2), (2, 2)]) == [
        Piece(0, 0, True, 0, 0, 2),
        Piece(1, 1, True, 0, 0, 2),
    ]


def test_fewer_ranks_read_every_producer_shard_through_staging():
    # Decode at one rank (every head) from prefill at two (heads 0-1, 2-3).
    assert plan_pieces([], [(0, 2), (2, 2)]) == [
        Piece(0, 0, False, 0, 0, 2),
        Piece(0, 1, False, 0, 2, 2),
    ]


def test_more_ranks_read_the_heads_they_need_from_the_shard_holding_them():
    # Decode at two ranks from prefill at one: each takes its half of the one shard.
    assert plan_pieces([(0, 2), (2, 2)], []) == [
        Piece(0, 0, False, 0, 0, 2),
        Piece(1, 0, False, 2, 0, 2),
    ]
    # 4 ranks over 2 KV heads replicate them: each head is read from the first rank holding
    # it, and every local rank holding a head gets it.
    replicated = [(0, 1), (0, 1), (1, 1), (1, 1)]
    assert wire_shards(replicated) == [0, 2]
    assert plan_pieces(replicated, []) == [
        Piece(0, 0, False, 0, 0, 1),
        Piece(1, 0, False, 0, 0, 1),
        Piece(2, 0, False, 1, 0, 1),
        Piece(3, 0, False, 1, 0, 1),
    ]
    assert plan_pieces([], replicated) == [
        Piece(0, 0, False, 0, 0, 1),
        Piece(0, 2, False, 0, 1, 1),
    ]


def test_layouts_that_do_not_map_are_refused_by_name():
    with pytest.raises(ValueError, match="cannot map KV heads: we hold 4, the remote 8"):
        plan_pieces([(0, 2), (2, 2)], [(0, 4), (4, 4)])
    with pytest.raises(ValueError, match=r"cannot map KV heads 0\.\.2"):
        plan_pieces([(0, 3), (3, 1)], [(0, 1), (2, 2)])  # head 1 held by nobody
    with pytest.raises(ValueError, match="overlap"):
        plan_pieces([(0, 4)], [(0, 3), (2, 2)])  # head 2 twice, head 3 held
    # One shard of every head knows how many from its shape: another count is refused.
    one = ShardSet(torch.zeros(8, 2, 2, 4, 4, 8))
    assert one.layout == [(0, 4)] and one.ranges == []  # nothing announced for one shard
    with pytest.raises(ValueError, match="we hold 4, the remote 8"):
        plan_pieces(one.layout, [(0, 4), (4, 4)])


def _cache(num_blocks: int, heads: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(num_blocks, 2, 2, 4, heads, 8, generator=generator)


def test_one_shard_sums_as_a_whole_cache_does_and_several_combine():
    cache = _cache(6, 4, seed=1)
    assert ShardSet(cache).checksums([1, 4]) == block_checksums(cache, [1, 4])
    halves = [cache[..., :2, :].contiguous(), cache[..., 2:, :].contiguous()]
    split = ShardSet([KVShard(halves[0], 0), KVShard(halves[1], 2)])
    assert split.ranges == [(0, 2), (2, 2)]
    low, high = block_sums(halves[0], [3])[0], block_sums(halves[1], [3])[0]
    assert split.checksums([3]) == [f"{(low + shard_weight(1) * high) % 2**64:016x}"]
    assert combine([low]) == low
    # A replica of a shard is not summed twice (its bytes are the first one's).
    replicas = ShardSet([KVShard(halves[0], 0), KVShard(halves[0].clone(), 0)])
    assert replicas.wire == [0]
    assert replicas.checksums([3]) == [f"{low:016x}"]


def test_a_flipped_bit_in_any_shard_changes_the_combination():
    halves = [_cache(2, 2, seed=2), _cache(2, 2, seed=3)]
    split = ShardSet([KVShard(halves[0], 0), KVShard(halves[1], 2)])
    before = split.checksums([0])
    for half in halves:
        words = half.view(torch.int32).view(-1)
        words[17] ^= 1 << 9
        assert split.checksums([0]) != before
        words[17] ^= 1 << 9
        assert split.checksums([0]) == before


# -- reads between engines of other layouts, over a real side channel (gRPC) ----------------

SECRET = "s3cret"


class _SecondPieceRefused(GrpcTransport):
    """gRPC reads, but a load's second piece cannot start (its first has by then)."""

    def start_read(self, read: BlockRead) -> None:
        if read.transfer_id.endswith("#1"):
            raise ValueError("no room for the second piece")
        super().start_read(read)


@pytest.fixture
def producer():
    """A two-shard producer (heads 0-1, 2-3), as rank 0 of two ranks with caches of their own."""
    conn = PDConnector(KVTransferConfig(connector="grpc", secret=SECRET), "p-0", "h", 4)
    conn.register_kv_caches([KVShard(_cache(8, 2, seed=4), 0), KVShard(_cache(8, 2, seed=5), 2)])
    yield conn
    conn.close()


def _reader(transport: GrpcTransport) -> KVReads:
    shards = ShardSet(torch.zeros(8, 2, 2, 4, 4, 8))  # one rank: every head
    transport.register(shards.caches)
    reads = KVReads(KVTransferConfig(connector="grpc", secret=SECRET), "d-0", "h", transport)
    reads.register(shards)
    return reads


def _finished(reads: KVReads, request_id: str) -> bool:
    return wait_until(lambda: request_id in reads.get_finished(), timeout_s=10)


def test_a_read_of_every_producer_shard_lands_each_ones_heads_in_place(producer):
    remote = producer.worker.lease_blocks("req", [1, 2], list(range(8)))
    reads = _reader(GrpcTransport())
    try:
        reads.start(
            ConnectorMetadata(loads=[LoadSpec("r", remote, [3, 5], [1, 2], remote.block_checksums)])
        )
        assert _finished(reads, "r")
        assert reads.take_load_problems() == {} and reads.take_invalid_block_ids() == set()
        assert reads.stats["pieces_staged"] == 2 and reads.stats["blocks_verified"] == 2
        shards = producer.worker._shards.caches
        got = reads._shards.caches[0]
        assert torch.equal(got[[3, 5]], torch.cat([shards[0][[1, 2]], shards[1][[1, 2]]], dim=4))
    finally:
        reads.close()


def test_a_piece_that_cannot_start_fails_the_load_once_the_others_stopped(producer):
    remote = producer.worker.lease_blocks("req", [1, 2], list(range(8)))
    reads = _reader(_SecondPieceRefused())
    try:
        reads.start(
            ConnectorMetadata(loads=[LoadSpec("r", remote, [3, 5], [1, 2], remote.block_checksums)])
        )
        assert reads.in_flight == {"r"}  # its first piece is stopping
        assert _finished(reads, "r")
        assert reads.take_load_problems() == {"r": "failed"}
        assert reads.take_invalid_block_ids() == {3, 5}
        assert not reads.has_pending()
        assert producer.get_finished()[0] == {"req"}  # its lease handed back
    finally:
        reads.close()


class _FirstPieceFails(KVTransport):
    """Piece #0 fails at once; piece #1 runs until cancelled (a stuck read)."""

    name = "grpc"

    def __init__(self) -> None:
        self.results = TransferResults()
        self.cancelled: list[str] = []

    def register(self, kv_cache) -> None:
        return None

    def local_metadata(self) -> bytes:
        return b""

    def add_remote(self, engine_id: str, metadata: bytes) -> None:
        return None

    def start_read(self, read: BlockRead) -> None:
        if read.transfer_id.endswith("#0"):
            self.results.failed[read.transfer_id] = "the link broke"

    def poll(self) -> TransferResults:
        results, self.results = self.results, TransferResults()
        return results

    def cancel(self, transfer_id: str) -> None:
        self.cancelled.append(transfer_id)
        self.results.failed[transfer_id] = "cancelled"


def test_a_failed_piece_stops_its_siblings_and_fails_the_load(producer):
    remote = producer.worker.lease_blocks("req", [1, 2], list(range(8)))
    transport = _FirstPieceFails()
    reads = _reader(transport)
    try:
        reads.start(
            ConnectorMetadata(loads=[LoadSpec("r", remote, [3, 5], [1, 2], remote.block_checksums)])
        )
        assert reads.get_finished() == set()  # #0 failed: #1 is cancelled, not yet stopped
        assert transport.cancelled == ["r#1"]
        assert reads.get_finished() == {"r"}
        assert reads.take_load_problems() == {"r": "failed"}  # not timed out: it was the link
        assert reads.take_invalid_block_ids() == {3, 5}
        assert reads.stats["timed_out_reads"] == 0
    finally:
        reads.close()


def test_nixl_metadata_of_one_region_stays_version_1_and_several_are_version_2():
    # One shard's metadata is what engines before shards wrote and read: a rolling upgrade
    # of one-rank engines keeps reading. Several regions need version 2; others are refused.
    region = CacheRegion(
        base_addr=4096, block_bytes=512, num_blocks=8, mem_type="DRAM", device_id=0
    )
    one = PeerMetadata("agent-a", b"keys", (region,))
    record = json.loads(one.to_bytes())
    assert record["version"] == 1 and record["block_bytes"] == 512 and "regions" not in record
    assert PeerMetadata.from_bytes(one.to_bytes()) == one
    two = PeerMetadata("agent-a", b"keys", (region, replace(region, base_addr=8192)))
    assert json.loads(two.to_bytes())["version"] == 2
    assert PeerMetadata.from_bytes(two.to_bytes()) == two
    with pytest.raises(ValueError, match="neither 1 nor 2"):
        PeerMetadata.from_bytes(json.dumps({**record, "version": 3}).encode())
