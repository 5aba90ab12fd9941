"""KV-cache building blocks: the block record, the LRU free queue and block hashing."""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Iterable, Iterator, Sequence

# Parent of a request's first block. Any fixed value works; it only has to be the same in every
# process so that hashes agree between runs and across the front-end/core boundary.
_ROOT_PARENT_HASH = 0


def hash_block_tokens(parent_hash: int | None, token_ids: Sequence[int]) -> int:
    """Hash of one full block, chained to the hash of the block before it.

    Chaining makes a block's hash identify the whole prefix up to and including it, so equal
    hashes mean equal KV. sha256 (not Python's `hash`) keeps it stable across processes.
    """
    parent = _ROOT_PARENT_HASH if parent_hash is None else parent_hash
    payload = parent.to_bytes(8, "little") + array("q", token_ids).tobytes()
    return int.from_bytes(hashlib.sha256(payload).digest()[:8], "little")


def extend_block_hashes(
    block_hashes: list[int], token_ids: Sequence[int], block_size: int, num_full_blocks: int
) -> None:
    """Append the hashes of blocks `len(block_hashes)..num_full_blocks-1` to `block_hashes`."""
    assert num_full_blocks * block_size <= len(token_ids)
    parent = block_hashes[-1] if block_hashes else None
    for index in range(len(block_hashes), num_full_blocks):
        start = index * block_size
        parent = hash_block_tokens(parent, token_ids[start : start + block_size])
        block_hashes.append(parent)


class KVCacheBlock:
    """One block of the paged KV cache, with the links of the free queue inside it.

    Keeping the links in the block (an intrusive list) makes removal from the middle of the
    free queue O(1), which a prefix-cache hit on a free block needs.
    """

    __slots__ = ("block_hash", "block_id", "next_free", "prev_free", "ref_cnt")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: int | None = None
        """Set while the block is in the prefix cache (full, with known tokens)."""
        self.prev_free: KVCacheBlock | None = None
        self.next_free: KVCacheBlock | None = None

    def __repr__(self) -> str:
        return f"KVCacheBlock(id={self.block_id}, ref_cnt={self.ref_cnt}, hash={self.block_hash})"


class FreeKVCacheBlockQueue:
    """Doubly linked list of free blocks in eviction order: the head is evicted first.

    Freed blocks join at the tail, so the least recently freed cached block is evicted first.
    Two sentinel nodes remove every empty-list special case.
    """

    def __init__(self, blocks: Iterable[KVCacheBlock]) -> None:
        self._head = KVCacheBlock(-1)
        self._tail = KVCacheBlock(-1)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self.num_free_blocks = 0
        for block in blocks:
            self.append(block)

    def popleft(self) -> KVCacheBlock:
        block = self._head.next_free
        if block is self._tail:
            raise IndexError("no free KV-cache block left")
        self.remove(block)
        return block

    def append(self, block: KVCacheBlock) -> None:
        assert block.prev_free is None and block.next_free is None, "block already queued"
        last = self._tail.prev_free
        last.next_free = block
        block.prev_free = last
        block.next_free = self._tail
        self._tail.prev_free = block
        self.num_free_blocks += 1

    def remove(self, block: KVCacheBlock) -> None:
        assert block.prev_free is not None and block.next_free is not None, "block not queued"
        block.prev_free.next_free = block.next_free
        block.next_free.prev_free = block.prev_free
        block.prev_free = block.next_free = None
        self.num_free_blocks -= 1

    def __iter__(self) -> Iterator[KVCacheBlock]:
        block = self._head.next_free
        while block is not self._tail:
            yield block
            block = block.next_free

    def __len__(self) -> int:
        return self.num_free_blocks
