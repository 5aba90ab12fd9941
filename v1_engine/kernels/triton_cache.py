"""Cache writes in Triton: the FP8 K/V cache write (quantize each new token's K and V and scatter
them into the paged e4m3 cache at their slots) and the MLA latent cache write (each new token's
latent and rope key into its slot of the paged latent cache).

Both run one program per token (the FP8 write covers all of its kv heads, for K and V). A negative
slot marks a padding token and the program returns. The per-layer scales are read from device
memory, so a CUDA graph that captured the launch sees a scale updated later; nothing here reads a
device value on the host, and the grid depends only on tensor shapes.

Rounding. The value stored is `clamp(x / scale, -448, 448)` rounded to the nearest e4m3 value,
ties to even: exactly what `torch.Tensor.to(torch.float8_e4m3fn)` produces. The kernel rounds onto
the e4m3 grid in float32 itself and then casts a value the cast represents exactly: the Triton
interpreter's float-to-fp8 cast does not round to nearest even (and loses mantissa carries), so
with an explicit rounding the interpreter, the GPU and the PyTorch path agree bit for bit.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from v1_engine.kernels.pdl import launch_options, pdl_enter
from v1_engine.kernels.triton_quant import _round_to_e4m3


@triton.jit
def quantize_e4m3(x, scale):
    """x / scale saturated to +-448 and rounded onto the e4m3 grid (see the module), in float32:
    the value the e4m3 cast then stores exactly. Shared with the fused decode attention."""
    x = tl.div_rn(x.to(tl.float32), scale)
    x = tl.minimum(tl.maximum(x, -448.0), 448.0)  # fp8.FP8_MAX: saturate, never NaN
    return _round_to_e4m3(x)


@triton.jit
def _quantize_row(src_ptr, dst_ptr, scale, offs_src, offs_dst, mask):
    x = quantize_e4m3(tl.load(src_ptr + offs_src, mask=mask, other=0.0), scale)
    tl.store(dst_ptr + offs_dst, x.to(dst_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _quantize_and_cache_kernel(
    key_ptr,
    value_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_mapping_ptr,
    k_scale_ptr,
    v_scale_ptr,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_SIZE: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_enter(PDL)
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token)
    if slot < 0:
        return
    heads = tl.arange(0, HEADS_PAD)
    dims = tl.arange(0, HEAD_PAD)
    mask = (heads[:, None] < NUM_KV_HEADS) & (dims[None, :] < HEAD_SIZE)
    offs_dst = slot * (NUM_KV_HEADS * HEAD_SIZE) + heads[:, None] * HEAD_SIZE + dims[None, :]
    offs_k = token * stride_kt + heads[:, None] * stride_kh + dims[None, :]
    offs_v = token * stride_vt + heads[:, None] * stride_vh + dims[None, :]
    _quantize_row(key_ptr, k_cache_ptr, tl.load(k_scale_ptr), offs_k, offs_dst, mask)
    _quantize_row(value_ptr, v_cache_ptr, tl.load(v_scale_ptr), offs_v, offs_dst, mask)


def quantize_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor,
    v_scale: torch.Tensor,
) -> None:
    """Quantize key/value [>=T, Hkv, D] into the e4m3 kv_cache [2, blocks, block_size, Hkv, D].

    Token t goes to slot_mapping[t] (negative: skipped); only the first T = len(slot_mapping)
    rows are read. k_scale / v_scale are float32 [1] tensors on the cache's device. The caller
    validates the arguments (cache_ops.check_cache_args).
    """
    num_tokens = slot_mapping.shape[0]
    if num_tokens == 0:
        return
    if key.stride(2) != 1:
        key = key.contiguous()
    if value.stride(2) != 1:
        value = value.contiguous()
    num_kv_heads, head_size = kv_cache.shape[3], kv_cache.shape[4]
    head_pad = triton.next_power_of_2(head_size)
    _quantize_and_cache_kernel[(num_tokens,)](
        key,
        value,
        kv_cache[0],
        kv_cache[1],
        slot_mapping,
        k_scale,
        v_scale,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        NUM_KV_HEADS=num_kv_heads,
        HEAD_SIZE=head_size,
        HEADS_PAD=triton.next_power_of_2(num_kv_heads),
        HEAD_PAD=head_pad,
        num_warps=4 if num_kv_heads * head_pad >= 1024 else 2,
        **launch_options(key.device),
    )


@triton.jit
def _write_latent_kernel(
    cache_ptr,
    kv_c_ptr,
    k_pe_ptr,
    slot_mapping_ptr,
    stride_ct,
    stride_pt,
    RANK: tl.constexpr,
    ROPE: tl.constexpr,
    RANK_PAD: tl.constexpr,
    ROPE_PAD: tl.constexpr,
    PDL: tl.constexpr,
):
    """One token's latent and rope key into its cache slot; a negative slot is padding."""
    pdl_enter(PDL)
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token)
    if slot < 0:
        return
    dims = tl.arange(0, RANK_PAD)
    rope_dims = tl.arange(0, ROPE_PAD)
    row = cache_ptr + slot * (RANK + ROPE)
    kv_c = tl.load(kv_c_ptr + token * stride_ct + dims, mask=dims < RANK)
    k_pe = tl.load(k_pe_ptr + token * stride_pt + rope_dims, mask=rope_dims < ROPE)
    tl.store(row + dims, kv_c.to(cache_ptr.dtype.element_ty), mask=dims < RANK)
    tl.store(row + RANK + rope_dims, k_pe.to(cache_ptr.dtype.element_ty), mask=rope_dims < ROPE)


def write_latent_cache(
    kv_c: torch.Tensor, k_pe: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """kv_c [T, R] and k_pe [T, P] into kv_cache [num_blocks, block_size, R + P] at slot_mapping
    [T] (int64; negative = padding, skipped), without reading anything on the host."""
    num_tokens = slot_mapping.shape[0]
    rank, rope = kv_c.shape[-1], k_pe.shape[-1]
    if kv_cache.shape[-1] != rank + rope or not kv_cache.is_contiguous():
        raise ValueError(
            f"kv_cache must be a contiguous [num_blocks, block_size, {rank + rope}] tensor, got "
            f"{tuple(kv_cache.shape)}"
        )
    if kv_c.shape[0] < num_tokens or k_pe.shape[0] < num_tokens:
        raise ValueError(f"kv_c / k_pe have fewer rows than slot_mapping's {num_tokens}")
    if kv_c.stride(-1) != 1 or k_pe.stride(-1) != 1:
        raise ValueError("kv_c and k_pe must have a unit last stride")
    if num_tokens == 0:
        return
    _write_latent_kernel[(num_tokens,)](
        kv_cache,
        kv_c,
        k_pe,
        slot_mapping,
        kv_c.stride(0),
        k_pe.stride(0),
        RANK=rank,
        ROPE=rope,
        RANK_PAD=triton.next_power_of_2(rank),
        ROPE_PAD=triton.next_power_of_2(rope),
        num_warps=4,
        **launch_options(kv_cache.device),
    )
