"""The FP8 decode kinds of the skinny GEMMs (kernels/triton_gemv_fp8.py, whose fma / wgmma
helpers they share, as they share the launch table and rules of kernels/fp8_launch.py): kernels
for decode-sized M (the fma body, M <= skinny_launch.FMA_MAX_M) that skip an activation quant
kernel. Program n owns BLOCK_N output columns over all of K, never split.

- "weight_only" (`fp8_weight_only_gemm`): a bf16/fp16 activation times an e4m3 weight with
  per-channel scales, the activation not quantized (the ops of compile/passes/fp8_linear_ops.py
  run it for o_proj's input and for the down projection's);
- "gated" (`fp8_gated_gemm`): the gate_up GEMM of e4m3 operands with SiLU-and-mul in its
  epilogue, writing the bf16 product the down projection reads; the fma body, or "wgmma" with
  the gate and up tiles each in FP8 warpgroup MMAs;
- "norm" / "norm_gated" (`fp8_add_norm_gemm`): weight_only / gated with the residual add and
  RMSNorm before them folded in. The fma body keeps the activation in float32 (the norm
  factors out of the sum); "wgmma" quantizes it as the norm-quant kernel would (per token,
  e4m3), every program for itself, and multiplies in FP8 warpgroup MMAs: the quantized chain's
  arithmetic in one kernel.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from v1_engine.kernels import interpreting, pdl, skinny_launch
from v1_engine.kernels.fp8_launch import resolve_fp8_launch
from v1_engine.kernels.pdl import pdl_release_early, pdl_release_unless, pdl_wait
from v1_engine.kernels.triton_fused_quant import _TL_DTYPES
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
)
from v1_engine.kernels.triton_gemv_fp8_norm import _norm_fma_loop, _norm_wgmma_loop

EARLY_RELEASE_PER_SM = 2
"""Programs per SM, counted from the end of the grid, that let the next kernel launch as they
start instead of after their main loop (0: none). The next kernel then launches once the last
waves have been handed out and the earlier programs are through their loops, so its programs
take the SMs the tail frees instead of launching when the last program's loop ends. Signalling
from every program's start measured slower (the next kernels took SMs from this one's later
waves: RESULTS.md, "Programmatic dependent launch"); the last waves have none left to take.
Measured on an H100 (RESULTS.md, "The FP8 decode GEMV's last waves signal early"): FP8 batch 1
3.285 -> 3.274 ms a step at 1, 3.270 at 2, 3.293 at 4."""


@triton.jit(do_not_specialize=["M", "stride_sa", "stride_sb", "early_from"])
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
    residual_ptr,
    norm_w_ptr,
    residual_out_ptr,
    stride_rm,
    stride_rom,
    eps,
    early_from,
    A_FP8: tl.constexpr,
    GATED: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    NORM: tl.constexpr,
    DOT_F32: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    NUM_STAGES: tl.constexpr,
    NATIVE: tl.constexpr,
    HW: tl.constexpr,
    PDL: tl.constexpr,
    ROWS: tl.constexpr,
    ROW_PAD: tl.constexpr,
    NORM_DTYPE: tl.constexpr,
    EARLY_RELEASE: tl.constexpr,
):
    """The decode kinds: program n owns BLOCK_N of the N output columns over all of K.
    A_FP8 False ("weight_only"): out = (a @ b^T) * scale_b (+ bias), a in 16-bit floats.
    A_FP8 and GATED ("gated"): b holds N gate rows then N up rows; gate and up are
    (a @ rows^T) * scale_a * scale_b, each rounded to out's dtype as scaled_mm stores it, and out
    = silu(gate) * up with kernels/triton_fused.py's roundings. The fma body, or with NATIVE
    (the gated kind's "wgmma" body) the gate and up tiles each in FP8 warpgroup MMAs.
    NORM (the "norm" kinds, fma body, A_FP8 False): a is x of `x + residual` and the GEMM's
    activation is rmsnorm(x + residual) * norm_w, the norm folded in (_norm_fma_loop): every
    program sums h = x + residual's squares over the K it walks anyway, multiplies h by the norm
    weight, and scales its rows by rsqrt(mean(h^2) + eps) at the end; program 0 stores h to
    residual_out. NORM with NATIVE (the norm kinds' "wgmma" body, _norm_wgmma_loop): every
    program norms and quantizes the activation as the norm-quant kernel does (ROWS rows of up
    to ROW_PAD values, the norm's output rounded to NORM_DTYPE) and multiplies it in FP8
    warpgroup MMAs; the rows' scales act as scale_a.
    Under PDL with EARLY_RELEASE, programs from `early_from` on let the next kernel launch as
    they start, the rest after their main loop (EARLY_RELEASE_PER_SM)."""
    tile = tl.program_id(0)
    pdl_wait(PDL)
    released = pdl_release_early(PDL, EARLY_RELEASE, tile, early_from)
    offs_n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    n_mask = offs_n < N
    m_mask = offs_m < M
    g_ptrs = b_ptr + offs_n[:, None].to(tl.int64) * stride_bn + offs_k[None, :]
    u_ptrs = g_ptrs + N.to(tl.int64) * stride_bn
    row_scale = offs_m * 0.0  # the activation rows' scales where A_FP8 or NORM and NATIVE
    if NATIVE and NORM:
        gate, up, row_scale = _norm_wgmma_loop(a_ptr, residual_ptr, norm_w_ptr, residual_out_ptr,
                                               g_ptrs, u_ptrs, n_mask, offs_m, offs_k, M,
                                               K, stride_am, stride_rm, stride_rom, eps, tile,
                                               GATED, ROWS, ROW_PAD, BLOCK_M, BLOCK_N, BLOCK_K,
                                               NUM_STAGES, NORM_DTYPE, DOT_F32, HW)  # fmt: skip
        pdl_release_unless(PDL, released)
    elif NATIVE:
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
        pdl_release_unless(PDL, released)
        gate = tl.trans(gate_t)
        up = tl.trans(up_t)
    elif NORM:
        gate, up, rstd = _norm_fma_loop(a_ptr, residual_ptr, norm_w_ptr, residual_out_ptr, g_ptrs,
                                        u_ptrs, n_mask, offs_m, offs_k, M, K, stride_am,
                                        stride_rm, stride_rom, eps, tile, GATED, BLOCK_M,
                                        BLOCK_N, BLOCK_K, NUM_STAGES, DOT_F32, HW)  # fmt: skip
        pdl_release_unless(PDL, released)
        gate = gate * rstd[:, None]
        up = up * rstd[:, None]
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
        pdl_release_unless(PDL, released)
        gate = _fma_result(g0, g1, g2, g3, offs_m, BLOCK_M)
        up = _fma_result(u0, u1, u2, u3, offs_m, BLOCK_M)
    dtype = out_ptr.dtype.element_ty
    scaled_rows = A_FP8 or (NORM and NATIVE)
    if A_FP8:
        row_scale = tl.load(scale_a_ptr + offs_m * stride_sa, mask=m_mask, other=0.0)
    if scaled_rows:
        gate = gate * row_scale[:, None]
    gate = gate * tl.load(scale_b_ptr + offs_n * stride_sb, mask=n_mask, other=0.0)[None, :]
    if GATED:
        if scaled_rows:
            up = up * row_scale[:, None]
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


def _norm_constexprs(
    m: int, k: int, x_dtype: torch.dtype, norm_w_dtype: torch.dtype, wgmma_norm: bool
) -> dict:
    """The wgmma norm body's constexprs: its rows, the row's padded length and the norm's
    output dtype (the promoted dtype of x and the norm weight, as the unfused norm's); fixed
    stand-ins for every other body, which compiles them out."""
    if not wgmma_norm:
        return {"ROWS": 1, "ROW_PAD": 1, "NORM_DTYPE": tl.bfloat16}
    return {
        "ROWS": skinny_launch.m_bucket(m),
        "ROW_PAD": triton.next_power_of_2(k),
        "NORM_DTYPE": _TL_DTYPES[torch.promote_types(x_dtype, norm_w_dtype)],
    }


def _launch_decode(
    a: torch.Tensor,
    b: torch.Tensor,
    scale_a: torch.Tensor | None,
    scale_b: torch.Tensor,
    bias: torch.Tensor | None,
    out: torch.Tensor,
    config: dict[str, int | str],
    norm: tuple[torch.Tensor, torch.Tensor, torch.Tensor, float] | None = None,
    gated: bool | None = None,
) -> torch.Tensor:
    """`_fp8_decode_kernel` over out's columns: weight-only without scale_a, gated with it;
    `norm` = (residual, norm weight, residual_out, eps) folds the add + RMSNorm in (a is x, not
    quantized; `gated` then says whether b holds gate and up rows)."""
    m, cols = out.shape
    if m == 0:
        return out
    a_fp8 = scale_a is not None
    gated = a_fp8 if gated is None else gated
    wgmma_norm = norm is not None and config["mode"] == "wgmma"
    residual, norm_w, residual_out, eps = norm if norm is not None else (out, out, out, 0.0)
    grid = triton.cdiv(cols, config["block_n"])
    early_from = pdl.early_release_from(grid, a.device, EARLY_RELEASE_PER_SM)
    _fp8_decode_kernel[(grid,)](
        a,
        b,
        scale_a if a_fp8 else scale_b,
        scale_b,
        bias if bias is not None else out,
        out,
        m,
        cols,
        a.shape[1],
        a.stride(0),
        b.stride(0),
        out.stride(0),
        _vector_stride(scale_a) if a_fp8 else 0,
        _vector_stride(scale_b),
        residual,
        norm_w,
        residual_out,
        residual.stride(0),
        residual_out.stride(0),
        eps,
        early_from,
        A_FP8=a_fp8,
        GATED=gated,
        HAS_BIAS=bias is not None,
        NORM=norm is not None,
        **_decode_constexprs(m, config, a.device),
        **_norm_constexprs(m, a.shape[1], a.dtype, norm_w.dtype, wgmma_norm),
        EARLY_RELEASE=early_from < grid,
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
    bias [N] in x's dtype; M <= skinny_launch.FMA_MAX_M (the fma body). `launch` overrides keys of
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
    with scale_b fp32 of 1 or 2I values; M <= skinny_launch.FMA_MAX_M. `launch` overrides keys of
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


def fp8_add_norm_gemm(
    x: torch.Tensor,
    residual: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    b: torch.Tensor,
    scale_b: torch.Tensor,
    bias: torch.Tensor | None = None,
    gated: bool = False,
    **launch: int | str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, h) for h = x + residual (rounded to x's dtype) and out = (rmsnorm(h, eps) *
    norm_weight) @ b^T * scale_b (+ bias) in x's dtype, the activation not quantized, in one
    kernel (kind "norm"); `gated`: b holds I gate rows then I up rows and out [M, I] =
    silu(gate) * up as fp8_gated_gemm rounds it (kind "norm_gated", no bias). x and residual
    bf16/fp16 [M, K] with unit last strides, norm_weight [K], b e4m3 [N, K] contiguous, scale_b
    fp32 with 1 or N values; M <= skinny_launch.FMA_MAX_M. `launch` overrides keys of
    `fp8_launch_config(kind, M, N, K)`."""
    _check_out_dtype(x.dtype)
    m, k = x.shape
    rows = b.shape[0]
    assert residual.shape == x.shape and residual.dtype == x.dtype and norm_weight.shape == (k,)
    assert b.dtype == FP8_DTYPE and b.shape[1] == k and b.stride(1) == 1
    assert x.stride(1) == 1 and residual.stride(1) == 1 and norm_weight.is_contiguous()
    assert scale_b.numel() in (1, rows) and (bias is None or (bias.shape == (rows,) and not gated))
    assert not gated or rows % 2 == 0
    kind = "norm_gated" if gated else "norm"
    config = resolve_fp8_launch(kind, m, rows, k, launch)
    out = torch.empty((m, rows // 2 if gated else rows), dtype=x.dtype, device=x.device)
    h = torch.empty_like(x)
    norm = (residual, norm_weight, h, float(eps))
    _launch_decode(x, b, None, scale_b, bias, out, config, norm=norm, gated=gated)
    return out, h


def precompile_decode(
    kind: str, out_dtype: torch.dtype, m: int, n: int, k: int, config: dict[str, int | str]
) -> None:
    """triton_gemv_fp8.precompile_fp8 for the decode kinds: compile `_fp8_decode_kernel` for
    `config` without launching it (the gated kinds: n weight rows, n // 2 output columns)."""
    gated = kind in ("gated", "norm_gated")
    norm = kind in ("norm", "norm_gated")
    a_fp8 = kind == "gated"
    fp8, fp32 = FP8_DTYPE, torch.float32
    a_dtype = fp8 if a_fp8 else out_dtype
    cols = n // 2 if gated else n
    args = (a_dtype, fp8, fp32, fp32, out_dtype, out_dtype, m, cols, k, k, k, cols, 1, 1)
    args += (out_dtype, out_dtype, out_dtype, k, k, 1e-6, 1)
    constexprs = _decode_constexprs(m, config, torch.device("cuda"))
    constexprs["EARLY_RELEASE"] = EARLY_RELEASE_PER_SM > 0
    # (the norm kinds: a norm weight in the model's dtype, like x)
    constexprs |= _norm_constexprs(m, k, out_dtype, out_dtype, norm and config["mode"] == "wgmma")
    _fp8_decode_kernel.warmup(
        *args, grid=(1,), A_FP8=a_fp8, GATED=gated, HAS_BIAS=False, NORM=norm, **constexprs
    )
