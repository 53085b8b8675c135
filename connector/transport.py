"""The KV transport contract: move whole KV blocks from a remote engine's cache into ours.

Both engines use the block-contiguous layout (engine/worker/kv_cache.py): block b of a cache is
the `block_bytes` bytes at offset b * block_bytes, all layers, K and V. A transport therefore
moves blocks as opaque byte ranges; consecutive block ids on both sides form one range.

An engine whose tensor-parallel ranks keep caches of their own registers one cache per rank
(its shards, connector/kv_shards.py); a read names the shard on each side, and may land in a
staging tensor instead of a shard (the remote shard holds other heads than ours).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the side channel (and so the router's client) shares as_shards, no torch
    import torch


@dataclass(frozen=True)
class BlockRead:
    """Copy remote blocks into local blocks, pairwise: local_block_ids[i] <- remote_block_ids[i]."""

    transfer_id: str  # unique per read; a request id on the decode side
    remote_engine_id: str
    local_block_ids: list[int]
    remote_block_ids: list[int]
    lease_id: str
    local_shard: int = 0  # which of our registered caches receives the blocks
    remote_shard: int = 0  # which of the remote's registered caches they come from
    # Where the blocks land instead of our shard: its rows, indexed by local_block_ids (a
    # remote shard holding other heads than ours is read whole, then the heads copied).
    into: torch.Tensor | None = None


def destination(read: BlockRead, caches: Sequence[torch.Tensor]) -> torch.Tensor:
    """The tensor a read writes into: its staging tensor, or our shard it names."""
    if read.into is not None:
        return read.into
    if not 0 <= read.local_shard < len(caches):
        raise ValueError(f"local shard {read.local_shard} outside [0, {len(caches)})")
    return caches[read.local_shard]


def as_shards(kv_cache: torch.Tensor | Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """What `register` was given, as a list of caches (one per shard)."""
    shards = list(kv_cache) if isinstance(kv_cache, (list, tuple)) else [kv_cache]
    if not shards:
        raise ValueError("no KV cache to register")
    return shards  # type: ignore[return-value]


@dataclass
class TransferResults:
    """What `poll` found finished since the last call."""

    done: set[str] = field(default_factory=set)
    # transfer id -> reason; every local block of a failed read is to be treated as invalid.
    failed: dict[str, str] = field(default_factory=dict)
    # Failed reads the remote refused because it no longer held the blocks as lent (the
    # lease ended, a block was rewritten): fenced, as counted by the reader.
    fenced: set[str] = field(default_factory=set)


def contiguous_runs(local: list[int], remote: list[int]) -> list[tuple[int, int, int]]:
    """(local_start, remote_start, length) runs where both sides' ids are consecutive.

    # local [4, 5, 6, 9], remote [10, 11, 12, 13] -> [(4, 10, 3), (9, 13, 1)]
    """
    runs: list[tuple[int, int, int]] = []
    for loc, rem in zip(local, remote, strict=True):
        if runs:
            start_l, start_r, length = runs[-1]
            if loc == start_l + length and rem == start_r + length:
                runs[-1] = (start_l, start_r, length + 1)
                continue
        runs.append((loc, rem, 1))
    return runs


class KVTransport(ABC):
    """One per engine. Thread-compatible: the engine thread calls register/start_read/poll;
    `local_metadata` may be read by the side-channel thread (it is immutable once built)."""

    name: str

    @abstractmethod
    def register(self, kv_cache: torch.Tensor | Sequence[torch.Tensor]) -> None:
        """Register the whole cache once at start-up ([num_blocks, ...], block-contiguous), or
        each of its shards (the same block ids in each)."""

    @abstractmethod
    def local_metadata(self) -> bytes:
        """What a peer needs to read from us (sent in the Handshake response)."""

    @abstractmethod
    def add_remote(self, engine_id: str, metadata: bytes) -> None:
        """Make a peer readable, from its Handshake metadata. Idempotent per engine id."""

    @abstractmethod
    def start_read(self, read: BlockRead) -> None:
        """Start copying; returns at once. Completion and failures come from `poll`."""

    @abstractmethod
    def poll(self) -> TransferResults:
        """Reads that ended since the last poll (each reported exactly once)."""

    @abstractmethod
    def cancel(self, transfer_id: str) -> None:
        """Stop a read if possible; it is still reported by `poll` once it has stopped."""

    def inject_failure(self, after: int) -> None:
        """Tests: the next read fails part-way, after `after` units of it were written (blocks,
        or descriptors where the transport moves runs of blocks as one)."""
        raise ValueError(f"the {self.name} transport cannot inject failures")

    def close(self) -> None:  # noqa: B027 - optional hook, nothing to release by default
        """Release transport resources."""
