"""Paged attention with the rotary embedding and the new token's K/V write fused in (decode
steps: `paged_attention(..., rope=...)`) against the two launches it replaces: the rotation
fused with the cache write (kernels/triton_rope.py), then paged attention over the cache.

Under the Triton interpreter on CPU: tiny shapes, both rotary styles, split-KV, contexts that end
on a tile boundary; the cache must come out identical and the outputs equal. On the device: the
Llama-3-8B heads at decode batch sizes, the cache identical and outputs within rounding.
"""

from __future__ import annotations

import pytest
import torch

# On the CPU the kernels run under Triton's interpreter, which tests/conftest.py turns on
# before any kernel module is imported.
pytest.importorskip("triton")

from v1_engine.kernels import triton_attention as ta
from v1_engine.kernels import triton_rope
from v1_engine.kernels.triton_cache import quantize_and_cache
from v1_engine.layers.rotary import RotaryEmbedding, compute_inv_freq

_CUDA = torch.cuda.is_available()
DEVICE = "cuda" if _CUDA else "cpu"


def decode_case(context_lens, hq, hkv, d, block_size, dtype, neox, seed):
    """A decode step: each request's new token at position = its context length, its query /
    key / value as views of one QKV output, a randomly filled cache with shuffled blocks."""
    gen = torch.Generator().manual_seed(seed)
    seq_lens = [c + 1 for c in context_lens]
    blocks = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(blocks) + 2
    order = torch.randperm(num_blocks, generator=gen)
    table = torch.zeros(len(seq_lens), max(blocks), dtype=torch.int32)
    used = 0
    for i, n in enumerate(blocks):
        table[i, :n] = order[used : used + n].int()
        used += n
    positions = torch.tensor(context_lens, dtype=torch.int64)
    slots = torch.tensor(
        [int(table[i, p // block_size]) * block_size + p % block_size for i, p in
         enumerate(context_lens)], dtype=torch.int64,
    )  # fmt: skip
    tokens = len(seq_lens)
    qkv = torch.randn(tokens, (hq + 2 * hkv) * d, generator=gen).to(DEVICE, dtype)
    q, k, v = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
    inv_freq = compute_inv_freq(d, {"rope_type": "default", "rope_theta": 10000.0})
    rope = RotaryEmbedding(d, 4096, inv_freq, 1.0, neox).to(DEVICE)
    return {
        "q": q.view(tokens, hq, d),
        "k": k.view(tokens, hkv, d),
        "v": v.view(tokens, hkv, d),
        "kv_cache": torch.randn(2, num_blocks, block_size, hkv, d, generator=gen).to(DEVICE, dtype),
        "block_table": table.to(DEVICE),
        "seq_lens": torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE),
        "query_start_loc": torch.arange(tokens + 1, dtype=torch.int32, device=DEVICE),
        "positions": positions.to(DEVICE),
        "slots": slots.to(DEVICE),
        "tables": (rope.cos_cache, rope.sin_cache, neox),
        "max_seq_len": max(seq_lens),
        "scale": d**-0.5,
    }


def unfused(case, num_splits):
    cache = case["kv_cache"].clone()
    q = triton_rope.rotary_embedding_and_cache(
        case["positions"], case["q"], case["k"], case["v"], *case["tables"], cache, case["slots"]
    )
    out = torch.full(q.shape, float("nan"), dtype=q.dtype, device=q.device)
    ta.paged_attention(q, cache, case["block_table"], case["seq_lens"], case["query_start_loc"],
                       1, case["max_seq_len"], case["scale"], out, num_splits=num_splits)  # fmt: skip
    return out, cache


def fused(case, num_splits):
    cache = case["kv_cache"].clone()
    cos, sin, neox = case["tables"]
    rope = (case["k"], case["v"], case["positions"], cos, sin, neox, case["slots"])
    out = torch.full(case["q"].shape, float("nan"), dtype=case["q"].dtype, device=DEVICE)
    ta.paged_attention(case["q"], cache, case["block_table"], case["seq_lens"],
                       case["query_start_loc"], 1, case["max_seq_len"], case["scale"], out,
                       num_splits=num_splits, rope=rope)  # fmt: skip
    return out, cache


@pytest.mark.skipif(_CUDA, reason="the gpu case covers this on a CUDA machine")
@pytest.mark.parametrize("neox", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_splits", [1, 2, 4])
def test_fused_decode_rope_equals_rope_write_then_attend(neox, dtype, num_splits):
    """Contexts 31 / 63 put the new token last in a 32-token tile (float32 decode tile) and
    last in a block; 64 first in one; GQA 3 padded to 4; head size 24 (half not a power of 2)."""
    case = decode_case([31, 63, 64, 100, 5], 6, 2, 24, 8, dtype, neox, seed=11)
    out_ref, cache_ref = unfused(case, num_splits)
    out, cache = fused(case, num_splits)
    assert torch.equal(cache, cache_ref), "the new K/V must land in the cache exactly"
    assert not out.isnan().any()
    torch.testing.assert_close(out, out_ref, rtol=0, atol=0)


@pytest.mark.skipif(_CUDA, reason="the gpu case covers this on a CUDA machine")
def test_fused_decode_rope_with_a_padding_request_and_empty_splits():
    """A trailing request without a query token (its query start is num_tokens: the kernel
    must read neither its position nor its slot) and 16 splits over contexts of 1-4 tiles
    (empty splits whose ranges start past the block-table row)."""
    case = decode_case([3, 100, 40], 4, 2, 16, 8, torch.float32, True, seed=17)
    tokens = case["q"].shape[0]
    case["seq_lens"] = torch.cat([case["seq_lens"], case["seq_lens"][:1]])
    case["query_start_loc"] = torch.cat([case["query_start_loc"], case["query_start_loc"][-1:]])
    case["block_table"] = torch.cat([case["block_table"], case["block_table"][:1]])
    out_ref, cache_ref = unfused(case, 16)
    out, cache = fused(case, 16)
    assert out.shape[0] == tokens
    assert torch.equal(cache, cache_ref)
    torch.testing.assert_close(out, out_ref, rtol=0, atol=0)


def fp8_cache_pair(case, num_splits):
    """(fused, reference) outputs and caches over an e4m3 copy of the case's cache: the fused
    launch against rotary -> FP8 cache write -> attention."""
    cache0 = (case["kv_cache"].float() * 8).to(torch.float8_e4m3fn)
    scales = {"k_scale": torch.tensor([0.05], device=DEVICE),
              "v_scale": torch.tensor([0.07], device=DEVICE)}  # fmt: skip
    cos, sin, neox = case["tables"]
    meta = (case["block_table"], case["seq_lens"], case["query_start_loc"], 1,
            case["max_seq_len"], case["scale"])  # fmt: skip
    cache_ref = cache0.clone()
    q_rot, k_rot = triton_rope.rotary_embedding(case["positions"], case["q"], case["k"], cos,
                                                sin, neox)  # fmt: skip
    quantize_and_cache(k_rot, case["v"], cache_ref, case["slots"], *scales.values())
    out_ref = torch.full_like(q_rot, float("nan"))
    ta.paged_attention(q_rot, cache_ref, *meta, out_ref, num_splits=num_splits, **scales)
    cache = cache0.clone()
    out = torch.full_like(q_rot, float("nan"))
    rope = (case["k"], case["v"], case["positions"], cos, sin, neox, case["slots"])
    ta.paged_attention(case["q"], cache, *meta, out, num_splits=num_splits, rope=rope, **scales)
    assert torch.equal(cache.view(torch.uint8), cache_ref.view(torch.uint8))
    assert not out.isnan().any()
    return out, out_ref


@pytest.mark.skipif(_CUDA, reason="the gpu case covers this on a CUDA machine")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_splits", [1, 4])
def test_fused_decode_rope_with_an_fp8_cache(dtype, num_splits):
    """An e4m3 cache: the kernel quantizes the rotated key and the value as the FP8 cache write
    does (kernels/triton_cache.py), so the cache and the outputs equal rotary -> FP8 write ->
    attention bit for bit."""
    case = decode_case([31, 63, 64, 100, 5], 6, 2, 24, 8, dtype, True, seed=13)
    out, out_ref = fp8_cache_pair(case, num_splits)
    torch.testing.assert_close(out, out_ref, rtol=0, atol=0)


def test_fused_decode_rope_rejects_prefill_and_bad_arguments():
    case = decode_case([3, 4], 4, 2, 16, 4, torch.float32, True, seed=1)
    cos, sin, neox = case["tables"]
    args = (case["q"], case["kv_cache"], case["block_table"], case["seq_lens"],
            case["query_start_loc"])  # fmt: skip
    out = torch.empty_like(case["q"])
    rope = (case["k"], case["v"], case["positions"], cos, sin, neox, case["slots"])
    with pytest.raises(ValueError, match="max_query_len 1"):
        ta.paged_attention(*args, 2, case["max_seq_len"], 0.25, out, rope=rope)
    bad_slots = (case["k"], case["v"], case["positions"], cos, sin, neox, case["slots"].int())
    with pytest.raises(ValueError, match="slot_mapping must be int64"):
        ta.paged_attention(*args, 1, case["max_seq_len"], 0.25, out, rope=bad_slots)
    bad_table = (case["k"], case["v"], case["positions"], cos[:, :4], sin, neox, case["slots"])
    with pytest.raises(ValueError, match="cos_cache must be float32"):
        ta.paged_attention(*args, 1, case["max_seq_len"], 0.25, out, rope=bad_table)


@pytest.mark.gpu
@pytest.mark.skipif(not _CUDA, reason="needs CUDA")
@pytest.mark.parametrize("batch", [1, 7, 64])
@pytest.mark.parametrize("num_splits", [None, 4])
def test_gpu_fused_decode_rope_llama3_heads(batch, num_splits):
    """32 query / 8 kv heads of 128, 16-token blocks, bf16, contexts around the 64-token tile."""
    gen = torch.Generator().manual_seed(batch)
    contexts = torch.randint(0, 1500, (batch,), generator=gen).tolist()
    contexts[0] = 127  # the new token last in a tile
    case = decode_case(contexts, 32, 8, 128, 16, torch.bfloat16, True, seed=batch)
    out_ref, cache_ref = unfused(case, num_splits)
    out, cache = fused(case, num_splits)
    assert torch.equal(cache, cache_ref)
    assert not out.isnan().any()
    torch.testing.assert_close(out, out_ref, rtol=2e-2, atol=2e-3)


@pytest.mark.gpu
@pytest.mark.skipif(not _CUDA, reason="needs CUDA")
@pytest.mark.parametrize("num_splits", [None, 4])
def test_gpu_fused_decode_rope_fp8_cache(num_splits):
    """Llama-3-8B heads over an e4m3 cache: the fused launch quantizes the new K/V exactly as the
    FP8 cache write, and attends as rotary -> FP8 write -> attention does."""
    case = decode_case([127, 700, 5, 1500], 32, 8, 128, 16, torch.bfloat16, True, seed=21)
    out, out_ref = fp8_cache_pair(case, num_splits)
    torch.testing.assert_close(out, out_ref, rtol=2e-2, atol=2e-3)


@pytest.mark.gpu
@pytest.mark.skipif(not _CUDA, reason="needs CUDA")
def test_gpu_fused_decode_in_a_cuda_graph_reads_fresh_values():
    """QKV GEMM (a PDL kernel) -> fused decode attention, captured once and replayed over three
    decode steps with new hidden states and metadata copied in between, as the engine's decode
    graphs are: the attention reads its metadata before the PDL wait and q / k / v after it, so
    a stale read of either would show against the same steps run eagerly."""
    from v1_engine.kernels.triton_gemv import skinny_gemm

    hq, hkv, d, block = 32, 8, 128, 16
    gen = torch.Generator().manual_seed(5)
    w = (torch.randn((hq + 2 * hkv) * d, 4096, generator=gen) * 0.02).to(DEVICE, torch.bfloat16)
    case = decode_case([200, 37], hq, hkv, d, block, torch.bfloat16, True, seed=5)
    cos, sin, neox = case["tables"]
    x = torch.zeros(2, 4096, device=DEVICE, dtype=torch.bfloat16)
    seq_lens, positions, slots = case["seq_lens"], case["positions"], case["slots"]
    cache = case["kv_cache"].clone()
    out = torch.empty(2, hq, d, device=DEVICE, dtype=torch.bfloat16)

    def step(x, cache, out):
        qkv = skinny_gemm(x, w)
        q, k, v = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
        rope = (k.view(2, hkv, d), v.view(2, hkv, d), positions, cos, sin, neox, slots)
        ta.paged_attention(q.view(2, hq, d), cache, case["block_table"], seq_lens,
                           case["query_start_loc"], 1, 256, d**-0.5, out, rope=rope)  # fmt: skip

    step(x, cache, out)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step(x, cache, out)
    eager_cache = case["kv_cache"].clone()
    eager_out = torch.empty_like(out)
    cache.copy_(case["kv_cache"])
    for n in range(3):
        x.copy_(torch.randn(2, 4096, generator=gen).to(DEVICE, torch.bfloat16))
        graph.replay()
        step(x, eager_cache, eager_out)
        torch.cuda.synchronize()
        assert torch.equal(out, eager_out), f"replay {n}"
        assert torch.equal(cache, eager_cache), f"replay {n}"
        # The next decode step: one more token per request, in the same blocks.
        positions.add_(1)
        seq_lens.add_(1)
        slots.add_(1)
