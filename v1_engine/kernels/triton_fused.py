"""Residual add + RMSNorm and SiLU-and-mul in Triton: the CUDA bodies of the fused ops the
`add_rms_norm` and `silu_and_mul` passes rewrite into (compile/passes/fused_ops.py).

Inductor's own lowering of these patterns costs two kernels per norm at decode sizes (a split
reduction, then the pointwise part) and reads the gate/up halves of a prefill's SiLU-and-mul at
well under half of HBM bandwidth; here each is one kernel. They repeat the reference ops'
roundings in the same order (the sum and the normalised value round to the input dtype, the
weight product to the promoted dtype, SiLU and its product with `up` to the input dtype), so
results agree with the reference up to the reduction order of the sum of squares and the
hardware `rsqrt`/`exp` (a few fp32 ulps before the final rounding), as the compiled unfused graph
does.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from v1_engine.kernels import interpreting
from v1_engine.kernels.pdl import launch_options, pdl_enter
from v1_engine.kernels.triton_fused_quant import (
    _TL_DTYPES,
    _norm_row_one_pass,
    _normed,
    _residual_sum,
    _silu_and_mul,
    norm_weight_early,
)
from v1_engine.kernels.triton_quant import MAX_BLOCK, _as_rows, _block_for, _num_warps

SILU_BLOCK = 1024
"""Output columns per SiLU-and-mul program: rows are cut into column blocks so a decode step's
single row still spreads over many programs."""


@triton.jit
def _add_rms_norm_kernel(
    x_ptr,
    residual_ptr,
    w_ptr,
    out_ptr,
    residual_out_ptr,
    row_len,
    row_len_f,
    x_row_stride,
    residual_row_stride,
    eps,
    IN_DTYPE: tl.constexpr,
    NORM_DTYPE: tl.constexpr,
    BLOCK: tl.constexpr,
    ONE_PASS: tl.constexpr,
    HW: tl.constexpr,
    PDL: tl.constexpr,
):
    """One program per row: x + residual stored with its sum of squares, then the norm.
    ONE_PASS (the row fits one BLOCK): the sum stays in registers and the norm weight is loaded
    with x and residual, so its load (from HBM in a decode step, whose weights flush L2) overlaps
    theirs instead of following the reduction (and it is loaded before the PDL wait:
    `norm_weight_early`); the same roundings either way."""
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * x_row_stride
    residual_row = residual_ptr + row * residual_row_stride
    offsets = tl.arange(0, BLOCK)
    if ONE_PASS:
        mask = offsets < row_len
        w = norm_weight_early(w_ptr, offsets, mask, PDL)
        y = _norm_row_one_pass(
            x_row, residual_row, w, residual_out_ptr + row * row_len, offsets, mask,
            row_len_f, eps, True, IN_DTYPE, NORM_DTYPE, HW,
        )  # fmt: skip
        tl.store(out_ptr + row * row_len + offsets, y.to(out_ptr.dtype.element_ty), mask=mask)
        return
    pdl_enter(PDL)
    squares = tl.zeros([BLOCK], dtype=tl.float32)
    for chunk in range(0, row_len, BLOCK):
        cols = chunk + offsets
        mask = cols < row_len
        s = _residual_sum(x_row, residual_row, cols, mask, True, IN_DTYPE, HW)
        tl.store(
            residual_out_ptr + row * row_len + cols,
            s.to(residual_out_ptr.dtype.element_ty),
            mask=mask,
        )
        squares += s * s
    variance = tl.math.div_rn(tl.sum(squares, axis=0), row_len_f)
    rstd = tl.math.rsqrt(variance + eps)
    for chunk in range(0, row_len, BLOCK):
        cols = chunk + offsets
        mask = cols < row_len
        y = _normed(x_row, residual_row, w_ptr, cols, mask, rstd, True, IN_DTYPE, NORM_DTYPE, HW)
        tl.store(out_ptr + row * row_len + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _silu_and_mul_kernel(
    x_ptr,
    out_ptr,
    half_len,
    x_row_stride,
    IN_DTYPE: tl.constexpr,
    BLOCK: tl.constexpr,
    HW: tl.constexpr,
    PDL: tl.constexpr,
):
    """One program per (row, block of output columns)."""
    pdl_enter(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < half_len
    y = _silu_and_mul(x_ptr + row * x_row_stride, cols, mask, half_len, IN_DTYPE, HW)
    tl.store(out_ptr + row * half_len + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weight * rmsnorm(x + residual), x + residual) for x and residual of one dtype."""
    assert residual.dtype == x.dtype, "the kernel reads x and residual in one dtype"
    rows = _as_rows(x)
    res_rows = _as_rows(residual)
    num_rows, row_len = rows.shape
    norm_dtype = torch.promote_types(weight.dtype, x.dtype)
    out = torch.empty(x.shape, dtype=norm_dtype, device=x.device)
    residual_out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if num_rows == 0 or row_len == 0:
        return out, residual_out
    block = min(triton.next_power_of_2(max(row_len, 16)), MAX_BLOCK)
    _add_rms_norm_kernel[(num_rows,)](
        rows,
        res_rows,
        weight.contiguous(),
        out,
        residual_out,
        row_len,
        float(row_len),
        rows.stride(0),
        res_rows.stride(0),
        eps,
        IN_DTYPE=_TL_DTYPES[x.dtype],
        NORM_DTYPE=_TL_DTYPES[norm_dtype],
        BLOCK=block,
        ONE_PASS=row_len <= block,
        num_warps=_num_warps(block),
        HW=not interpreting(),
        **launch_options(x.device),
    )
    return out, residual_out


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for x = [gate | up] along the last dim."""
    rows = _as_rows(x)
    num_rows, half_len = rows.shape[0], rows.shape[1] // 2
    out = torch.empty((*x.shape[:-1], half_len), dtype=x.dtype, device=x.device)
    if num_rows == 0 or half_len == 0:
        return out
    block = min(_block_for(half_len), SILU_BLOCK)
    _silu_and_mul_kernel[(num_rows, triton.cdiv(half_len, block))](
        rows,
        out,
        half_len,
        rows.stride(0),
        IN_DTYPE=_TL_DTYPES[x.dtype],
        BLOCK=block,
        num_warps=4,
        HW=not interpreting(),
        **launch_options(x.device),
    )
    return out
