"""Prefix loans from a KV tier: the blocks of a lent prefix that the pool no longer holds but
its tier does are copied back into fresh pool blocks, verified, and lent after the pool's.

A loan is made on the engine thread between steps (EngineCore.pin_prefix), and the borrower
reads the blocks as soon as it hears their ids: so these copies are made at once and their
sums checked before the loan is answered, and a block that does not verify ends the loan's
run there (the borrower computes the rest). The blocks stay out of the prefix cache (the tier
keeps the entries) and are freed when the loan ends.
"""

from __future__ import annotations

from collections.abc import Sequence

from engine.core.block_pool import BlockPool
from engine.core.kv_cache_utils import BlockHash, KVCacheBlock
from engine.offload.tier_index import TierIndex
from engine.offload.tier_worker import TierWorker


def load_for_loan(
    tier: TierIndex,
    worker: TierWorker,
    pool: BlockPool,
    block_hashes: Sequence[BlockHash],
    first: int,
    loan_id: str,
) -> list[KVCacheBlock]:
    """Fresh pool blocks holding the tier's run of `block_hashes[first:]`, verified (as many
    as verified in a row); each held (one user) until the loan is returned."""
    slots = tier.match(block_hashes, first, len(block_hashes) - first)
    if not slots or pool.get_num_free_blocks() < len(slots):
        return []
    blocks = pool.get_new_blocks(len(slots))
    block_ids = [block.block_id for block in blocks]
    tier.load(loan_id, slots, block_ids, block_hashes[first : first + len(slots)], loan=True)
    copies, _ = tier.take_copies()  # those decided before go first, as they would have
    worker.submit(copies, wait=True)
    bad = tier.settle_loan(worker.report(), loan_id, block_ids)
    good = next((i for i, block_id in enumerate(block_ids) if block_id in bad), len(blocks))
    pool.free_blocks(reversed(blocks[good:]))
    tier.stats.lent += good
    return blocks[:good]
