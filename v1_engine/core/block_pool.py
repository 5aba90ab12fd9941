"""BlockPool: owns every KV-cache block, the LRU free queue and the prefix-cache index.

All `num_blocks` blocks are usable; no block is reserved for padding (the runner pads with
its own slot values). A free block may still hold cached KV: it stays findable by hash until
it is handed out again, and is then evicted from the index.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from v1_engine.core.kv_cache_utils import FreeKVCacheBlockQueue, KVCacheBlock

__all__ = ["BlockPool", "FreeKVCacheBlockQueue", "KVCacheBlock"]


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(block_id) for block_id in range(num_blocks)]
        self.free_block_queue = FreeKVCacheBlockQueue(self.blocks)
        self.cached_block_hash_to_block: dict[int, KVCacheBlock] = {}

    def get_num_free_blocks(self) -> int:
        return len(self.free_block_queue)

    def get_usage(self) -> float:
        """Fraction of blocks held by requests, in [0, 1]."""
        return 1.0 - self.get_num_free_blocks() / self.num_blocks

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Take `num_blocks` free blocks (ref_cnt 1), evicting their cached content if any."""
        if num_blocks > self.get_num_free_blocks():
            raise ValueError(
                f"cannot take {num_blocks} blocks: only {self.get_num_free_blocks()} are free"
            )
        new_blocks = []
        for _ in range(num_blocks):
            block = self.free_block_queue.popleft()
            self._evict(block)
            assert block.ref_cnt == 0
            block.ref_cnt = 1
            new_blocks.append(block)
        return new_blocks

    def cache_full_blocks(
        self, blocks: Sequence[KVCacheBlock], block_hashes: Sequence[int]
    ) -> None:
        """Index full blocks by hash so later requests with the same prefix can reuse them.

        A hash already indexed (another request computed the same prefix at the same time)
        keeps its first block; the duplicate stays an ordinary, unindexed block.
        """
        if not self.enable_caching:
            return
        assert len(blocks) == len(block_hashes)
        for block, block_hash in zip(blocks, block_hashes):
            if block.block_hash is not None:
                assert block.block_hash == block_hash, "a cached block changed its content"
                continue
            if block_hash not in self.cached_block_hash_to_block:
                block.block_hash = block_hash
                self.cached_block_hash_to_block[block_hash] = block

    def get_cached_block(self, block_hash: int) -> KVCacheBlock | None:
        return self.cached_block_hash_to_block.get(block_hash)

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take one more reference to each block; a free (ref_cnt 0) block leaves the free queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_block_queue.remove(block)
            block.ref_cnt += 1

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference from each block; blocks reaching 0 join the free queue's tail in
        the given order, so the first one given is evicted first."""
        for block in ordered_blocks:
            assert block.ref_cnt > 0, f"{block} freed more often than taken"
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_block_queue.append(block)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block. Refused (returns False) while any block is in use, since
        running requests' blocks would otherwise stay half-indexed."""
        if self.get_num_free_blocks() != self.num_blocks:
            return False
        for block in self.blocks:
            block.block_hash = None
        self.cached_block_hash_to_block.clear()
        return True

    def _evict(self, block: KVCacheBlock) -> None:
        if block.block_hash is None:
            return
        indexed = self.cached_block_hash_to_block.pop(block.block_hash)
        assert indexed is block, "only indexed blocks carry a hash"
        block.block_hash = None
