"""Decode graphs per context bucket, on the CPU: which (batch size, context) graphs are kept,
which one a step replays, and the Triton backend's launch key for the Llama-3-8B heads on a
132-SM device (no GPU needed: the plan is host arithmetic)."""

from __future__ import annotations

import pytest
import torch

from compile.cuda_graphs import DecodeCudaGraphs, context_graph_lens
from v1_engine.attention.triton_attn import TritonAttentionBackend
from v1_engine.config import CompilationConfig
from v1_engine.kernels import attention_launch


class _Layer:
    def __init__(self, num_heads: int = 32, num_kv_heads: int = 8, head_size: int = 128):
        self.num_heads, self.num_kv_heads, self.head_size = num_heads, num_kv_heads, head_size


def _splits_key(size: int, context: int) -> int:
    """A stand-in launch key: splits for 264 programs over 8 KV heads, 128 keys a split."""
    return max(1, min(264 // (8 * size), context // 128))


def test_buckets_kept_only_where_the_launch_differs():
    lens = context_graph_lens([1, 2, 4, 32], [256, 512, 1024, 9000], 8192, _splits_key)
    # size 1: 8192 -> 33 splits, 1024 -> 8, 512 -> 4, 256 -> 2; size 4 plans 8 at 1024 as at
    # 8192 (no 1024 graph); size 32 plans 1 split everywhere; 9000 is past max_seq_len.
    assert lens == {
        1: [256, 512, 1024, 8192],
        2: [256, 512, 1024, 8192],
        4: [256, 512, 8192],
        32: [8192],
    }
    same_as_above = context_graph_lens([2], [1024, 2048], 8192, _splits_key)
    assert same_as_above == {2: [1024, 8192]}  # 16 splits at 2048 as at 8192: no 2048 graph
    assert context_graph_lens([1, 2], [1024], 8192, None) == {1: [8192], 2: [8192]}
    assert context_graph_lens([1], [], 8192, _splits_key) == {1: [8192]}


def test_a_step_replays_the_shortest_graph_holding_its_context():
    graphs = DecodeCudaGraphs(
        lambda ids, pos: ids,
        [1, 2, 8],
        max_blocks_per_req=4,
        max_seq_len=8192,
        device=torch.device("cpu"),
        context_buckets=[256, 1024],
        launch_key=_splits_key,
    )
    assert graphs.graph_for(1, 1) == (1, 256)
    assert graphs.graph_for(1, 256) == (1, 256)
    assert graphs.graph_for(1, 257) == (1, 1024)
    assert graphs.graph_for(2, 1024) == (2, 1024)
    assert graphs.graph_for(2, 1025) == (2, 8192)
    assert graphs.graph_for(1, 8192) == (1, 8192)
    assert graphs.graph_for(5, 100) == (8, 256)  # padded to 8, whose 256 graph differs
    assert graphs.graph_for(9, 100) is None


@pytest.fixture
def h200_sms(monkeypatch):
    monkeypatch.setattr(attention_launch, "_num_sms", lambda index: 132)


def test_triton_launch_key_for_llama3_8b_heads(h200_sms):
    key = TritonAttentionBackend().decode_launch_key(
        [_Layer(), _Layer()], torch.bfloat16, torch.device("cuda", 0)
    )
    assert key is not None
    # (tile, splits, merged in the launch): batch 1 at 8192 cuts 32 pieces merged by a second
    # kernel, at 1024 eight merged in the launch.
    assert key(1, 8192) == ((32, 32, False),)
    assert key(1, 1024) == ((32, 8, True),)
    assert key(2, 8192) == ((32, 16, False),)
    assert key(4, 8192) == key(4, 1024) == ((32, 8, True),)
    sizes = CompilationConfig().capture_sizes(256)
    lens = context_graph_lens(sizes, CompilationConfig().decode_context_buckets, 8192, key)
    assert {s: v for s, v in lens.items() if len(v) > 1} == {1: [1024, 8192], 2: [1024, 8192]}


def test_no_launch_key_where_contexts_cannot_differ(h200_sms):
    cuda = torch.device("cuda", 0)
    pinned = TritonAttentionBackend(num_splits=4)
    assert pinned.decode_launch_key([_Layer()], torch.bfloat16, cuda) is None

    class _Latent:  # an MLA layer: no KV heads
        num_heads = 16

    assert TritonAttentionBackend().decode_launch_key([_Latent()], torch.bfloat16, cuda) is None


def test_bucket_values_are_checked():
    for bad in ([0], [256, -1], [True], ["1024"]):
        with pytest.raises(ValueError, match="decode_context_buckets must be positive ints"):
            CompilationConfig(decode_context_buckets=bad).verify()
    CompilationConfig(decode_context_buckets=[]).verify()
