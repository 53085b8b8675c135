"""FreeKVCacheBlockQueue: the O(1) LRU free list, with exact block ids."""

from __future__ import annotations

import itertools

import pytest

from engine.core.kv_cache_utils import FreeKVCacheBlockQueue, KVCacheBlock


def make_queue(num_blocks: int) -> tuple[list[KVCacheBlock], FreeKVCacheBlockQueue]:
    blocks = [KVCacheBlock(i) for i in range(num_blocks)]
    return blocks, FreeKVCacheBlockQueue(blocks)


def free_ids(queue: FreeKVCacheBlockQueue) -> list[int]:
    return [b.block_id for b in queue.get_all_free_blocks()]


def assert_consistent(queue: FreeKVCacheBlockQueue) -> None:
    """num_free_blocks agrees with the list, and the links agree in both directions."""
    free = queue.get_all_free_blocks()
    assert queue.num_free_blocks == len(free)
    for prev, nxt in itertools.pairwise(free):
        assert prev.next_free_block is nxt
        assert nxt.prev_free_block is prev


def test_initial_queue_holds_blocks_in_given_order() -> None:
    _, queue = make_queue(5)
    assert free_ids(queue) == [0, 1, 2, 3, 4]
    assert queue.num_free_blocks == 5
    assert_consistent(queue)


def test_empty_queue() -> None:
    queue = FreeKVCacheBlockQueue([])
    assert queue.num_free_blocks == 0
    assert queue.get_all_free_blocks() == []
    with pytest.raises(ValueError):
        queue.popleft()


def test_popleft_takes_from_the_front() -> None:
    blocks, queue = make_queue(4)
    assert queue.popleft() is blocks[0]
    assert queue.popleft() is blocks[1]
    assert free_ids(queue) == [2, 3]
    assert queue.num_free_blocks == 2
    assert blocks[0].prev_free_block is None and blocks[0].next_free_block is None
    assert_consistent(queue)


def test_popleft_on_emptied_queue_raises() -> None:
    _, queue = make_queue(2)
    queue.popleft()
    queue.popleft()
    with pytest.raises(ValueError):
        queue.popleft()
    assert queue.num_free_blocks == 0


def test_popleft_n_pops_in_order_and_unlinks() -> None:
    blocks, queue = make_queue(6)
    popped = queue.popleft_n(3)
    assert [b.block_id for b in popped] == [0, 1, 2]
    assert free_ids(queue) == [3, 4, 5]
    assert queue.num_free_blocks == 3
    for block in popped:
        assert block.prev_free_block is None and block.next_free_block is None
    assert_consistent(queue)
    assert queue.popleft() is blocks[3]


def test_popleft_n_zero_and_all() -> None:
    _, queue = make_queue(3)
    assert queue.popleft_n(0) == []
    assert free_ids(queue) == [0, 1, 2]
    assert [b.block_id for b in queue.popleft_n(3)] == [0, 1, 2]
    assert queue.num_free_blocks == 0
    assert queue.get_all_free_blocks() == []
    with pytest.raises(ValueError):
        queue.popleft()


def test_popleft_n_more_than_free_raises_and_changes_nothing() -> None:
    _, queue = make_queue(3)
    with pytest.raises(ValueError):
        queue.popleft_n(4)
    assert free_ids(queue) == [0, 1, 2]
    assert queue.num_free_blocks == 3


def test_append_goes_to_the_back() -> None:
    blocks, queue = make_queue(4)
    first, second = queue.popleft(), queue.popleft()
    queue.append(second)
    queue.append(first)
    assert free_ids(queue) == [2, 3, 1, 0]
    assert queue.num_free_blocks == 4
    assert_consistent(queue)
    assert [b.block_id for b in queue.popleft_n(4)] == [2, 3, 1, 0]
    assert blocks[0].next_free_block is None


def test_append_to_empty_queue() -> None:
    blocks, queue = make_queue(2)
    queue.popleft_n(2)
    queue.append(blocks[1])
    assert free_ids(queue) == [1]
    assert queue.popleft() is blocks[1]


def test_append_n_keeps_given_order() -> None:
    blocks, queue = make_queue(6)
    popped = queue.popleft_n(4)
    queue.append_n([popped[3], popped[0], popped[2]])
    assert free_ids(queue) == [4, 5, 3, 0, 2]
    assert queue.num_free_blocks == 5
    assert_consistent(queue)
    queue.append_n([])
    assert free_ids(queue) == [4, 5, 3, 0, 2]
    assert queue.num_free_blocks == 5
    queue.append_n(iter([blocks[1]]))
    assert free_ids(queue) == [4, 5, 3, 0, 2, 1]
    assert queue.num_free_blocks == 6


def test_append_n_into_empty_queue() -> None:
    _, queue = make_queue(3)
    popped = queue.popleft_n(3)
    queue.append_n(reversed(popped))
    assert free_ids(queue) == [2, 1, 0]
    assert [b.block_id for b in queue.popleft_n(3)] == [2, 1, 0]


def test_remove_from_middle() -> None:
    blocks, queue = make_queue(5)
    queue.remove(blocks[2])
    assert free_ids(queue) == [0, 1, 3, 4]
    assert queue.num_free_blocks == 4
    assert blocks[2].prev_free_block is None and blocks[2].next_free_block is None
    assert_consistent(queue)


def test_remove_front_changes_next_popleft() -> None:
    blocks, queue = make_queue(4)
    queue.remove(blocks[0])
    assert free_ids(queue) == [1, 2, 3]
    assert queue.popleft() is blocks[1]
    assert_consistent(queue)


def test_remove_back_then_append() -> None:
    blocks, queue = make_queue(4)
    queue.remove(blocks[3])
    assert free_ids(queue) == [0, 1, 2]
    assert queue.num_free_blocks == 3
    assert_consistent(queue)
    queue.append(blocks[3])
    assert free_ids(queue) == [0, 1, 2, 3]
    queue.remove(blocks[0])
    queue.append(blocks[0])
    assert free_ids(queue) == [1, 2, 3, 0]
    assert queue.num_free_blocks == 4
    assert_consistent(queue)


def test_remove_only_block_empties_queue() -> None:
    blocks, queue = make_queue(1)
    queue.remove(blocks[0])
    assert queue.num_free_blocks == 0
    assert queue.get_all_free_blocks() == []
    with pytest.raises(ValueError):
        queue.popleft()


def test_remove_block_not_in_queue_raises() -> None:
    blocks, queue = make_queue(3)
    popped = queue.popleft()
    with pytest.raises(RuntimeError):
        queue.remove(popped)
    with pytest.raises(RuntimeError):
        queue.remove(KVCacheBlock(99))
    queue.remove(blocks[1])
    with pytest.raises(RuntimeError):
        queue.remove(blocks[1])  # removed twice
    assert free_ids(queue) == [2]
    assert queue.num_free_blocks == 1


def test_mixed_operations_keep_lru_order() -> None:
    blocks, queue = make_queue(8)
    a = queue.popleft_n(3)  # 0 1 2 out
    queue.remove(blocks[5])  # 5 out (a prefix hit)
    queue.append_n([a[2], a[1]])  # request frees 2, 1
    queue.append(blocks[5])
    assert free_ids(queue) == [3, 4, 6, 7, 2, 1, 5]
    assert queue.num_free_blocks == 7
    assert_consistent(queue)
    assert [b.block_id for b in queue.popleft_n(2)] == [3, 4]
    assert queue.popleft() is blocks[6]
    assert free_ids(queue) == [7, 2, 1, 5]
    assert queue.num_free_blocks == 4
