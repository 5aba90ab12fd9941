"""The FP8 decode kinds of the skinny GEMMs (kernels/triton_gemv_fp8.py, whose launch table,
launch rules and fma / wgmma helpers they share): kernels for decode-sized M (the fma body, M <=
triton_gemv.FMA_MAX_M) that skip an activation quant kernel. Program n owns BLOCK_N output
columns over all of K, never split.

- "weight_only" (`fp8_weight_only_gemm`): a bf16/fp16 activation times an e4m3 weight with
  per-channel scales, the activation not quantized (the ops of compile/passes/fp8_linear_ops.py
  run it for o_proj's input and for the down projection's);
- "gated" (`fp8_gated_gemm`): the gate_up GEMM of e4m3 operands with SiLU-and-mul in its
  epilogue, writing the bf16 product the down projection reads; the fma body, or "wgmma" with
  the gate and up tiles each in FP8 warpgroup MMAs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from v1_engine.kernels import interpreting
from v1_engine.kernels.pdl import pdl_release, pdl_wait
from v1_engine.kernels.triton_gemv import _silu_mul
from v1_engine.kernels.triton_gemv_fp8 import (
    FP8_DTYPE,
    _check_out_dtype,
    _constexprs,
    _fma_accumulators,
    _fma_result,
    _fma_rows,
    _load_weight_f32,
    _store_rows,
    _swapped_dot,
    _vector_stride,
    resolve_fp8_launch,
)


@triton.jit(do_not_specialize=["M", "stride_sa", "stride_sb"])
def _fp8_decode_kernel(
    a_ptr,
    b_ptr,
    scale_a_ptr,
    scale_b_ptr,
    bias_ptr,
    out_ptr,
    M,
    N,
    K,
    stride_am,
    stride_bn,
    stride_om,
    stride_sa,
    stride_sb,
    A_FP8: tl.constexpr,
    GATED: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    DOT_F32: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    NUM_STAGES: tl.constexpr,
    NATIVE: tl.constexpr,
    HW: tl.constexpr,
    PDL: tl.constexpr,
):
    """The decode kinds: program n owns BLOCK_N of the N output columns over all of K.
    A_FP8 False ("weight_only"): out = (a @ b^T) * scale_b (+ bias), a in 16-bit floats.
    A_FP8 and GATED ("gated"): b holds N gate rows then N up rows; gate and up are
    (a @ rows^T) * scale_a * scale_b, each rounded to out's dtype as scaled_mm stores it, and out
    = silu(gate) * up with kernels/triton_fused.py's roundings. The fma body, or with NATIVE
    (the gated kind's "wgmma" body) the gate and up tiles each in FP8 warpgroup MMAs."""
    pdl_wait(PDL)
    tile = tl.program_id(0)
    offs_n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    n_mask = offs_n < N
    m_mask = offs_m < M
    g_ptrs = b_ptr + offs_n[:, None].to(tl.int64) * stride_bn + offs_k[None, :]
    u_ptrs = g_ptrs + N.to(tl.int64) * stride_bn
    if NATIVE:
        a_ptrs = a_ptr + offs_m[:, None].to(tl.int64) * stride_am + offs_k[None, :]
        gate_t = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
        up_t = tl.zeros_like(gate_t)
        for k in tl.range(0, K, BLOCK_K, num_stages=NUM_STAGES):
            k_mask = offs_k[None, :] < K - k
            gate_t += _swapped_dot(a_ptrs, g_ptrs, m_mask, n_mask, k_mask, DOT_F32, True)
            up_t += _swapped_dot(a_ptrs, u_ptrs, m_mask, n_mask, k_mask, DOT_F32, True)
            a_ptrs += BLOCK_K
            g_ptrs += BLOCK_K
            u_ptrs += BLOCK_K
        pdl_release(PDL)
        gate = tl.trans(gate_t)
        up = tl.trans(up_t)
    else:
        a_row = a_ptr + offs_k  # row 0; rows follow at stride_am (see _fma_rows)
        g0, g1, g2, g3 = _fma_accumulators(BLOCK_N, BLOCK_K)
        u0, u1, u2, u3 = _fma_accumulators(BLOCK_N, BLOCK_K)
        for k in tl.range(0, K, BLOCK_K, num_stages=NUM_STAGES):
            k_row = offs_k < K - k
            w32 = _load_weight_f32(g_ptrs, n_mask, k_row, DOT_F32)
            g0, g1, g2, g3 = _fma_rows(g0, g1, g2, g3, a_row, stride_am, M, w32, k_row, a_row,
                                       0, 1.0, False, BLOCK_M, DOT_F32)  # fmt: skip
            if GATED:
                w32 = _load_weight_f32(u_ptrs, n_mask, k_row, DOT_F32)
                u0, u1, u2, u3 = _fma_rows(u0, u1, u2, u3, a_row, stride_am, M, w32, k_row,
                                           a_row, 0, 1.0, False, BLOCK_M, DOT_F32)  # fmt: skip
                u_ptrs += BLOCK_K
            a_row += BLOCK_K
            g_ptrs += BLOCK_K
        pdl_release(PDL)
        gate = _fma_result(g0, g1, g2, g3, offs_m, BLOCK_M)
        up = _fma_result(u0, u1, u2, u3, offs_m, BLOCK_M)
    dtype = out_ptr.dtype.element_ty
    if A_FP8:
        scale_a = tl.load(scale_a_ptr + offs_m * stride_sa, mask=m_mask, other=0.0)
        gate = gate * scale_a[:, None]
    gate = gate * tl.load(scale_b_ptr + offs_n * stride_sb, mask=n_mask, other=0.0)[None, :]
    if GATED:
        up = up * scale_a[:, None]
        up_scale = tl.load(scale_b_ptr + (N + offs_n) * stride_sb, mask=n_mask, other=0.0)
        result = _silu_mul(gate, up * up_scale[None, :], dtype, HW)
    else:
        result = gate
        if HAS_BIAS:
            result += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    _store_rows(out_ptr, result, offs_m, offs_n, m_mask, n_mask, stride_om)


def _decode_constexprs(m: int, config: dict[str, int | str], device: torch.device) -> dict:
    constexprs = _constexprs(m, config, device) | {"HW": not interpreting()}
    del constexprs["SPLIT_K"]
    return constexprs


def _launch_decode(
    a: torch.Tensor,
    b: torch.Tensor,
    scale_a: torch.Tensor | None,
    scale_b: torch.Tensor,
    bias: torch.Tensor | None,
    out: torch.Tensor,
    config: dict[str, int | str],
) -> torch.Tensor:
    """`_fp8_decode_kernel` over out's columns: weight-only without scale_a, gated with it."""
    m, cols = out.shape
    if m == 0:
        return out
    gated = scale_a is not None
    _fp8_decode_kernel[(triton.cdiv(cols, config["block_n"]),)](
        a,
        b,
        scale_a if gated else scale_b,
        scale_b,
        bias if bias is not None else out,
        out,
        m,
        cols,
        a.shape[1],
        a.stride(0),
        b.stride(0),
        out.stride(0),
        _vector_stride(scale_a) if gated else 0,
        _vector_stride(scale_b),
        A_FP8=gated,
        GATED=gated,
        HAS_BIAS=bias is not None,
        **_decode_constexprs(m, config, a.device),
    )
    return out


def fp8_weight_only_gemm(
    x: torch.Tensor,
    b: torch.Tensor,
    scale_b: torch.Tensor,
    bias: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    **launch: int | str,
) -> torch.Tensor:
    """out [M, N] in x's dtype = (x @ b^T) * scale_b (+ bias), the activation not quantized:
    x bf16/fp16 [M, K] (K contiguous), b e4m3 [N, K] contiguous, scale_b fp32 with 1 or N values,
    bias [N] in x's dtype; M <= triton_gemv.FMA_MAX_M (the fma body). `launch` overrides keys of
    `fp8_launch_config("weight_only", ...)`."""
    _check_out_dtype(x.dtype)
    m, k = x.shape
    n = b.shape[0]
    assert b.dtype == FP8_DTYPE and b.shape[1] == k and x.stride(1) == 1 and b.stride(1) == 1
    assert scale_b.numel() in (1, n) and (bias is None or bias.shape == (n,))
    config = resolve_fp8_launch("weight_only", m, n, k, launch)
    if out is None:
        out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    return _launch_decode(x, b, None, scale_b, bias, out, config)


def fp8_gated_gemm(
    a: torch.Tensor,
    b: torch.Tensor,
    scale_a: torch.Tensor,
    scale_b: torch.Tensor,
    out_dtype: torch.dtype,
    out: torch.Tensor | None = None,
    **launch: int | str,
) -> torch.Tensor:
    """h [M, I] = silu_and_mul(scaled_mm(a, b, scale_a, scale_b, out_dtype)) in one kernel: a
    e4m3 [M, K] with scale_a fp32 of 1 or M values, b e4m3 [2I, K] (I gate rows, then I up rows)
    with scale_b fp32 of 1 or 2I values; M <= triton_gemv.FMA_MAX_M. `launch` overrides keys of
    `fp8_launch_config("gated", M, 2I, K)`."""
    _check_out_dtype(out_dtype)
    m, k = a.shape
    rows = b.shape[0]
    i = rows // 2
    assert a.dtype == FP8_DTYPE and b.dtype == FP8_DTYPE and rows == 2 * i and b.shape[1] == k
    assert a.stride(1) == 1 and b.stride(1) == 1
    assert scale_a.numel() in (1, m) and scale_b.numel() in (1, rows)
    config = resolve_fp8_launch("gated", m, rows, k, launch)
    if out is None:
        out = torch.empty((m, i), dtype=out_dtype, device=a.device)
    return _launch_decode(a, b, scale_a, scale_b, None, out, config)


def precompile_decode(
    kind: str, out_dtype: torch.dtype, m: int, n: int, k: int, config: dict[str, int | str]
) -> None:
    """triton_gemv_fp8.precompile_fp8 for the decode kinds: compile `_fp8_decode_kernel` for
    `config` without launching it ("gated": n weight rows, n // 2 output columns)."""
    gated = kind == "gated"
    fp8, fp32 = FP8_DTYPE, torch.float32
    a_dtype = fp8 if gated else out_dtype
    cols = n // 2 if gated else n
    args = (a_dtype, fp8, fp32, fp32, out_dtype, out_dtype, m, cols, k, k, k, cols, 1, 1)
    constexprs = _decode_constexprs(m, config, torch.device("cuda"))
    _fp8_decode_kernel.warmup(
        *args, grid=(1,), A_FP8=gated, GATED=gated, HAS_BIAS=False, **constexprs
    )
