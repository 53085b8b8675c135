"""The prefix index under the cluster's KV index (kv_index.py): which replica holds which
block hashes, applied from the engines' numbered event batches.

Per replica, a count of blocks per block hash (events are per block: two blocks may hold one
hash); per hash, the replicas holding it, as a bit mask (one bit per replica: the narrowing
below is an `and` of two machine words at 128 replicas, not a set operation, and an entry
takes a bit, not a set slot). Block hashes are chained — each covers every token before it —
so the blocks of a prompt that a replica can reuse are the leading run of the prompt's hashes
it holds, which is what the engine's own lookup finds (`match`): one walk of the prompt's
hashes, narrowing the replicas still holding every block so far, done where none holds the
next (not one walk per replica: at 128 replicas and 1,000-block prompts that was about 7x
slower, `pdserve bench index`; `tests/unit/test_kv_index.py` keeps the two equal). The
masks live in a holder table (holders.py): C compiled on first use, its Python twin where no
compiler is.

Lost or late events never corrupt it silently. A batch numbered out of turn (events were
lost) or from an epoch the index has not seen (the replica restarted) makes the replica stale:
its entries are dropped, it matches nothing, and `apply` says a snapshot is needed. A snapshot
(every hash the engine holds, and the number of the first batch it does not cover) makes the
replica current again; batches it covers are ignored when they arrive late. A replica that is
no longer running is forgotten (`forget`).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from deployments.cluster.holders import Holders, holders
from engine.core.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    KVSnapshot,
)


@dataclass
class _Replica:
    bit: int  # its bit in the holder masks
    epoch: str = ""
    next_seq: int = 0
    stale: bool = True  # nothing trusted until a snapshot, or batches from number 0
    blocks: Counter[bytes] = field(default_factory=Counter)  # every medium's
    tier: Counter[bytes] = field(default_factory=Counter)  # those in a tier below the pool

    @property
    def position(self) -> int:
        """Its bit's number (the holder table's and `_names`' index)."""
        return self.bit.bit_length() - 1


class PrefixIndex:
    """Per replica its blocks (a count per hash), and per hash the replicas holding it: a
    lookup walks the prompt's hashes once, whatever the number of replicas, and stops where
    no replica holds the next block."""

    def __init__(self, storage: Holders | None = None) -> None:
        """`storage`: the holder table (default: holders.py's, C where it builds here)."""
        self._replicas: dict[str, _Replica] = {}
        # Per hash, a mask of the current replicas holding it.
        self._holders: Holders = storage if storage is not None else holders()
        self._names: list[str] = []  # by bit position ("" where free)
        self._bits: dict[str, int] = {}  # by replica (see `bits`)
        # Per hash the replicas that hold it in a tier only (not in their pool): a hit
        # there is loaded back before use, and routing credits it less (kv_scoring).
        self._tier_only: dict[bytes, set[str]] = {}

    @property
    def replicas(self) -> list[str]:
        return list(self._replicas)

    def is_current(self, replica: str) -> bool:
        state = self._replicas.get(replica)
        return state is not None and not state.stale

    def apply(self, replica: str, batch: KVEventBatch) -> bool:
        """Apply one batch of `replica`'s events. False: the replica is stale (a gap, or a new
        epoch that does not start at batch 0) and needs `load_snapshot`."""
        state = self._state(replica)
        if batch.epoch == state.epoch and batch.seq < state.next_seq:
            return not state.stale  # already covered (by a snapshot, or seen before)
        if batch.epoch != state.epoch and batch.seq == 0:
            # A fresh start whose first batch arrived: nothing before it to miss.
            self._clear(replica, state)
            state.epoch, state.next_seq, state.stale = batch.epoch, 0, False
        if batch.epoch != state.epoch or batch.seq != state.next_seq or state.stale:
            self._clear(replica, state)
            state.epoch, state.stale = batch.epoch, True
            return False
        self._apply_events(replica, state, batch)
        state.next_seq += 1
        return True

    def load_snapshot(self, replica: str, snapshot: KVSnapshot) -> None:
        state = self._state(replica)
        self._clear(replica, state)
        state.epoch, state.next_seq, state.stale = snapshot.epoch, snapshot.next_seq, False
        self._store(replica, state, snapshot.block_hashes)
        for block_hash in snapshot.tier_block_hashes:
            state.tier[block_hash] += 1
            self._mark_tier_only(replica, state, block_hash)

    def match(self, block_hashes: Sequence[bytes]) -> dict[str, int]:
        """Per replica: how many leading blocks of a prompt (its chained hashes) it holds;
        stale replicas count 0."""
        return {**dict.fromkeys(self._replicas, 0), **self.match_held(block_hashes)}

    def match_held(self, block_hashes: Sequence[bytes]) -> dict[str, int]:
        """`match`, for the replicas holding at least the prompt's first block only."""
        return {r: depth for depth, group in self.match_groups(block_hashes) for r in group}

    def match_groups(self, block_hashes: Sequence[bytes]) -> list[tuple[int, list[str]]]:
        """The replicas holding at least the prompt's first block, by the leading blocks they
        hold: (blocks, replicas), fewest blocks first."""
        return [(depth, self.names_of(mask)) for depth, mask in self.match_masks(block_hashes)]

    def match_masks(self, block_hashes: Sequence[bytes]) -> list[tuple[int, int]]:
        """`match_groups` with each group as a mask of `bits` (naming a big group's members
        costs more than the walk: routing names only the few it evaluates)."""
        return self._holders.match(block_hashes)

    @property
    def bits(self) -> Mapping[str, int]:
        """Each replica's bit in the masks. Never changed once handed out (a replica that
        comes or goes makes a new one): a lookup's answer keeps it as it was."""
        return self._bits

    def names_of(self, mask: int) -> list[str]:
        names, out = self._names, []
        while mask:
            low = mask & -mask
            out.append(names[low.bit_length() - 1])
            mask ^= low
        return out

    def _state(self, replica: str) -> _Replica:
        state = self._replicas.get(replica)
        if state is None:
            names = self._names  # a forgotten replica's bit is taken again first
            position = names.index("") if "" in names else len(names)
            names[position : position + 1] = [replica]
            state = self._replicas[replica] = _Replica(1 << position)
            self._bits = {**self._bits, replica: state.bit}
        return state

    @property
    def has_tiers(self) -> bool:
        """Whether any replica holds a block in a tier only."""
        return bool(self._tier_only)

    def tier_only_blocks(
        self, replica: str, block_hashes: Sequence[bytes], count: int | None = None
    ) -> int:
        """How many of `block_hashes` (of their first `count`) `replica` holds in a tier only
        (the leading run that `match` counted for it: the blocks it would load back rather
        than find in its pool)."""
        tier_only = self._tier_only
        if not tier_only:  # no tier anywhere: nothing to look up
            return 0
        run = block_hashes if count is None else block_hashes[:count]
        return sum(1 for h in run if replica in tier_only.get(h, ()))

    def forget(self, replica: str) -> None:
        state = self._replicas.pop(replica, None)
        if state is not None:
            self._clear(replica, state)
            self._names[state.position] = ""
            self._bits = {r: b for r, b in self._bits.items() if r != replica}

    def num_entries(self) -> int:
        """(hash, replica) pairs held: what the index's memory grows with."""
        return self._holders.num_entries()

    def _apply_events(self, replica: str, state: _Replica, batch: KVEventBatch) -> None:
        for event in batch.events:
            if isinstance(event, BlockStored):
                self._store(replica, state, event.block_hashes, event.medium != "primary")
            elif isinstance(event, BlockRemoved):
                self._remove(replica, state, event.block_hashes, event.medium != "primary")
            elif isinstance(event, AllBlocksCleared):
                self._clear(replica, state)

    def _store(
        self, replica: str, state: _Replica, block_hashes: Iterable[bytes], in_tier: bool = False
    ) -> None:
        holders, blocks, tier = self._holders, state.blocks, state.tier
        position = state.position
        for block_hash in block_hashes:
            count = blocks[block_hash]
            blocks[block_hash] = count + 1
            if not count:
                holders.add(block_hash, position)
            if in_tier:
                tier[block_hash] += 1
            if tier:  # a pool without a tier skips this
                self._mark_tier_only(replica, state, block_hash)

    def _remove(
        self, replica: str, state: _Replica, block_hashes: Iterable[bytes], in_tier: bool
    ) -> None:
        blocks, tier = state.blocks, state.tier
        for block_hash in block_hashes:
            if _count_down(blocks, block_hash):
                self._unhold(state, block_hash)
            if in_tier:
                _count_down(tier, block_hash)
            if tier or in_tier:
                self._mark_tier_only(replica, state, block_hash)

    def _mark_tier_only(self, replica: str, state: _Replica, block_hash: bytes) -> None:
        """Note whether `replica` now holds `block_hash` in a tier and not in its pool."""
        held = state.blocks.get(block_hash, 0)
        if held and state.tier.get(block_hash, 0) >= held:
            self._tier_only.setdefault(block_hash, set()).add(replica)
            return
        replicas = self._tier_only.get(block_hash)
        if replicas is not None:
            replicas.discard(replica)
            if not replicas:
                del self._tier_only[block_hash]

    def _unhold(self, state: _Replica, block_hash: bytes) -> None:
        self._holders.discard(block_hash, state.position)

    def _clear(self, replica: str, state: _Replica) -> None:
        for block_hash in state.blocks:
            self._unhold(state, block_hash)
        tier = state.tier
        state.blocks.clear()
        for block_hash in list(tier):
            tier.pop(block_hash)
            self._mark_tier_only(replica, state, block_hash)


def _count_down(counts: Counter[bytes], block_hash: bytes) -> bool:
    """One block fewer holds `block_hash`: True when that was the last one."""
    left = counts[block_hash] - 1
    if left > 0:
        counts[block_hash] = left
        return False
    return counts.pop(block_hash, None) is not None
