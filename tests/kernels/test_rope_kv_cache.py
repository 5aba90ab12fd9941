"""The rotary embedding fused with the K/V cache write (kernels/triton_rope.py's
`rotary_embedding_and_cache`, the Triton backend's `forward_rope`) against the two kernels it
replaces: the rotary kernel and the cache write. Under the Triton interpreter on CPU (tiny
shapes, both styles, strided views of a fused QKV output, padding slots), on the device with
CUDA (Llama-3-8B heads, the backend's attention output against the unfused backend path)."""

from __future__ import annotations

import pytest
import torch

# On the CPU the kernels run under Triton's interpreter, which tests/conftest.py turns on
# before any kernel module is imported.
pytest.importorskip("triton")

from v1_engine.kernels import triton_rope
from v1_engine.kernels.cache_ops import _reshape_and_cache_torch
from v1_engine.layers.rotary import RotaryEmbedding, compute_inv_freq

_CUDA = torch.cuda.is_available()
DEVICE = "cuda" if _CUDA else "cpu"


def make_rope(head_size: int, is_neox_style: bool) -> RotaryEmbedding:
    inv_freq = compute_inv_freq(head_size, {"rope_type": "default", "rope_theta": 10000.0})
    return RotaryEmbedding(head_size, 4096, inv_freq, 1.0, is_neox_style).to(DEVICE)


def fused_qkv(tokens, hq, hkv, d, dtype, seed):
    """query, key, value [T, H, D] as views of one [T, (Hq + 2 Hkv) D] GEMM output."""
    gen = torch.Generator().manual_seed(seed)
    qkv = torch.randn(tokens, (hq + 2 * hkv) * d, generator=gen).to(DEVICE, dtype)
    q, k, v = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
    return q.view(tokens, hq, d), k.view(tokens, hkv, d), v.view(tokens, hkv, d)


def check_against_unfused(tokens, hq, hkv, d, dtype, neox, block_size=4, seed=0):
    q, k, v = fused_qkv(tokens, hq, hkv, d, dtype, seed)
    rope = make_rope(d, neox)
    gen = torch.Generator().manual_seed(seed + 1)
    positions = torch.randint(0, 4096, (tokens,), generator=gen).to(DEVICE)
    num_blocks = tokens // block_size + 3
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:tokens]
    slots[tokens // 2] = -1  # a padding token: nothing written
    slots = slots.to(DEVICE)
    kv_cache = torch.randn(2, num_blocks, block_size, hkv, d, generator=gen).to(DEVICE, dtype)
    expected = kv_cache.clone()
    tables = (rope.cos_cache, rope.sin_cache, neox)
    q_rot = triton_rope.rotary_embedding_and_cache(positions, q, k, v, *tables, kv_cache, slots)
    q_ref, k_ref = triton_rope.rotary_embedding(positions, q, k, *tables)
    _reshape_and_cache_torch(k_ref, v, expected, slots, None, None)
    assert q_rot.is_contiguous() and torch.equal(q_rot, q_ref)
    assert torch.equal(kv_cache, expected)


@pytest.mark.parametrize("neox", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_and_cache_equals_rope_then_write(neox, dtype):
    """20 query heads in two head blocks, 4 kv heads, D = 24 (half not a power of two)."""
    if _CUDA:
        pytest.skip("the gpu case covers this on a CUDA machine")
    check_against_unfused(5, 20, 4, 24, dtype, neox)


def test_rope_and_cache_rejects_bad_arguments():
    q, k, v = fused_qkv(2, 4, 2, 8, torch.float32, 0)
    rope = make_rope(8, True)
    tables = (rope.cos_cache, rope.sin_cache, True)
    positions = torch.zeros(2, dtype=torch.int64, device=DEVICE)
    slots = torch.zeros(2, dtype=torch.int64, device=DEVICE)
    cache = torch.zeros(2, 2, 4, 2, 8, device=DEVICE)
    fn = triton_rope.rotary_embedding_and_cache
    with pytest.raises(ValueError, match="kv_cache must be"):
        fn(positions, q, k, v, *tables, cache.to(torch.bfloat16), slots)
    with pytest.raises(ValueError, match="kv_cache must be"):
        fn(positions, q, k, v, *tables, torch.zeros(2, 2, 4, 3, 8, device=DEVICE), slots)
    with pytest.raises(ValueError, match="slot_mapping must be int64"):
        fn(positions, q, k, v, *tables, cache, slots.int())
    with pytest.raises(ValueError, match="value must be"):
        fn(positions, q, k, v[:, :1], *tables, cache, slots)


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 3, 64])
def test_gpu_llama3_heads(tokens):
    if not _CUDA:
        pytest.skip("needs a CUDA device")
    check_against_unfused(tokens, 32, 8, 128, torch.bfloat16, True, block_size=16)
