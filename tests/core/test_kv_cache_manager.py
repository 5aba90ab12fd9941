"""KVCacheManager: allocation, prefix-cache hits, LRU eviction and hashing."""

from __future__ import annotations

import subprocess
import sys

from v1_engine.core.kv_cache_manager import KVCacheManager
from v1_engine.core.kv_cache_utils import hash_block_tokens
from v1_engine.core.request import Request
from v1_engine.sampling_params import SamplingParams

BLOCK = 16


def request(req_id: str, tokens: list[int], **params: object) -> Request:
    return Request(req_id, tokens, SamplingParams(**params))


def prefix(num_tokens: int) -> list[int]:
    return list(range(500, 500 + num_tokens))


def admit(manager: KVCacheManager, req: Request) -> int:
    """What the scheduler does on a first schedule: look up, allocate, count hits as computed."""
    hits, num_hit_tokens = manager.get_computed_blocks(req)
    new_blocks = manager.allocate_slots(req, req.num_tokens - num_hit_tokens, hits, num_hit_tokens)
    assert new_blocks is not None
    req.num_computed_tokens = req.num_tokens
    return num_hit_tokens


def test_shared_three_block_prefix_is_reused_with_two_owners():
    manager = KVCacheManager(num_blocks=32, block_size=BLOCK)
    first = request("a", prefix(48) + [1, 2, 3, 4, 5])
    second = request("b", prefix(48) + [9, 8, 7])
    assert admit(manager, first) == 0
    assert admit(manager, second) == 48

    first_ids, second_ids = manager.get_block_ids("a"), manager.get_block_ids("b")
    assert first_ids[:3] == second_ids[:3]
    assert first_ids[3] != second_ids[3]
    assert [b.ref_cnt for b in manager.get_blocks("b")] == [2, 2, 2, 1]
    assert second.block_hashes == first.block_hashes[:3]

    stats = manager.make_prefix_cache_stats()
    assert (stats.queries, stats.hits) == (53 + 51, 48)
    stats = manager.make_prefix_cache_stats()
    assert (stats.queries, stats.hits) == (0, 0)


def test_whole_prompt_is_never_a_hit():
    manager = KVCacheManager(num_blocks=32, block_size=BLOCK)
    admit(manager, request("a", prefix(48)))
    # Same 48 tokens: all three blocks are cached, but the last token must be recomputed.
    hits, num_hit_tokens = manager.get_computed_blocks(request("b", prefix(48)))
    assert num_hit_tokens == 32 and len(hits) == 2
    # One more token makes the third block a legitimate hit.
    _, num_hit_tokens = manager.get_computed_blocks(request("c", prefix(49)))
    assert num_hit_tokens == 48


def test_partial_blocks_are_not_cached():
    manager = KVCacheManager(num_blocks=32, block_size=BLOCK)
    admit(manager, request("a", prefix(40)))  # 2 full blocks + 8 tokens
    _, num_hit_tokens = manager.get_computed_blocks(request("b", prefix(60)))
    assert num_hit_tokens == 32


def test_a_hit_stops_at_the_first_differing_block():
    manager = KVCacheManager(num_blocks=32, block_size=BLOCK)
    admit(manager, request("a", prefix(64)))
    tokens = prefix(64)
    tokens[20] = 7  # second block differs, so the (chained) third and fourth blocks differ too
    _, num_hit_tokens = manager.get_computed_blocks(request("b", tokens + [1]))
    assert num_hit_tokens == 16


def test_freed_blocks_stay_cached_and_are_evicted_tail_first():
    manager = KVCacheManager(num_blocks=4, block_size=BLOCK)
    owner = request("a", prefix(64))
    admit(manager, owner)
    manager.free(owner)
    assert manager.num_free_blocks == 4 and manager.usage == 0.0
    # Still cached after the free: a new request hits 3 blocks.
    _, num_hit_tokens = manager.get_computed_blocks(request("b", prefix(64)))
    assert num_hit_tokens == 48

    # Taking one block evicts the owner's last block, keeping the shared beginning.
    filler = request("x", [1])
    assert manager.allocate_slots(filler, 1) is not None
    _, num_hit_tokens = manager.get_computed_blocks(request("c", prefix(65)))
    assert num_hit_tokens == 48
    # A second block goes: now the third block of the prefix is gone.
    filler2 = request("y", [1])
    assert manager.allocate_slots(filler2, 1) is not None
    _, num_hit_tokens = manager.get_computed_blocks(request("d", prefix(65)))
    assert num_hit_tokens == 32


def test_least_recently_freed_request_is_evicted_first():
    manager = KVCacheManager(num_blocks=2, block_size=BLOCK)
    old, new = request("old", prefix(16)), request("new", list(range(16)))
    admit(manager, old)
    admit(manager, new)
    manager.free(old)
    manager.free(new)
    assert manager.allocate_slots(request("x", [1]), 1) is not None
    assert manager.get_computed_blocks(request("o", prefix(17)))[1] == 0
    assert manager.get_computed_blocks(request("n", list(range(17))))[1] == 16


def test_hit_on_a_free_block_takes_it_out_of_the_free_queue():
    manager = KVCacheManager(num_blocks=4, block_size=BLOCK)
    first = request("a", prefix(32))
    admit(manager, first)
    manager.free(first)
    second = request("b", prefix(33))
    assert admit(manager, second) == 32
    assert [b.ref_cnt for b in manager.get_blocks("b")] == [1, 1, 1]
    assert manager.num_free_blocks == 1
    assert all(block.ref_cnt == 0 for block in manager.block_pool.free_block_queue)


def test_allocate_fails_without_changing_anything():
    manager = KVCacheManager(num_blocks=3, block_size=BLOCK)
    first = request("a", prefix(32))
    admit(manager, first)
    manager.free(first)
    # 2 hit blocks are free but touching them leaves only 1 block for 2 new ones.
    second = request("b", prefix(32) + list(range(20)))
    hits, num_hit_tokens = manager.get_computed_blocks(second)
    assert num_hit_tokens == 32
    assert manager.allocate_slots(second, 20, hits, num_hit_tokens) is None
    assert manager.num_free_blocks == 3
    assert manager.get_block_ids("b") == []
    assert all(block.ref_cnt == 0 for block in manager.block_pool.blocks)


def test_blocks_grow_one_at_a_time_and_decode_blocks_get_cached():
    manager = KVCacheManager(num_blocks=8, block_size=4)
    req = request("a", [1, 2, 3])
    assert len(manager.allocate_slots(req, 3)) == 1
    req.num_computed_tokens = 3
    for token in (4, 5, 6):
        req.append_output_token_ids(token)
        new_blocks = manager.allocate_slots(req, 1)
        req.num_computed_tokens += 1
        assert len(new_blocks) == (1 if req.num_computed_tokens == 5 else 0)
    assert len(manager.get_block_ids("a")) == 2
    # Tokens 1..4 (prompt + the first output) filled a block, which is now cached.
    _, num_hit_tokens = manager.get_computed_blocks(request("b", [1, 2, 3, 4, 9]))
    assert num_hit_tokens == 4


def test_prefix_caching_disabled_never_hits():
    manager = KVCacheManager(num_blocks=8, block_size=BLOCK, enable_caching=False)
    admit(manager, request("a", prefix(40)))
    assert manager.get_computed_blocks(request("b", prefix(40))) == ([], 0)
    assert manager.block_pool.cached_block_hash_to_block == {}
    assert manager.make_prefix_cache_stats().queries == 0


def test_prompt_logprobs_requests_skip_the_lookup():
    manager = KVCacheManager(num_blocks=8, block_size=BLOCK)
    admit(manager, request("a", prefix(40)))
    assert manager.get_computed_blocks(request("b", prefix(40), prompt_logprobs=1)) == ([], 0)


def test_reset_prefix_cache():
    manager = KVCacheManager(num_blocks=8, block_size=BLOCK)
    req = request("a", prefix(40))
    admit(manager, req)
    assert manager.reset_prefix_cache() is False
    manager.free(req)
    assert manager.reset_prefix_cache() is True
    assert manager.get_computed_blocks(request("b", prefix(40)))[1] == 0


def test_block_hash_is_chained_and_stable_across_processes():
    root = hash_block_tokens(None, [1, 2, 3])
    assert root == hash_block_tokens(None, [1, 2, 3])
    assert root != hash_block_tokens(None, [1, 2, 4])
    assert hash_block_tokens(root, [5]) != hash_block_tokens(None, [5])
    assert 0 <= root < 2**64
    code = (
        "from v1_engine.core.kv_cache_utils import hash_block_tokens as h;"
        "print(h(h(None, [1, 2, 3]), [5]))"
    )
    other = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        env={"PYTHONHASHSEED": "123", "PYTHONPATH": ":".join(sys.path)},
    )
    assert int(other.stdout) == hash_block_tokens(root, [5])
