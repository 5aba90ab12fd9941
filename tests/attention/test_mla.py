"""MLA over the paged latent cache: the absorbed decode form and the expanded prefill form against
a naive float64 attention on expanded per-head K/V, the op inside a forward context, and the
latent cache's size by arithmetic."""

from __future__ import annotations

import random

import pytest
import torch

from v1_engine.attention.backend import AttentionMetadata
from v1_engine.attention.cpu import CPUAttentionBackend
from v1_engine.attention.mla_cpu import (
    gather_paged_latent,
    mla_decode_absorbed,
    mla_prefill_expanded,
    write_latent_to_cache,
)
from v1_engine.forward_context import set_forward_context
from v1_engine.layers.mla import (
    MLAAttention,
    latent_kv_bytes_per_token,
    per_head_kv_bytes_per_token,
)
from v1_engine.worker.kv_sizing import kv_bytes_per_block

HEADS, NOPE, ROPE, V, RANK = 4, 16, 8, 12, 32
BLOCK_SIZE, NUM_BLOCKS = 4, 32
SCALE = (NOPE + ROPE) ** -0.5


def _weights(generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(kv_b_proj weight [H * (NOPE + V), RANK], W_UK, W_UV) as the layer splits them."""
    kv_b = torch.randn(HEADS * (NOPE + V), RANK, generator=generator) * 0.3
    layer = MLAAttention(HEADS, NOPE, ROPE, V, RANK, SCALE, "l")
    layer.absorb(kv_b)
    return kv_b, layer.w_uk, layer.w_uv


def _naive(q_nope, q_pe, latent, kv_b, scale):
    """Float64 causal attention with K/V expanded by kv_b_proj as one matmul (the HF form)."""
    q_len, k_len = q_nope.shape[0], latent.shape[0]
    kv = (latent[:, :RANK].double() @ kv_b.double().T).view(k_len, HEADS, NOPE + V)
    k_nope, value = kv.split([NOPE, V], dim=-1)
    key = torch.cat([k_nope, latent[:, None, RANK:].double().expand(-1, HEADS, -1)], dim=-1)
    query = torch.cat([q_nope, q_pe], dim=-1).double()
    scores = torch.einsum("qhd,khd->hqk", query, key) * scale
    q_pos = torch.arange(k_len - q_len, k_len)[:, None]
    scores = scores.masked_fill(torch.arange(k_len)[None, :] > q_pos, float("-inf"))
    return torch.einsum("hqk,khv->qhv", scores.softmax(-1), value)


def _paged_cache(seq_lens, generator):
    """A random latent cache and block tables (shuffled, non-contiguous blocks)."""
    cache = torch.randn(NUM_BLOCKS, BLOCK_SIZE, RANK + ROPE, generator=generator)
    free = list(range(NUM_BLOCKS))
    random.Random(1).shuffle(free)
    max_blocks = max(-(-n // BLOCK_SIZE) for n in seq_lens)
    table = torch.zeros(len(seq_lens), max_blocks, dtype=torch.int32)
    for i, n in enumerate(seq_lens):
        for j in range(-(-n // BLOCK_SIZE)):
            table[i, j] = free.pop()
    return cache, table


def test_absorbed_decode_equals_expanded_and_naive():
    generator = torch.Generator().manual_seed(0)
    kv_b, w_uk, w_uv = _weights(generator)
    seq_lens = [1, 5, 17, 32]
    cache, table = _paged_cache(seq_lens, generator)
    q_nope = torch.randn(len(seq_lens), HEADS, NOPE, generator=generator)
    q_pe = torch.randn(len(seq_lens), HEADS, ROPE, generator=generator)
    absorbed = mla_decode_absorbed(
        q_nope, q_pe, cache, table, torch.tensor(seq_lens), w_uk, w_uv, SCALE
    )
    for b, n in enumerate(seq_lens):
        latent = gather_paged_latent(cache, table[b], n)
        expanded = mla_prefill_expanded(
            q_nope[b : b + 1], q_pe[b : b + 1], latent, w_uk, w_uv, SCALE
        )
        naive = _naive(q_nope[b : b + 1], q_pe[b : b + 1], latent, kv_b, SCALE)
        torch.testing.assert_close(absorbed[b : b + 1], expanded, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(absorbed[b : b + 1].double(), naive, atol=1e-5, rtol=1e-5)


def test_absorbed_decode_in_bfloat16_stays_close_to_float32():
    generator = torch.Generator().manual_seed(1)
    _, w_uk, w_uv = _weights(generator)
    seq_lens = [9, 30]
    cache, table = _paged_cache(seq_lens, generator)
    q_nope = torch.randn(2, HEADS, NOPE, generator=generator)
    q_pe = torch.randn(2, HEADS, ROPE, generator=generator)
    lens = torch.tensor(seq_lens)
    exact = mla_decode_absorbed(q_nope, q_pe, cache, table, lens, w_uk, w_uv, SCALE)
    bf16 = mla_decode_absorbed(
        q_nope.bfloat16(),
        q_pe.bfloat16(),
        cache.bfloat16(),
        table,
        lens,
        w_uk.bfloat16(),
        w_uv.bfloat16(),
        SCALE,
    )
    assert bf16.dtype == torch.bfloat16
    torch.testing.assert_close(bf16.float(), exact, atol=0.1, rtol=0.05)


def test_expanded_prefill_chunk_over_cached_context_matches_naive():
    generator = torch.Generator().manual_seed(2)
    kv_b, w_uk, w_uv = _weights(generator)
    latent = torch.randn(13, RANK + ROPE, generator=generator)
    q_nope = torch.randn(5, HEADS, NOPE, generator=generator)
    q_pe = torch.randn(5, HEADS, ROPE, generator=generator)
    got = mla_prefill_expanded(q_nope, q_pe, latent, w_uk, w_uv, SCALE)
    expected = _naive(q_nope, q_pe, latent, kv_b, SCALE)
    torch.testing.assert_close(got.double(), expected, atol=1e-5, rtol=1e-5)


def test_latent_write_skips_padding_slots():
    cache = torch.zeros(2, BLOCK_SIZE, 3)
    write_latent_to_cache(
        torch.tensor([[1.0, 2.0], [3.0, 4.0]]),
        torch.tensor([[5.0], [6.0]]),
        cache,
        torch.tensor([6, -1]),
    )
    assert cache.view(-1, 3)[6].tolist() == [1.0, 2.0, 5.0]
    assert cache.abs().sum() == 8.0


def test_op_mixes_decode_and_prefill_requests_in_one_step():
    """Through the layer and the custom op: a decode request, a prefill chunk over cached
    context and a fresh prompt in one packed step; the step's latents land in the cache."""
    generator = torch.Generator().manual_seed(3)
    kv_b = torch.randn(HEADS * (NOPE + V), RANK, generator=generator) * 0.3
    layer = MLAAttention(HEADS, NOPE, ROPE, V, RANK, SCALE, "model.layers.0.mla")
    layer.absorb(kv_b)
    context_lens, query_lens = [6, 4, 0], [1, 3, 5]
    seq_lens = [c + q for c, q in zip(context_lens, query_lens)]
    cache, table = _paged_cache(seq_lens, generator)
    layer.kv_cache = cache
    slots = [
        int(table[i, p // BLOCK_SIZE]) * BLOCK_SIZE + p % BLOCK_SIZE
        for i, (c, n) in enumerate(zip(context_lens, seq_lens))
        for p in range(c, n)
    ]
    num_tokens = sum(query_lens)
    starts = torch.tensor([0, 1, 4, 9], dtype=torch.int32)
    metadata = AttentionMetadata(
        num_actual_tokens=num_tokens,
        query_start_loc=starts,
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_table=table,
        slot_mapping=torch.tensor(slots),
        max_query_len=5,
        max_seq_len=max(seq_lens),
        query_start_loc_cpu=starts,
        seq_lens_cpu=torch.tensor(seq_lens, dtype=torch.int32),
    )
    q_nope = torch.randn(num_tokens, HEADS, NOPE, generator=generator)
    q_pe = torch.randn(num_tokens, HEADS, ROPE, generator=generator)
    kv_c = torch.randn(num_tokens, RANK, generator=generator)
    k_pe = torch.randn(num_tokens, ROPE, generator=generator)
    with set_forward_context(metadata, CPUAttentionBackend(), [layer]):
        out = layer(q_nope, q_pe, kv_c, k_pe).view(num_tokens, HEADS, V)
    torch.testing.assert_close(cache.view(-1, RANK + ROPE)[slots], torch.cat([kv_c, k_pe], -1))
    for i, n in enumerate(seq_lens):
        s, e = int(starts[i]), int(starts[i + 1])
        latent = gather_paged_latent(cache, table[i], n)
        expected = _naive(q_nope[s:e], q_pe[s:e], latent, kv_b, SCALE)
        torch.testing.assert_close(out[s:e].double(), expected, atol=1e-5, rtol=1e-5)


def test_op_without_metadata_zero_fills():
    layer = MLAAttention(HEADS, NOPE, ROPE, V, RANK, SCALE, "l")
    layer.absorb(torch.randn(HEADS * (NOPE + V), RANK))
    with set_forward_context(None, CPUAttentionBackend(), [layer]):
        out = layer(
            torch.randn(3, HEADS, NOPE),
            torch.randn(3, HEADS, ROPE),
            torch.randn(3, RANK),
            torch.randn(3, ROPE),
        )
    assert out.shape == (3, HEADS * V) and not out.any()


@pytest.mark.parametrize(
    "layers, heads, latent_bytes, per_head_bytes",
    [(27, 16, 31_104, 276_480), (61, 128, 70_272, 4_997_120)],
    ids=["v2-lite", "v3"],
)
def test_latent_cache_bytes_per_token(layers, heads, latent_bytes, per_head_bytes):
    """V2-Lite / V3 shapes in bf16: kv_lora_rank 512, rope 64, nope 128, v 128."""
    assert latent_kv_bytes_per_token(layers, 512, 64, torch.bfloat16) == latent_bytes
    assert per_head_kv_bytes_per_token(layers, heads, 128, 64, 128, torch.bfloat16) == (
        per_head_bytes
    )
    # The runner sizes the pool from the layers' own cache shapes: the same figure.
    mla_layers = [MLAAttention(heads, 128, 64, 128, 512, 1.0, f"l{i}") for i in range(layers)]
    assert kv_bytes_per_block(mla_layers, 16, torch.bfloat16) == 16 * latent_bytes
    saved = 1 - latent_bytes / per_head_bytes
    assert saved == pytest.approx(0.8875 if heads == 16 else 0.98594, abs=1e-4)


def test_absorb_keeps_one_copy_of_kv_b_proj():
    """W_UK and W_UV are views of kv_b_proj's weight: absorption adds no second copy, and a
    weight changed in place (a reload) is what attention sees."""
    kv_b = torch.randn(HEADS * (NOPE + V), RANK)
    layer = MLAAttention(HEADS, NOPE, ROPE, V, RANK, SCALE, "l")
    layer.absorb(kv_b)
    base = kv_b.untyped_storage().data_ptr()
    assert layer.w_uk.untyped_storage().data_ptr() == base
    assert layer.w_uv.untyped_storage().data_ptr() == base
    per_head = kv_b.view(HEADS, NOPE + V, RANK)
    torch.testing.assert_close(layer.w_uv, per_head[:, NOPE:].transpose(1, 2), atol=0, rtol=0)
    kv_b.mul_(2.0)
    torch.testing.assert_close(layer.w_uk, per_head[:, :NOPE], atol=0, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("q_len, k_len", [(7, 7), (3, 11)], ids=["fresh", "over-context"])
def test_fused_sdpa_prefill_matches_expanded_reference(dtype, q_len, k_len):
    """The Triton backend's prefill form (values padded to the q/k head size, 4-D inputs, a
    lower-right causal bias for a chunk over cached context) equals the float32 expanded form."""
    from v1_engine.attention.mla_triton import mla_prefill_expanded_sdpa

    gen = torch.Generator().manual_seed(9)
    _, w_uk, w_uv = _weights(gen)
    latent = torch.randn(k_len, RANK + ROPE, generator=gen)
    q_nope = torch.randn(q_len, HEADS, NOPE, generator=gen)
    q_pe = torch.randn(q_len, HEADS, ROPE, generator=gen)
    args = [t.to(dtype) for t in (q_nope, q_pe, latent, w_uk, w_uv)]
    got = mla_prefill_expanded_sdpa(*args, SCALE)
    want = mla_prefill_expanded(q_nope, q_pe, latent, w_uk, w_uv, SCALE)
    assert got.shape == (q_len, HEADS, V) and got.dtype == dtype
    tolerance = 1e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(got.float(), want, atol=tolerance, rtol=tolerance)


@pytest.mark.gpu
@pytest.mark.parametrize("q_len, k_len", [(256, 256), (128, 640)], ids=["fresh", "over-context"])
def test_gpu_prefill_runs_a_fused_sdpa_kernel(q_len, k_len):
    """On the GPU the prefill form runs flash or memory-efficient attention (no math fallback,
    which computes in float32): with only those two allowed, SDPA raises if neither fits.
    DeepSeek-V2-Lite's sizes (16 heads, nope 128, rope 64, v 128, rank 512), bf16."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from v1_engine.attention.mla_triton import mla_prefill_expanded_sdpa

    heads, nope, rope, v, rank = 16, 128, 64, 128, 512
    gen = torch.Generator().manual_seed(10)
    kv_b = torch.randn(heads * (nope + v), rank, generator=gen) * rank**-0.5
    layer = MLAAttention(heads, nope, rope, v, rank, (nope + rope) ** -0.5, "l")
    layer.absorb(kv_b)
    latent = torch.randn(k_len, rank + rope, generator=gen)
    q_nope = torch.randn(q_len, heads, nope, generator=gen)
    q_pe = torch.randn(q_len, heads, rope, generator=gen)
    tensors = (q_nope, q_pe, latent, layer.w_uk, layer.w_uv)
    args = [t.to("cuda", torch.bfloat16) for t in tensors]
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]):
        got = mla_prefill_expanded_sdpa(*args, layer.scale)
    want = mla_prefill_expanded(*[t.cuda() for t in tensors], layer.scale)
    torch.testing.assert_close(got.float(), want, atol=3e-2, rtol=3e-2)
