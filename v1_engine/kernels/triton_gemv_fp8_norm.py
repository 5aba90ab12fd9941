"""The bodies of the "norm" kinds of kernels/triton_gemv_fp8_decode.py (an FP8 GEMM at decode
sizes with the residual add and RMSNorm before it folded in), which its kernel calls:

- the fma body (`_norm_fma_loop`): the activation in float32, never quantized. The norm is a
  per-row scale, so it factors out of the sum: every program forms h = x + residual and h * w
  from the K it walks, sums h^2 on the way and scales its rows at the end;
- the wgmma body (`_norm_wgmma_loop`): every program norms its rows whole in a prologue (rstd
  and the e4m3 scale, as the norm-quant kernel of kernels/triton_fused_quant.py computes them),
  then recomputes each K step's activation tile, quantizes it and multiplies e4m3 by e4m3 in
  FP8 warpgroup MMAs: the quantized chain's arithmetic in one kernel.

Program 0 of either stores h, the next residual.
"""

from __future__ import annotations

import triton
import triton.language as tl

from v1_engine.kernels.fp8 import FP8_MAX, FP8_MIN_SCALE
from v1_engine.kernels.triton_fused_quant import _residual_sum, _round_to
from v1_engine.kernels.triton_gemv_fp8 import (
    _fma_accumulators,
    _fma_result,
    _load_weight_f32,
    _swapped_mma,
)
from v1_engine.kernels.triton_quant import _dynamic_scale, _quantize_to_fp8

_E4M3_MAX = tl.constexpr(FP8_MAX)
_MIN_SCALE = tl.constexpr(FP8_MIN_SCALE)


@triton.jit
def _norm_row(x_row, res_row, res_out_row, row: tl.constexpr, stride_am, stride_rm, stride_rom,
              M, k_row, wn, ss, tile, DTYPE: tl.constexpr, HW: tl.constexpr):  # fmt: skip
    """One K step of activation row `row` for the "norm" kinds (zeros past M): h = x + residual
    rounded to DTYPE as the unfused add rounds it (program `tile` 0 stores it to residual_out);
    returns h * wn in float32 and ss + h^2."""
    lane = k_row.to(tl.int32) * 0
    mask = k_row & ((lane + row) < M)
    x = tl.load(x_row + row * stride_am, mask=mask, other=0.0, eviction_policy="evict_last")
    r = tl.load(res_row + row * stride_rm, mask=mask, other=0.0, eviction_policy="evict_last")
    h = _round_to(x.to(tl.float32) + r.to(tl.float32), DTYPE, HW)
    tl.store(res_out_row + row * stride_rom, h.to(DTYPE), mask=mask & ((lane + tile) == 0))
    return h * wn, ss + h * h


@triton.jit
def _fma_vectors(acc0, acc1, acc2, acc3, a0, a1, a2, a3, w32, BLOCK_M: tl.constexpr):
    """_fma_rows for activation rows already in registers (float32 [BLOCK_K] each)."""
    acc0 = acc0 + a0[None, :] * w32
    if BLOCK_M > 1:
        acc1 = acc1 + a1[None, :] * w32
    if BLOCK_M > 2:
        acc2 = acc2 + a2[None, :] * w32
        acc3 = acc3 + a3[None, :] * w32
    return acc0, acc1, acc2, acc3


@triton.jit
def _row_rstd(ss0, ss1, ss2, ss3, offs_m, K, eps, BLOCK_M: tl.constexpr):
    """rsqrt(mean(h^2) + eps) of each of the BLOCK_M rows from their [BLOCK_K] partial sums."""
    total = tl.where(offs_m == 0, tl.sum(ss0, axis=0), 0.0)
    if BLOCK_M > 1:
        total = tl.where(offs_m == 1, tl.sum(ss1, axis=0), total)
    if BLOCK_M > 2:
        total = tl.where(offs_m == 2, tl.sum(ss2, axis=0), total)
        total = tl.where(offs_m == 3, tl.sum(ss3, axis=0), total)
    return tl.rsqrt(total / K + eps)


@triton.jit
def _norm_fma_loop(x_ptr, res_ptr, norm_w_ptr, res_out_ptr, g_ptrs, u_ptrs, n_mask, offs_m,
                   offs_k, M, K, stride_am, stride_rm, stride_rom, eps, tile,
                   GATED: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_K: tl.constexpr, NUM_STAGES: tl.constexpr, DOT_F32: tl.constexpr,
                   HW: tl.constexpr):  # fmt: skip
    """The fma body of the "norm" kinds: (gate, up, rstd), gate / up the [BLOCK_M, BLOCK_N]
    sums of (h * norm_w) times the weight rows (up zeros unless GATED) and rstd each row's
    rsqrt(mean(h^2) + eps). The norm is a per-row scale, so it factors out of the sum:
    rmsnorm(h) * w @ W^T = rstd * ((h * w) @ W^T), and every program gets mean(h^2) from the
    same K loop instead of a norm kernel before it."""
    DTYPE = x_ptr.dtype.element_ty
    x_row = x_ptr + offs_k
    res_row = res_ptr + offs_k
    out_row = res_out_ptr + offs_k
    wn_row = norm_w_ptr + offs_k
    g0, g1, g2, g3 = _fma_accumulators(BLOCK_N, BLOCK_K)
    u0, u1, u2, u3 = _fma_accumulators(BLOCK_N, BLOCK_K)
    ss0 = tl.zeros([BLOCK_K], dtype=tl.float32)
    ss1 = tl.zeros_like(ss0)
    ss2 = tl.zeros_like(ss0)
    ss3 = tl.zeros_like(ss0)
    for k in tl.range(0, K, BLOCK_K, num_stages=NUM_STAGES):
        k_row = offs_k < K - k
        wn = tl.load(wn_row, mask=k_row, other=0.0, eviction_policy="evict_last").to(tl.float32)
        rows = (x_row, res_row, out_row)
        strides = (stride_am, stride_rm, stride_rom, M, k_row, wn)
        a0, ss0 = _norm_row(*rows, 0, *strides, ss0, tile, DTYPE, HW)
        a1 = a0
        a2 = a0
        a3 = a0
        if BLOCK_M > 1:
            a1, ss1 = _norm_row(*rows, 1, *strides, ss1, tile, DTYPE, HW)
        if BLOCK_M > 2:
            a2, ss2 = _norm_row(*rows, 2, *strides, ss2, tile, DTYPE, HW)
            a3, ss3 = _norm_row(*rows, 3, *strides, ss3, tile, DTYPE, HW)
        w32 = _load_weight_f32(g_ptrs, n_mask, k_row, DOT_F32)
        g0, g1, g2, g3 = _fma_vectors(g0, g1, g2, g3, a0, a1, a2, a3, w32, BLOCK_M)
        if GATED:
            w32 = _load_weight_f32(u_ptrs, n_mask, k_row, DOT_F32)
            u0, u1, u2, u3 = _fma_vectors(u0, u1, u2, u3, a0, a1, a2, a3, w32, BLOCK_M)
            u_ptrs += BLOCK_K
        g_ptrs += BLOCK_K
        x_row += BLOCK_K
        res_row += BLOCK_K
        out_row += BLOCK_K
        wn_row += BLOCK_K
    gate = _fma_result(g0, g1, g2, g3, offs_m, BLOCK_M)
    up = _fma_result(u0, u1, u2, u3, offs_m, BLOCK_M)
    return gate, up, _row_rstd(ss0, ss1, ss2, ss3, offs_m, K, eps, BLOCK_M)


@triton.jit
def _norm_row_stats(x_ptr, res_ptr, res_out_ptr, w, cols, in_row, first, row: tl.constexpr, M,
                    K, stride_am, stride_rm, stride_rom, eps, NORM_DTYPE: tl.constexpr,
                    HW: tl.constexpr):  # fmt: skip
    """One row of the wgmma body's prologue, whole in registers: h = x + residual rounded to x's
    dtype (stored to residual_out where `first`), rstd = rsqrt(mean(h^2) + eps) and the e4m3
    scale of the normed row y = w * (h * rstd), max(amax(y) / 448, MIN_SCALE), as the
    norm-quant kernel of kernels/triton_fused_quant.py rounds them. A row past M reads zeros."""
    DTYPE = x_ptr.dtype.element_ty
    mask = in_row & ((cols * 0 + row) < M)
    h = _residual_sum(x_ptr + row * stride_am, res_ptr + row * stride_rm, cols, mask, True,
                      DTYPE, HW)  # fmt: skip
    tl.store(res_out_ptr + row * stride_rom + cols, h.to(DTYPE), mask=mask & first)
    rstd = tl.math.rsqrt(tl.math.div_rn(tl.sum(h * h, axis=0), K.to(tl.float32)) + eps)
    y = _round_to(w * _round_to(h * rstd, DTYPE, HW), NORM_DTYPE, HW)
    return rstd, _dynamic_scale(tl.max(tl.abs(y), axis=0), _E4M3_MAX, _MIN_SCALE)


@triton.jit
def _norm_quant_row(tile, x_ptr, res_ptr, w, offs_k, k_row, offs_m, row: tl.constexpr, M,
                    stride_am, stride_rm, rstd, scale, NORM_DTYPE: tl.constexpr,
                    HW: tl.constexpr):  # fmt: skip
    """Row `row` of a K step's activation tile recomputed from x and the residual (L1 / L2 hits
    after the prologue) with its rstd and scale: the values the norm-quant kernel would store,
    as e4m3-representable float32, put into `tile` [BLOCK_M, BLOCK_K]. Only the ROWS real rows
    are computed; the tile's other rows stay zero."""
    DTYPE = x_ptr.dtype.element_ty
    mask = k_row & ((offs_k * 0 + row) < M)
    x = tl.load(x_ptr + row * stride_am + offs_k, mask=mask, other=0.0,
                eviction_policy="evict_last").to(tl.float32)  # fmt: skip
    r = tl.load(res_ptr + row * stride_rm + offs_k, mask=mask, other=0.0,
                eviction_policy="evict_last").to(tl.float32)  # fmt: skip
    normed = _round_to(_round_to(x + r, DTYPE, HW) * rstd, DTYPE, HW)
    q = _quantize_to_fp8(_round_to(w * normed, NORM_DTYPE, HW), scale, _E4M3_MAX, HW)
    return tl.where(offs_m[:, None] == row, q[None, :], tile)


@triton.jit
def _norm_wgmma_loop(x_ptr, res_ptr, norm_w_ptr, res_out_ptr, g_ptrs, u_ptrs, n_mask, offs_m,
                     offs_k, M, K, stride_am, stride_rm, stride_rom, eps, tile,
                     GATED: tl.constexpr, ROWS: tl.constexpr, ROW_PAD: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     NUM_STAGES: tl.constexpr, NORM_DTYPE: tl.constexpr, DOT_F32: tl.constexpr,
                     HW: tl.constexpr):  # fmt: skip
    """The wgmma body of the "norm" kinds: (gate, up, scale), gate / up [BLOCK_M, BLOCK_N] the
    e4m3 activation rows times the weight rows (up zeros unless GATED), scale [BLOCK_M] each
    row's activation scale. The prologue norms the first ROWS (<= 4) rows whole (ROW_PAD >= K
    lanes); each K step then recomputes their slice of the activation and quantizes it."""
    cols = tl.arange(0, ROW_PAD)
    in_row = cols < K
    w = tl.load(norm_w_ptr + cols, mask=in_row, other=0.0).to(tl.float32)
    first = (cols * 0 + tile) == 0
    r0, s0 = _norm_row_stats(x_ptr, res_ptr, res_out_ptr, w, cols, in_row, first, 0, M, K,
                             stride_am, stride_rm, stride_rom, eps, NORM_DTYPE, HW)  # fmt: skip
    r1, s1, r2, s2, r3, s3 = r0, s0, r0, s0, r0, s0
    if ROWS > 1:
        r1, s1 = _norm_row_stats(x_ptr, res_ptr, res_out_ptr, w, cols, in_row, first, 1, M, K,
                                 stride_am, stride_rm, stride_rom, eps, NORM_DTYPE, HW)  # fmt: skip
    if ROWS > 2:
        r2, s2 = _norm_row_stats(x_ptr, res_ptr, res_out_ptr, w, cols, in_row, first, 2, M, K,
                                 stride_am, stride_rm, stride_rom, eps, NORM_DTYPE, HW)  # fmt: skip
        r3, s3 = _norm_row_stats(x_ptr, res_ptr, res_out_ptr, w, cols, in_row, first, 3, M, K,
                                 stride_am, stride_rm, stride_rom, eps, NORM_DTYPE, HW)  # fmt: skip
    gate_t = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    up_t = tl.zeros_like(gate_t)
    x_row = x_ptr
    res_row = res_ptr
    wn_row = norm_w_ptr + offs_k
    for k in tl.range(0, K, BLOCK_K, num_stages=NUM_STAGES):
        k_row = offs_k < K - k
        wn = tl.load(wn_row, mask=k_row, other=0.0, eviction_policy="evict_last").to(tl.float32)
        q = tl.zeros([BLOCK_M, BLOCK_K], dtype=tl.float32)
        q = _norm_quant_row(q, x_row, res_row, wn, offs_k, k_row, offs_m, 0, M, stride_am,
                            stride_rm, r0, s0, NORM_DTYPE, HW)  # fmt: skip
        if ROWS > 1:
            q = _norm_quant_row(q, x_row, res_row, wn, offs_k, k_row, offs_m, 1, M, stride_am,
                                stride_rm, r1, s1, NORM_DTYPE, HW)  # fmt: skip
        if ROWS > 2:
            q = _norm_quant_row(q, x_row, res_row, wn, offs_k, k_row, offs_m, 2, M, stride_am,
                                stride_rm, r2, s2, NORM_DTYPE, HW)  # fmt: skip
            q = _norm_quant_row(q, x_row, res_row, wn, offs_k, k_row, offs_m, 3, M, stride_am,
                                stride_rm, r3, s3, NORM_DTYPE, HW)  # fmt: skip
        if not DOT_F32:
            q = q.to(tl.float8e4nv)
        k_mask = k_row[None, :]
        b = tl.load(g_ptrs, mask=n_mask[:, None] & k_mask, other=0.0,
                    eviction_policy="evict_first")  # fmt: skip
        gate_t += _swapped_mma(q, b, DOT_F32, True)
        if GATED:
            b = tl.load(u_ptrs, mask=n_mask[:, None] & k_mask, other=0.0,
                        eviction_policy="evict_first")  # fmt: skip
            up_t += _swapped_mma(q, b, DOT_F32, True)
            u_ptrs += BLOCK_K
        g_ptrs += BLOCK_K
        x_row += BLOCK_K
        res_row += BLOCK_K
        wn_row += BLOCK_K
    scale = tl.where(offs_m == 0, s0, tl.where(offs_m == 1, s1, tl.where(offs_m == 2, s2, s3)))
    return tl.trans(gate_t), tl.trans(up_t), scale
