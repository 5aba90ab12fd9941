"""RMSNorm (with or without the residual add) and SiLU-and-mul fused with the dynamic FP8
quantization of their output, in Triton: the CUDA bodies of compile/passes/fused_quant_ops.py.

Unfused, a norm writes its bf16 output, the quant kernel reads it back twice (amax, then
quantize) and writes e4m3; fused, the activation is recomputed from the input inside one program
and never reaches memory. Each kernel repeats the unfused ops' roundings in the same order:

- the residual sum and the norm's `.to(dtype)` round to the input dtype, `weight * normed` to
  the promoted norm dtype, SiLU to the input dtype and its product with `up` again, before the
  quant sees the value (so a bf16 model quantizes exactly the bf16 values the unfused chain would);
- the quant divides and rounds to e4m3 like triton_quant.py (`_quantize_to_fp8`), bit for bit.

The roundings are the GPU's casts (nearest even); under the interpreter, whose casts truncate,
they are done on the bits instead (the `HW` constexpr). A row that fits one tile (ONE_PASS_MAX)
is loaded and computed once and quantized from registers, per group where the groups split the
tile evenly; longer rows take chunked bodies that compute each value twice.

Where they cannot agree bit for bit: the norm's sum of squares is reduced in a different order
and `rsqrt`/`exp` are the hardware approximations (a few fp32 ulps, like the compiled unfused
graph's), so a normed value that lands within those ulps of a rounding boundary of its dtype can
round the other way: one ulp of the norm dtype, and then at most one e4m3 step for that element
(and a one-ulp change of its row's scale when it is the row's max). The tests bound exactly this.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from v1_engine.kernels import interpreting
from v1_engine.kernels.fp8 import FP8_MAX, FP8_MIN_SCALE
from v1_engine.kernels.pdl import launch_options, pdl_enter
from v1_engine.kernels.triton_quant import (
    _as_rows,
    _dynamic_scale,
    _num_warps,
    _quant_outputs,
    _quantize_to_fp8,
    _store_groups,
    _tiling,
)

_TL_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}


@triton.jit
def _round_to(v, DTYPE: tl.constexpr, HW: tl.constexpr):
    """fp32 v rounded to DTYPE (nearest even), returned in fp32. HW: the GPU's cast, which
    rounds. Else bf16 is rounded on the bits: the Triton interpreter's fp32 -> bf16 cast
    truncates (the final cast of an already representable value is exact)."""
    if DTYPE == tl.bfloat16 and not HW:
        bits = v.to(tl.int32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536
        rounded = bits.to(tl.float32, bitcast=True)
    else:
        rounded = v.to(DTYPE).to(tl.float32)
    return rounded


@triton.jit
def _residual_sum(
    x_row,
    residual_row,
    cols,
    mask,
    HAS_RESIDUAL: tl.constexpr,
    IN_DTYPE: tl.constexpr,
    HW: tl.constexpr,
):
    """x (+ residual), rounded to x's dtype like the unfused add, returned in fp32."""
    x = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(residual_row + cols, mask=mask, other=0.0).to(tl.float32)
        x = _round_to(x + r, IN_DTYPE, HW)
    return x


@triton.jit
def _normed(
    x_row,
    residual_row,
    w_ptr,
    cols,
    mask,
    rstd,
    HAS_RESIDUAL: tl.constexpr,
    IN_DTYPE: tl.constexpr,
    NORM_DTYPE: tl.constexpr,
    HW: tl.constexpr,
):
    """weight * (x32 * rstd).to(x dtype), rounded to the norm's output dtype, in fp32."""
    s = _residual_sum(x_row, residual_row, cols, mask, HAS_RESIDUAL, IN_DTYPE, HW)
    normed = _round_to(s * rstd, IN_DTYPE, HW)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    return _round_to(w * normed, NORM_DTYPE, HW)


@triton.jit
def norm_weight_early(w_ptr, offsets, mask, PDL: tl.constexpr):
    """A one-pass norm's prologue: the norm weight's row (float32), loaded before the PDL wait
    since no kernel of a step writes a parameter, then `pdl_enter`. Its HBM round trip overlaps
    the previous kernel's tail instead of following the wait."""
    w = tl.load(w_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    pdl_enter(PDL)
    return w


@triton.jit
def _norm_row_one_pass(
    x_row,
    residual_row,
    w,
    residual_out_row,
    offsets,
    mask,
    row_len_f,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    IN_DTYPE: tl.constexpr,
    NORM_DTYPE: tl.constexpr,
    HW: tl.constexpr,
):
    """weight * rmsnorm(x (+ residual)) of a row that fits one block, in fp32 rounded as the
    unfused ops round (storing x + residual on the way when HAS_RESIDUAL). `w` is the norm
    weight's row in float32, loaded by the caller before its PDL wait (`norm_weight_early`): in a
    decode step it comes from HBM (the GEMM weights flush L2); behind the reduction that load was
    an extra round trip (benchmarks/RESULTS.md, "add + RMSNorm in one pass": 1 us a norm)."""
    s = _residual_sum(x_row, residual_row, offsets, mask, HAS_RESIDUAL, IN_DTYPE, HW)
    if HAS_RESIDUAL:
        tl.store(residual_out_row + offsets, s.to(residual_out_row.dtype.element_ty), mask=mask)
    variance = tl.math.div_rn(tl.sum(s * s, axis=0), row_len_f)
    normed = _round_to(s * tl.math.rsqrt(variance + eps), IN_DTYPE, HW)
    return _round_to(w * normed, NORM_DTYPE, HW)


@triton.jit
def _rms_norm_quant_kernel(
    x_ptr,
    residual_ptr,
    w_ptr,
    q_ptr,
    scale_ptr,
    residual_out_ptr,
    row_len,
    row_len_f,
    group_len,
    groups_per_row,
    x_row_stride,
    residual_row_stride,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    IN_DTYPE: tl.constexpr,
    NORM_DTYPE: tl.constexpr,
    FP8_MAX_: tl.constexpr,
    MIN_SCALE: tl.constexpr,
    BLOCK: tl.constexpr,
    ONE_PASS_GROUP: tl.constexpr,
    HW: tl.constexpr,
    PDL: tl.constexpr,
):
    """One program per row: the sum of squares (storing x + residual on the way), then per group
    the amax of the normed values and their quantization. One group per row = per token.

    ONE_PASS_GROUP > 0: the row fits one BLOCK and its groups are ONE_PASS_GROUP wide (a power
    of two; BLOCK for one group per row): the row is loaded and normed once and stays in
    registers. 0: the chunked body, which recomputes the normed values for the amax and again
    for the quantization."""
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * x_row_stride
    residual_row = residual_ptr + row * residual_row_stride
    offsets = tl.arange(0, BLOCK)

    if ONE_PASS_GROUP > 0:
        mask = offsets < row_len
        w = norm_weight_early(w_ptr, offsets, mask, PDL)
        y = _norm_row_one_pass(
            x_row, residual_row, w, residual_out_ptr + row * row_len, offsets, mask,
            row_len_f, eps, HAS_RESIDUAL, IN_DTYPE, NORM_DTYPE, HW,
        )  # fmt: skip
        _store_groups(
            y,
            q_ptr + row * row_len,
            scale_ptr + row * groups_per_row,
            offsets,
            mask,
            groups_per_row,
            FP8_MAX_,
            MIN_SCALE,
            BLOCK,
            ONE_PASS_GROUP,
            HW,
        )
    else:
        pdl_enter(PDL)
        squares = tl.zeros([BLOCK], dtype=tl.float32)
        for chunk in range(0, row_len, BLOCK):
            cols = chunk + offsets
            mask = cols < row_len
            s = _residual_sum(x_row, residual_row, cols, mask, HAS_RESIDUAL, IN_DTYPE, HW)
            if HAS_RESIDUAL:
                out = residual_out_ptr + row * row_len + cols
                tl.store(out, s.to(residual_out_ptr.dtype.element_ty), mask=mask)
            squares += s * s
        variance = tl.math.div_rn(tl.sum(squares, axis=0), row_len_f)
        rstd = tl.math.rsqrt(variance + eps)

        for group in range(groups_per_row):
            start = group * group_len
            end = tl.minimum(start + group_len, row_len)
            amax = tl.zeros([BLOCK], dtype=tl.float32)
            for chunk in range(start, end, BLOCK):
                cols = chunk + offsets
                mask = cols < end
                y = _normed(
                    x_row,
                    residual_row,
                    w_ptr,
                    cols,
                    mask,
                    rstd,
                    HAS_RESIDUAL,
                    IN_DTYPE,
                    NORM_DTYPE,
                    HW,
                )
                amax = tl.maximum(amax, tl.abs(y))
            scale = _dynamic_scale(tl.max(amax, axis=0), FP8_MAX_, MIN_SCALE)
            tl.store(scale_ptr + row * groups_per_row + group, scale)
            for chunk in range(start, end, BLOCK):
                cols = chunk + offsets
                mask = cols < end
                y = _normed(
                    x_row,
                    residual_row,
                    w_ptr,
                    cols,
                    mask,
                    rstd,
                    HAS_RESIDUAL,
                    IN_DTYPE,
                    NORM_DTYPE,
                    HW,
                )
                q = _quantize_to_fp8(y, scale, FP8_MAX_, HW)
                tl.store(q_ptr + row * row_len + cols, q.to(q_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _silu_and_mul(x_row, cols, mask, half_len, IN_DTYPE: tl.constexpr, HW: tl.constexpr):
    """silu(gate) * up with both roundings to x's dtype the unfused ops make, in fp32."""
    gate = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_row + half_len + cols, mask=mask, other=0.0).to(tl.float32)
    return _silu_mul_values(gate, up, IN_DTYPE, HW)


@triton.jit
def _silu_mul_values(gate, up, DTYPE: tl.constexpr, HW: tl.constexpr):
    """silu(gate) * up of float32 values already in DTYPE, rounded to DTYPE as the unfused ops
    round the SiLU and the product (also the skinny gated GEMM's epilogue)."""
    # `/` is the GPU's fast division (2 ulps), like `exp`'s approximation: a bf16 output is
    # rounded from them either way (see the module's note on ulps).
    silu = _round_to(gate / (1.0 + tl.exp(-gate)), DTYPE, HW)
    return _round_to(silu * up, DTYPE, HW)


@triton.jit
def _silu_and_mul_quant_kernel(
    x_ptr,
    q_ptr,
    scale_ptr,
    half_len,
    group_len,
    groups_per_row,
    x_row_stride,
    IN_DTYPE: tl.constexpr,
    FP8_MAX_: tl.constexpr,
    MIN_SCALE: tl.constexpr,
    BLOCK: tl.constexpr,
    ONE_PASS_GROUP: tl.constexpr,
    HW: tl.constexpr,
    PDL: tl.constexpr,
):
    """ONE_PASS_GROUP > 0 (as in the norm kernel): one program per row, the whole output row
    computed once in registers and quantized per group. 0: one program per (row, group), each
    computing its group's values for the amax and again for the quantization, chunk by chunk."""
    pdl_enter(PDL)
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * x_row_stride
    offsets = tl.arange(0, BLOCK)

    if ONE_PASS_GROUP > 0:
        mask = offsets < half_len
        y = _silu_and_mul(x_row, offsets, mask, half_len, IN_DTYPE, HW)
        _store_groups(
            y,
            q_ptr + row * half_len,
            scale_ptr + row * groups_per_row,
            offsets,
            mask,
            groups_per_row,
            FP8_MAX_,
            MIN_SCALE,
            BLOCK,
            ONE_PASS_GROUP,
            HW,
        )
    else:
        group = tl.program_id(1)
        start = group * group_len
        end = tl.minimum(start + group_len, half_len)
        amax = tl.zeros([BLOCK], dtype=tl.float32)
        for chunk in range(start, end, BLOCK):
            cols = chunk + offsets
            y = _silu_and_mul(x_row, cols, cols < end, half_len, IN_DTYPE, HW)
            amax = tl.maximum(amax, tl.abs(y))
        scale = _dynamic_scale(tl.max(amax, axis=0), FP8_MAX_, MIN_SCALE)
        tl.store(scale_ptr + row * groups_per_row + group, scale)
        for chunk in range(start, end, BLOCK):
            cols = chunk + offsets
            mask = cols < end
            y = _silu_and_mul(x_row, cols, mask, half_len, IN_DTYPE, HW)
            q = _quantize_to_fp8(y, scale, FP8_MAX_, HW)
            tl.store(q_ptr + row * half_len + cols, q.to(q_ptr.dtype.element_ty), mask=mask)


def _launch(block: int) -> dict[str, int]:
    """Warps (and a register cap) per program. The widest one-pass tiles (a 14336-wide SiLU row in
    16384) take 16 warps capped at 64 registers a thread, so that an SM holds two programs and
    one row's loads overlap another's arithmetic. At 4k tokens on the H200
    (`benchmarks/sweep_fused_quant.py`, CUDA-graph replays) that is 79-81 us; 32 warps (one
    program an SM) take 92-95, and 8 or 16 uncapped warps 73-89 depending on the grouping and the
    run, no single one better in both. Else the quant kernels' choice (the 4096-wide norm row:
    30-31 us with 8 or 16 warps, capped or not)."""
    if block >= 16384:
        return {"num_warps": 16, "maxnreg": 64}
    return {"num_warps": _num_warps(block)}


def rms_norm_quant(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    group_size: int | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(q [..., K] e4m3, fp32 scales [..., ceil(K / group_size)], x + residual or None) of
    weight * rmsnorm(x (+ residual)); group_size None = one scale per row."""
    assert residual is None or residual.dtype == x.dtype, "the pass fuses same-dtype sums only"
    rows = _as_rows(x)
    res_rows = rows if residual is None else _as_rows(residual)
    num_rows, row_len = rows.shape
    group_len = row_len if group_size is None else group_size
    q, scales, groups_per_row = _quant_outputs(tuple(x.shape), group_len, x.device)
    residual_out = (
        None if residual is None else torch.empty(x.shape, dtype=x.dtype, device=x.device)
    )
    if num_rows == 0:
        return q, scales, residual_out
    block, one_pass_group = _tiling(row_len, group_len)
    _rms_norm_quant_kernel[(num_rows,)](
        rows,
        res_rows,
        weight.contiguous(),
        q,
        scales,
        rows if residual_out is None else residual_out,
        row_len,
        float(row_len),
        group_len,
        groups_per_row,
        rows.stride(0),
        res_rows.stride(0),
        eps,
        HAS_RESIDUAL=residual is not None,
        IN_DTYPE=_TL_DTYPES[x.dtype],
        NORM_DTYPE=_TL_DTYPES[torch.promote_types(weight.dtype, x.dtype)],
        FP8_MAX_=FP8_MAX,
        MIN_SCALE=FP8_MIN_SCALE,
        BLOCK=block,
        ONE_PASS_GROUP=one_pass_group,
        HW=not interpreting(),
        **_launch(block),
        **launch_options(x.device),
    )
    return q, scales, residual_out


def silu_and_mul_quant(
    x: torch.Tensor, group_size: int | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(q [..., K/2] e4m3, fp32 scales [..., ceil(K/2 / group_size)]) of silu(gate) * up for
    x = [gate | up]; group_size None = one scale per row."""
    rows = _as_rows(x)
    num_rows, half_len = rows.shape[0], rows.shape[1] // 2
    group_len = half_len if group_size is None else group_size
    out_shape = (*x.shape[:-1], half_len)
    q, scales, groups_per_row = _quant_outputs(out_shape, group_len, x.device)
    if num_rows == 0 or half_len == 0:
        return q, scales
    block, one_pass_group = _tiling(half_len, group_len)
    grid = (num_rows, 1) if one_pass_group else (num_rows, groups_per_row)
    _silu_and_mul_quant_kernel[grid](
        rows,
        q,
        scales,
        half_len,
        group_len,
        groups_per_row,
        rows.stride(0),
        IN_DTYPE=_TL_DTYPES[x.dtype],
        FP8_MAX_=FP8_MAX,
        MIN_SCALE=FP8_MIN_SCALE,
        BLOCK=block,
        ONE_PASS_GROUP=one_pass_group,
        HW=not interpreting(),
        **_launch(block),
        **launch_options(x.device),
    )
    return q, scales
