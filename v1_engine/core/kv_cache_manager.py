"""KVCacheManager: which blocks each request holds, and the prefix cache seen by the scheduler.

Only full blocks of known tokens are hashed and cached; a block is cached as soon as it is
allocated for a step that fills it, so a request scheduled later (even in the same step, since
K/V are written before attention reads them) can reuse it.
"""

from __future__ import annotations

from dataclasses import dataclass

from v1_engine.core.block_pool import BlockPool
from v1_engine.core.kv_cache_utils import KVCacheBlock, extend_block_hashes
from v1_engine.core.request import Request


@dataclass
class PrefixCacheStats:
    queries: int = 0
    """Tokens of requests looked up in the prefix cache."""
    hits: int = 0
    """Of those, tokens served from the cache."""


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.block_pool = BlockPool(num_blocks, enable_caching)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        self.num_cached_blocks: dict[str, int] = {}
        """Per request, how many of its leading blocks are already indexed in the prefix cache."""
        self._stats = PrefixCacheStats()

    @property
    def usage(self) -> float:
        return self.block_pool.get_usage()

    @property
    def num_free_blocks(self) -> int:
        return self.block_pool.get_num_free_blocks()

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """The longest cached prefix of the request's full blocks, and its length in tokens.

        The last known token is never a hit: it must be recomputed for its logits. For a fresh
        request that caps the hit at num_prompt_tokens - 1; a request resumed after preemption
        may also hit blocks holding its earlier outputs. Requests that want prompt logprobs skip
        the lookup, since cached positions would have no logits to score.
        """
        if not self.enable_caching or request.sampling_params.prompt_logprobs is not None:
            return [], 0
        self._update_block_hashes(request, request.num_tokens // self.block_size)
        max_hit_blocks = (request.num_tokens - 1) // self.block_size
        hit_blocks = []
        for block_hash in request.block_hashes[:max_hit_blocks]:
            block = self.block_pool.get_cached_block(block_hash)
            if block is None:
                break
            hit_blocks.append(block)
        num_hit_tokens = len(hit_blocks) * self.block_size
        self._stats.queries += request.num_tokens
        self._stats.hits += num_hit_tokens
        return hit_blocks, num_hit_tokens

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: list[KVCacheBlock] | None = None,
        num_new_computed_tokens: int = 0,
    ) -> list[KVCacheBlock] | None:
        """Give the request room for `num_new_tokens` more tokens after its computed ones.

        `new_computed_blocks` (prefix-cache hits from `get_computed_blocks`, first schedule
        only) join the request's blocks first. Returns the freshly allocated blocks, or None
        when the pool is too small; nothing changes then.
        """
        new_computed_blocks = new_computed_blocks or []
        assert num_new_computed_tokens == len(new_computed_blocks) * self.block_size
        req_blocks = self.req_to_blocks.get(request.request_id, [])
        num_tokens_after = request.num_computed_tokens + num_new_computed_tokens + num_new_tokens
        num_required = -(-num_tokens_after // self.block_size)
        num_new_blocks = max(0, num_required - len(req_blocks) - len(new_computed_blocks))
        # Hits on free blocks leave the free queue when touched, so they are not available.
        num_free_hits = sum(1 for block in new_computed_blocks if block.ref_cnt == 0)
        if num_new_blocks > self.block_pool.get_num_free_blocks() - num_free_hits:
            return None

        self.block_pool.touch(new_computed_blocks)
        new_blocks = self.block_pool.get_new_blocks(num_new_blocks)
        req_blocks = self.req_to_blocks.setdefault(request.request_id, req_blocks)
        req_blocks.extend(new_computed_blocks)
        req_blocks.extend(new_blocks)
        num_cached = self.num_cached_blocks.setdefault(request.request_id, 0)
        self.num_cached_blocks[request.request_id] = num_cached + len(new_computed_blocks)
        if self.enable_caching:
            self._cache_full_blocks(request, min(num_tokens_after, request.num_tokens))
        return new_blocks

    def free(self, request: Request) -> None:
        """Release the request's blocks. They are freed tail first, so when evicting, the end of
        a sequence goes before its (more widely shared) beginning."""
        blocks = self.req_to_blocks.pop(request.request_id, [])
        self.num_cached_blocks.pop(request.request_id, None)
        self.block_pool.free_blocks(reversed(blocks))

    def get_block_ids(self, request_id: str) -> list[int]:
        return [block.block_id for block in self.req_to_blocks.get(request_id, [])]

    def get_blocks(self, request_id: str) -> list[KVCacheBlock]:
        return list(self.req_to_blocks.get(request_id, []))

    def make_prefix_cache_stats(self) -> PrefixCacheStats:
        """Queries and hits since the previous call."""
        stats, self._stats = self._stats, PrefixCacheStats()
        return stats

    def reset_prefix_cache(self) -> bool:
        """Drop all cached blocks; refused (False) while requests hold blocks."""
        return self.block_pool.reset_prefix_cache()

    def _cache_full_blocks(self, request: Request, num_known_tokens: int) -> None:
        """Index the request's blocks that are full of known tokens and not yet cached."""
        num_full_blocks = num_known_tokens // self.block_size
        num_cached = self.num_cached_blocks[request.request_id]
        if num_full_blocks <= num_cached:
            return
        self._update_block_hashes(request, num_full_blocks)
        blocks = self.req_to_blocks[request.request_id][num_cached:num_full_blocks]
        self.block_pool.cache_full_blocks(blocks, request.block_hashes[num_cached:num_full_blocks])
        self.num_cached_blocks[request.request_id] = num_full_blocks

    def _update_block_hashes(self, request: Request, num_full_blocks: int) -> None:
        if len(request.block_hashes) < num_full_blocks:
            extend_block_hashes(
                request.block_hashes, request.all_token_ids, self.block_size, num_full_blocks
            )
