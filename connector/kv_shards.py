"""KV shards: which of an engine's caches holds which KV heads, and how a read maps one
engine's shards onto another's (tensor parallelism, engine/parallel/).

An engine of one rank, or whose ranks share one cache (a CPU host), has one shard of every
head. Ranks with caches of their own (GPUs; replicated KV heads; tensor_parallel_kv_cache
"per_rank") each hold a range of heads: rank 0's process maps every rank's cache, and its
connector registers each one as a shard and announces their head ranges in the handshake. Of
ranks that replicate a head range the first is read (they hold the same bytes).

A read between engines of other shard layouts is planned per pair of (local shard, remote
shard) whose heads overlap — a piece:
- the same heads on both sides: the remote blocks go straight into the local shard's blocks
  (engines of the same layout: every piece is direct, and moves exactly what it needs);
- other heads: the remote shard's blocks land in a staging tensor, are checked there, and the
  overlapping heads are copied into the local shard's blocks. Where the reader's ranks hold
  fewer heads than the producer's (decode TP > prefill TP) a piece reads the producer's whole
  shard: its heads over ours times the bytes the reader needs.

Checksums. A block's checksum is that of its one shard, or, over several (remote wire
shards s = 0, 1, ...), sum_s w_s * checksum_s (mod 2**64) with w_0 = 1 and w_s odd: the reader
computes each remote shard's checksum from wherever that shard's bytes landed (every copy of
it must agree) and combines them. A flipped bit in any shard still moves the combination by an
odd multiple of a power of two, never by a multiple of 2**64 (engine/block_checksums.py).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from connector.metadata import LoadSpec
from connector.transport import BlockRead
from engine.block_checksums import block_sums, to_hex
from engine.core.block_pool import NULL_BLOCK_ID
from engine.worker.kv_cache import KVShard

HeadRange = tuple[int, int]  # (first KV head, number of heads)
_MASK64 = (1 << 64) - 1


def shard_weight(position: int) -> int:
    """w_s of the combined checksum: 1 for the first wire shard, odd for the others."""
    return 1 if position == 0 else ((0x9E3779B97F4A7C15 * position) & _MASK64) | 1


def combine(sums: Sequence[int]) -> int:
    """One block's checksum from its wire shards' (in wire order)."""
    return sum(shard_weight(s) * value for s, value in enumerate(sums)) & _MASK64


def wire_shards(ranges: Sequence[HeadRange]) -> list[int]:
    """Of shards with these head ranges, the ones a reader reads: the first of each range."""
    seen: set[HeadRange] = set()
    wire = []
    for index, heads in enumerate(ranges):
        if heads not in seen:
            seen.add(heads)
            wire.append(index)
    return wire


def total_heads(ranges: Sequence[HeadRange]) -> int:
    return max((first + count for first, count in ranges), default=0)


class ShardSet:
    """An engine's registered shards, as its connector sees them."""

    def __init__(self, shards: torch.Tensor | Sequence[KVShard]) -> None:
        if isinstance(shards, torch.Tensor):
            shards = [KVShard(shards)]
        if not shards:
            raise ValueError("no KV cache to register")
        self.caches = [shard.cache for shard in shards]
        # Announced to peers where there are several (one shard of every head: nothing).
        self.ranges: list[HeadRange] = (
            [(s.first_head, s.num_heads) for s in shards] if len(shards) > 1 else []
        )
        self.wire = wire_shards(self.ranges) if self.ranges else [0]
        # What a read is planned over: the ranges, or one shard of every head where its
        # shape says how many (a bare tensor of another shape: one shard, heads unknown).
        cache = self.caches[0]
        self.layout: list[HeadRange] = self.ranges or (
            [(0, int(cache.shape[4]))] if cache.dim() == 6 else []
        )

    def checksums(self, block_ids: Sequence[int]) -> list[str]:
        """Of our blocks as they are now: what a reader of them verifies."""
        per_shard = [block_sums(self.caches[s], block_ids) for s in self.wire]
        return [to_hex(combine(sums)) for sums in zip(*per_shard, strict=True)]


@dataclass(frozen=True)
class Piece:
    """Part of a read: the heads a local shard takes from one remote shard."""

    local: int  # local shard
    remote: int  # remote shard (of those the remote announced)
    direct: bool  # the same heads on both sides: no staging
    src_head: int  # the first overlapping head, counted within the remote shard
    dst_head: int  # ... within the local shard
    num_heads: int


def plan_pieces(local: Sequence[HeadRange], remote: Sequence[HeadRange]) -> list[Piece]:
    """The pieces of a read from a remote announcing `remote` ranges into shards of `local`
    ranges (empty: one shard of every head). ValueError where they do not map."""
    if not local and not remote:
        return [Piece(0, 0, True, 0, 0, 0)]
    local = list(local) or [(0, total_heads(remote))]
    remote = list(remote) or [(0, total_heads(local))]
    if total_heads(local) != total_heads(remote):
        raise ValueError(
            f"cannot map KV heads: we hold {total_heads(local)}, the remote "
            f"{total_heads(remote)} (another model or a malformed handshake)"
        )
    pieces = []
    for index, (first, count) in enumerate(local):
        covered: set[int] = set()
        for source in wire_shards(remote):
            remote_first, remote_count = remote[source]
            low = max(first, remote_first)
            high = min(first + count, remote_first + remote_count)
            if low < high:
                if covered & set(range(low, high)):
                    raise ValueError(f"cannot map KV heads: the remote's shards {remote} overlap")
                direct = (remote_first, remote_count) == (first, count)
                pieces.append(
                    Piece(index, source, direct, low - remote_first, low - first, high - low)
                )
                covered.update(range(low, high))
        if len(covered) != count:
            raise ValueError(
                f"cannot map KV heads {first}..{first + count - 1} onto the remote's shards "
                f"{remote}: they cover {len(covered)} of {count}"
            )
    return pieces


@dataclass
class ShardedLoad:
    """One load's pieces: their transport reads, and the checksums of what each brought."""

    load: LoadSpec
    pieces: list[Piece]
    local: ShardSet
    remote: list[HeadRange]  # the remote's shards' heads (one of every head where it said none)
    reads: dict[str, tuple[Piece, BlockRead]] = field(default_factory=dict)
    pending: set[str] = field(default_factory=set)
    checksum_us: int = 0
    # Per remote shard, per piece that read it: each checked block's checksum as landed.
    _sums: dict[int, list[list[int]]] = field(default_factory=dict)

    @property
    def checked(self) -> list[int]:
        """Positions of the load's blocks that are checked: a remote null block stands for
        positions its attention never reads (left of a sliding window), anyone's scratch."""
        return [i for i, b in enumerate(self.load.remote_block_ids) if b != NULL_BLOCK_ID]

    @classmethod
    def plan(cls, load: LoadSpec, local: ShardSet, remote: Sequence[HeadRange]) -> ShardedLoad:
        pieces = plan_pieces(local.layout, remote)
        ranges = list(remote) or [(0, total_heads(local.layout))]
        planned = cls(load, pieces, local, ranges)
        for index, piece in enumerate(pieces):
            transfer_id = load.request_id if len(pieces) == 1 else f"{load.request_id}#{index}"
            into = None if piece.direct else planned._staging(piece, len(load.local_block_ids))
            local_ids = load.local_block_ids if into is None else list(range(into.shape[0]))
            read = BlockRead(
                transfer_id=transfer_id,
                remote_engine_id=load.remote.engine_id,
                local_block_ids=local_ids,
                remote_block_ids=load.remote_block_ids,
                lease_id=load.remote.lease_id,
                local_shard=piece.local,
                remote_shard=piece.remote,
                into=into,
            )
            planned.reads[transfer_id] = (piece, read)
        planned.pending = set(planned.reads)
        return planned

    @property
    def num_bytes(self) -> int:
        """What the pieces move (staged pieces move the remote shard's whole blocks)."""
        total = 0
        for piece, read in self.reads.values():
            target = read.into if read.into is not None else self.local.caches[piece.local]
            total += len(read.local_block_ids) * target[0].nbytes
        return total

    def _staging(self, piece: Piece, num_blocks: int) -> torch.Tensor:
        """Room for the remote shard's blocks (all its heads), on the local shard's device."""
        cache = self.local.caches[piece.local]
        shape = list(cache.shape)
        shape[0], shape[4] = num_blocks, self.remote[piece.remote][1]
        return torch.empty(shape, dtype=cache.dtype, device=cache.device)

    def landed(self, transfer_id: str) -> None:
        """A piece's read ended well: sum what it brought, then copy staged heads in place."""
        piece, read = self.reads[transfer_id]
        target = read.into if read.into is not None else self.local.caches[piece.local]
        started = time.perf_counter()
        sums = block_sums(target, [read.local_block_ids[i] for i in self.checked])
        self.checksum_us += round((time.perf_counter() - started) * 1e6)
        self._sums.setdefault(piece.remote, []).append(sums)
        if read.into is not None:
            cache = self.local.caches[piece.local]
            ids = torch.tensor(self.load.local_block_ids, device=cache.device)
            heads = slice(piece.dst_head, piece.dst_head + piece.num_heads)
            taken = read.into[..., piece.src_head : piece.src_head + piece.num_heads, :]
            cache[ids, :, :, :, heads] = taken
            if cache.device.type == "cuda":
                # Another process (the shard's rank) reads these blocks at its next step: the
                # copy must be done, not queued on this process's stream, before it is told.
                torch.cuda.synchronize(cache.device)

    def bad_blocks(self) -> tuple[list[int], int]:
        """(local blocks whose checksum does not match, blocks checked), once every piece
        landed."""
        load, bad = self.load, []
        checked, wire = self.checked, wire_shards(self.remote)
        for i, position in enumerate(checked):
            per_shard = []
            for shard in wire:
                copies = {sums[i] for sums in self._sums.get(shard, [])}
                per_shard.append(copies.pop() if len(copies) == 1 else None)
            wanted = load.checksums[position]
            if None in per_shard or to_hex(combine(per_shard)) != wanted:  # type: ignore[arg-type]
                bad.append(load.local_block_ids[position])
        return bad, len(checked)
