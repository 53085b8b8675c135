"""KV cache events: what entered and left the prefix cache, for external indexers/routers."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class BlockStored:
    """Full blocks that became reusable prefix-cache entries, in sequence order."""

    block_hashes: list[bytes]
    parent_block_hash: bytes | None
    token_ids: list[int]
    block_size: int


@dataclass(frozen=True)
class BlockRemoved:
    """Cache entries that are gone (evicted for reuse or dropped as invalid)."""

    block_hashes: list[bytes]


@dataclass(frozen=True)
class AllBlocksCleared:
    """The whole prefix cache was reset."""


KVCacheEvent = BlockStored | BlockRemoved | AllBlocksCleared
