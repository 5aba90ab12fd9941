"""BlockPool and its free queue: O(1) LRU bookkeeping and the hash index."""

from __future__ import annotations

import pytest

from v1_engine.core.block_pool import BlockPool, FreeKVCacheBlockQueue, KVCacheBlock


def ids(blocks) -> list[int]:
    return [block.block_id for block in blocks]


def test_free_queue_popleft_append_remove_keep_order():
    blocks = [KVCacheBlock(i) for i in range(5)]
    queue = FreeKVCacheBlockQueue(blocks)
    assert ids(queue) == [0, 1, 2, 3, 4] and len(queue) == 5

    queue.remove(blocks[2])
    assert ids(queue) == [0, 1, 3, 4]
    assert queue.popleft() is blocks[0]
    queue.append(blocks[0])
    queue.append(blocks[2])
    assert ids(queue) == [1, 3, 4, 0, 2] and len(queue) == 5

    queue.remove(blocks[2])  # the tail
    queue.remove(blocks[1])  # the head
    assert ids(queue) == [3, 4, 0]
    for _ in range(3):
        queue.popleft()
    assert len(queue) == 0
    with pytest.raises(IndexError):
        queue.popleft()


def test_new_blocks_come_from_the_head_with_one_reference():
    pool = BlockPool(num_blocks=4)
    first = pool.get_new_blocks(3)
    assert ids(first) == [0, 1, 2]
    assert all(block.ref_cnt == 1 for block in first)
    assert pool.get_num_free_blocks() == 1
    assert pool.get_usage() == pytest.approx(0.75)
    with pytest.raises(ValueError, match="only 1 are free"):
        pool.get_new_blocks(2)


def test_freed_blocks_join_the_tail_in_the_given_order():
    pool = BlockPool(num_blocks=4)
    blocks = pool.get_new_blocks(3)
    pool.free_blocks(reversed(blocks))
    assert ids(pool.free_block_queue) == [3, 2, 1, 0]
    assert pool.get_usage() == 0.0


def test_touch_takes_a_free_block_out_of_the_queue_and_counts_owners():
    pool = BlockPool(num_blocks=3)
    (block,) = pool.get_new_blocks(1)
    pool.touch([block])
    assert block.ref_cnt == 2
    pool.free_blocks([block])
    assert block.ref_cnt == 1 and pool.get_num_free_blocks() == 2
    pool.free_blocks([block])
    assert block.ref_cnt == 0 and ids(pool.free_block_queue) == [1, 2, 0]
    pool.touch([block])  # a prefix-cache hit on a free block
    assert block.ref_cnt == 1 and ids(pool.free_block_queue) == [1, 2]


def test_cached_block_is_findable_while_free_and_evicted_on_reuse():
    pool = BlockPool(num_blocks=2)
    a, b = pool.get_new_blocks(2)
    pool.cache_full_blocks([a, b], [111, 222])
    assert pool.get_cached_block(111) is a and pool.get_cached_block(222) is b
    pool.free_blocks([b, a])  # b is evicted first

    (reused,) = pool.get_new_blocks(1)
    assert reused is b
    assert b.block_hash is None
    assert pool.get_cached_block(222) is None
    assert pool.get_cached_block(111) is a


def test_duplicate_hash_keeps_the_first_block():
    pool = BlockPool(num_blocks=2)
    a, b = pool.get_new_blocks(2)
    pool.cache_full_blocks([a], [7])
    pool.cache_full_blocks([b], [7])
    assert pool.get_cached_block(7) is a
    assert b.block_hash is None
    pool.free_blocks([a, b])
    pool.get_new_blocks(2)  # evicting both must not trip over the duplicate
    assert pool.get_cached_block(7) is None


def test_caching_disabled_indexes_nothing():
    pool = BlockPool(num_blocks=2, enable_caching=False)
    blocks = pool.get_new_blocks(2)
    pool.cache_full_blocks(blocks, [1, 2])
    assert pool.get_cached_block(1) is None
    assert all(block.block_hash is None for block in blocks)


def test_reset_prefix_cache_refused_while_blocks_are_in_use():
    pool = BlockPool(num_blocks=2)
    blocks = pool.get_new_blocks(2)
    pool.cache_full_blocks(blocks, [1, 2])
    assert pool.reset_prefix_cache() is False
    assert pool.get_cached_block(1) is blocks[0]
    pool.free_blocks(blocks)
    assert pool.reset_prefix_cache() is True
    assert pool.get_cached_block(1) is None
    assert all(block.block_hash is None for block in pool.blocks)


def test_num_blocks_must_be_positive():
    with pytest.raises(ValueError, match="num_blocks"):
        BlockPool(num_blocks=0)
