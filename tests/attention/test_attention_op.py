"""The forward context and the opaque attention op that models call."""

from __future__ import annotations

import pytest
import torch

from v1_engine.attention.backend import AttentionMetadata
from v1_engine.attention.cpu import CPUAttentionBackend, causal_attention
from v1_engine.forward_context import get_forward_context, set_forward_context
from v1_engine.layers.attention import Attention

NUM_HEADS, NUM_KV_HEADS, HEAD_SIZE, BLOCK_SIZE = 4, 2, 8, 4


def _one_request_metadata(num_tokens: int) -> AttentionMetadata:
    """One request prefilling `num_tokens` into blocks 3, 1, ... of the cache."""
    blocks = [3, 1, 0, 2][: -(-num_tokens // BLOCK_SIZE)]
    slots = [blocks[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in range(num_tokens)]
    qsl = torch.tensor([0, num_tokens], dtype=torch.int32)
    seq_lens = torch.tensor([num_tokens], dtype=torch.int32)
    return AttentionMetadata(
        num_actual_tokens=num_tokens,
        query_start_loc=qsl,
        seq_lens=seq_lens,
        block_table=torch.tensor([blocks], dtype=torch.int32),
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        max_query_len=num_tokens,
        max_seq_len=num_tokens,
        query_start_loc_cpu=qsl,
        seq_lens_cpu=seq_lens,
    )


def _layer(name: str = "model.layers.0.self_attn.attn") -> Attention:
    layer = Attention(NUM_HEADS, HEAD_SIZE, HEAD_SIZE**-0.5, NUM_KV_HEADS, layer_name=name)
    layer.kv_cache = torch.full((2, 4, BLOCK_SIZE, NUM_KV_HEADS, HEAD_SIZE), float("nan"))
    return layer


def _qkv(num_tokens: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(num_tokens)
    return (
        torch.randn(num_tokens, NUM_HEADS * HEAD_SIZE, generator=gen),
        torch.randn(num_tokens, NUM_KV_HEADS * HEAD_SIZE, generator=gen),
        torch.randn(num_tokens, NUM_KV_HEADS * HEAD_SIZE, generator=gen),
    )


def test_no_context_outside_set_forward_context():
    with pytest.raises(RuntimeError, match="no forward context"):
        get_forward_context()


def test_forward_context_refuses_nesting_and_is_cleared_after_errors():
    backend = CPUAttentionBackend()
    outer = set_forward_context(None, attn_backend=backend, attention_layers=[])
    inner = set_forward_context(None, attn_backend=backend, attention_layers=[])
    with outer, pytest.raises(RuntimeError, match="nested"), inner:
        pass
    failing = set_forward_context(None, attn_backend=backend, attention_layers=[])
    with pytest.raises(ValueError, match="boom"), failing:
        raise ValueError("boom")
    with pytest.raises(RuntimeError):
        get_forward_context()


def test_layer_forward_runs_backend_on_its_own_cache():
    layers = [_layer("a"), _layer("b")]
    q, k, v = _qkv(7)
    with set_forward_context(
        _one_request_metadata(7), attn_backend=CPUAttentionBackend(), attention_layers=layers
    ):
        out = layers[1](q, k, v)
    expected = causal_attention(
        q.view(7, NUM_HEADS, HEAD_SIZE),
        k.view(7, NUM_KV_HEADS, HEAD_SIZE),
        v.view(7, NUM_KV_HEADS, HEAD_SIZE),
        HEAD_SIZE**-0.5,
    )
    torch.testing.assert_close(out, expected.reshape(7, -1), atol=1e-6, rtol=1e-6)
    assert layers[0].kv_cache.isnan().all(), "the other layer's cache must stay untouched"
    assert not layers[1].kv_cache[:, [3, 1]].reshape(2, 8, -1)[:, :7].isnan().any()


def test_run_without_metadata_gives_zeros():
    layer = _layer()
    q, k, v = _qkv(3)
    with set_forward_context(None, attn_backend=CPUAttentionBackend(), attention_layers=[layer]):
        out = layer(q, k, v)
    assert torch.equal(out, torch.zeros(3, NUM_HEADS * HEAD_SIZE))


def test_op_traces_as_one_opaque_call_under_torch_compile():
    layer = _layer()
    q, k, v = _qkv(5)
    compiled = torch.compile(
        lambda q, k, v: layer(q * 2.0, k, v) + 1.0, fullgraph=True, backend="eager"
    )
    with set_forward_context(
        _one_request_metadata(5), attn_backend=CPUAttentionBackend(), attention_layers=[layer]
    ):
        got = compiled(q, k, v)
    layer.kv_cache.fill_(float("nan"))
    with set_forward_context(
        _one_request_metadata(5), attn_backend=CPUAttentionBackend(), attention_layers=[layer]
    ):
        expected = layer(q * 2.0, k, v) + 1.0
    torch.testing.assert_close(got, expected, atol=0, rtol=0)
