"""connector/kv_shards.py: how a read maps one engine's KV shards onto another's, and the
checksum of a block held in several shards (the engines and transports moving them:
tests/model/test_tp_disaggregation.py)."""

from __future__ import annotations

import pytest
import torch

from connector.kv_shards import Piece, ShardSet, combine, plan_pieces, shard_weight, wire_shards
from engine.block_checksums import block_checksums, block_sums
from engine.worker.kv_cache import KVShard


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
