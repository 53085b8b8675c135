"""KV cache block metadata, the O(1) LRU free-block queue, and chained block hashing."""

from __future__ import annotations

import functools
import hashlib
import struct
from collections.abc import Callable, Iterable, Sequence

from engine.config import CacheConfig, SchedulerConfig
from engine.request import Request

# A block hash is the sha256 digest of (parent hash, the block's token ids, extra keys).
BlockHash = bytes
HashFunction = Callable[[bytes], bytes]

# The first block of every sequence chains from this root. A fixed value (not a random one)
# keeps hashes equal across processes, which the prefill and decode engines rely on.
ROOT_BLOCK_HASH: BlockHash = hashlib.sha256(b"pdserve-root-block-hash-v1").digest()


def sha256_digest(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()


HASH_FUNCTIONS: dict[str, HashFunction] = {"sha256": sha256_digest}


class KVCacheBlock:
    """Metadata of one physical KV block; the tensors live in the worker.

    `prev_free_block` / `next_free_block` thread the block into the free queue without any
    wrapper node, which is what makes removal from the middle O(1).

    `generation` moves whenever the block stops holding what it held: freed (anyone may
    rewrite it from then on) or evicted in place (it is about to be rewritten). A reader that
    saw generation g when the block was lent and sees g again after reading it knows the
    block held the same KV the whole time (connector/leases.py fences reads on it).
    """

    __slots__ = (
        "block_hash",
        "block_id",
        "generation",
        "is_null",
        "next_free_block",
        "prev_free_block",
        "ref_cnt",
    )

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.generation = 0
        self.block_hash: BlockHash | None = None
        self.prev_free_block: KVCacheBlock | None = None
        self.next_free_block: KVCacheBlock | None = None
        self.is_null = False

    def __repr__(self) -> str:
        cached = "" if self.block_hash is None else ", cached"
        return f"KVCacheBlock({self.block_id}, ref_cnt={self.ref_cnt}{cached})"


class FreeKVCacheBlockQueue:
    """Doubly linked list of free blocks in eviction order (front = least recently used).

    Sentinel head and tail nodes remove every empty-list special case. A block freed by a
    request goes to the back; a cached block hit again is `remove`d from wherever it sits.
    """

    def __init__(self, blocks: Sequence[KVCacheBlock]) -> None:
        self.num_free_blocks = len(blocks)
        self._head = KVCacheBlock(-1)
        self._tail = KVCacheBlock(-1)
        prev = self._head
        for block in blocks:
            prev.next_free_block = block
            block.prev_free_block = prev
            prev = block
        prev.next_free_block = self._tail
        self._tail.prev_free_block = prev

    def popleft(self) -> KVCacheBlock:
        first = self._head.next_free_block
        if first is self._tail or first is None:
            raise ValueError("no free blocks left")
        self._unlink(first)
        return first

    def popleft_n(self, n: int) -> list[KVCacheBlock]:
        """Pop `n` blocks in one walk, relinking the head once."""
        if n > self.num_free_blocks:
            raise ValueError(f"asked for {n} free blocks, only {self.num_free_blocks} left")
        popped: list[KVCacheBlock] = []
        block = self._head.next_free_block
        for _ in range(n):
            assert block is not None
            popped.append(block)
            nxt = block.next_free_block
            block.prev_free_block = block.next_free_block = None
            block = nxt
        self._head.next_free_block = block
        assert block is not None
        block.prev_free_block = self._head
        self.num_free_blocks -= n
        return popped

    def remove(self, block: KVCacheBlock) -> None:
        if block.prev_free_block is None or block.next_free_block is None:
            raise RuntimeError(f"remove() of a block that is not in the free queue: {block}")
        self._unlink(block)

    def append(self, block: KVCacheBlock) -> None:
        last = self._tail.prev_free_block
        assert last is not None
        last.next_free_block = block
        block.prev_free_block = last
        block.next_free_block = self._tail
        self._tail.prev_free_block = block
        self.num_free_blocks += 1

    def append_n(self, blocks: Iterable[KVCacheBlock]) -> None:
        last = self._tail.prev_free_block
        assert last is not None
        count = 0
        for block in blocks:
            last.next_free_block = block
            block.prev_free_block = last
            last = block
            count += 1
        last.next_free_block = self._tail
        self._tail.prev_free_block = last
        self.num_free_blocks += count

    def get_all_free_blocks(self) -> list[KVCacheBlock]:
        """All free blocks, front to back. O(n): for tests and integrity checks."""
        blocks = []
        block = self._head.next_free_block
        while block is not None and block is not self._tail:
            blocks.append(block)
            block = block.next_free_block
        return blocks

    def _unlink(self, block: KVCacheBlock) -> None:
        prev, nxt = block.prev_free_block, block.next_free_block
        assert prev is not None and nxt is not None
        prev.next_free_block = nxt
        nxt.prev_free_block = prev
        block.prev_free_block = block.next_free_block = None
        self.num_free_blocks -= 1


def hash_block_tokens(
    hash_fn: HashFunction,
    parent_block_hash: BlockHash | None,
    block_token_ids: Sequence[int],
    extra_keys: bytes = b"",
) -> BlockHash:
    """H(parent, tokens, extra): equal hashes mean equal whole prefixes, not just equal blocks."""
    parent = ROOT_BLOCK_HASH if parent_block_hash is None else parent_block_hash
    # A length-prefixed extra key cannot be confused with token bytes.
    payload = parent + _token_struct(len(block_token_ids)).pack(*block_token_ids)
    if extra_keys:
        payload += len(extra_keys).to_bytes(4, "little") + extra_keys
    return hash_fn(payload)


@functools.cache
def _token_struct(num_tokens: int) -> struct.Struct:
    """Token ids as native C ints (the bytes of array("i", ...)), compiled once per length:
    a block fills up every block_size decode steps of every request."""
    return struct.Struct(f"{num_tokens}i")


def block_extra_keys(cache_salt: str | None, block_index: int) -> bytes:
    """Keys beyond the tokens that separate cache namespaces.

    The cache salt goes into the first block only: chaining carries it to every later block.
    """
    if block_index == 0 and cache_salt is not None:
        return b"salt:" + cache_salt.encode()
    return b""


def extend_block_hashes(
    hashes: list[BlockHash],
    token_ids: Sequence[int],
    block_size: int,
    hash_fn: HashFunction,
    cache_salt: str | None = None,
) -> None:
    """Append the hash of every full block of `token_ids` past those `hashes` has."""
    start = len(hashes) * block_size
    while start + block_size <= len(token_ids):
        parent = hashes[-1] if hashes else None
        extra = block_extra_keys(cache_salt, len(hashes))
        hashes.append(
            hash_block_tokens(hash_fn, parent, token_ids[start : start + block_size], extra)
        )
        start += block_size


def prompt_block_hashes(
    token_ids: Sequence[int], block_size: int, cache_salt: str | None = None
) -> list[BlockHash]:
    """The hashes an engine gives the full blocks of these tokens (sha256, the only algorithm):
    what a router looks up in the cluster's KV index."""
    hashes: list[BlockHash] = []
    extend_block_hashes(hashes, token_ids, block_size, HASH_FUNCTIONS["sha256"], cache_salt)
    return hashes


def make_block_hasher(block_size: int, hash_fn: HashFunction) -> Callable[[Request], None]:
    """A hasher that extends `request.block_hashes` with every block that became full."""

    def hash_new_full_blocks(request: Request) -> None:
        extend_block_hashes(
            request.block_hashes, request.all_token_ids, block_size, hash_fn, request.cache_salt
        )

    return hash_new_full_blocks


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def check_capacity(scheduler_config: SchedulerConfig, cache_config: CacheConfig) -> None:
    """A pool that cannot hold one max_model_len sequence would let a lone request preempt
    itself forever; refuse the configuration instead."""
    if cache_config.num_blocks is None or cache_config.sliding_window is not None:
        return
    needed = cdiv(scheduler_config.max_model_len, cache_config.block_size)
    usable = cache_config.num_blocks - 1
    if needed > usable:
        raise ValueError(
            f"the KV cache ({usable} usable blocks of {cache_config.block_size} tokens) cannot "
            f"hold one sequence of max_model_len={scheduler_config.max_model_len} tokens "
            f"({needed} blocks); raise num_blocks or lower max_model_len"
        )
