"""FP8 (e4m3) quantization kernels in Triton: per-token, per-token-group and static per-tensor.

fp8.py registers them as the CUDA implementations of its custom ops. Their quotients are IEEE
round-to-nearest (`div_rn`, or the cheaper sequence of `_quantize_to_fp8` that equals it) and their
e4m3 values round to nearest even, exactly as the fp32 PyTorch references do, so a kernel and its
reference agree bit for bit on the same input. On the GPU the e4m3 rounding is the cast itself;
under the Triton interpreter, whose fp32 -> fp8 cast rounds some values wrongly, it is done in fp32
arithmetic first (`_round_to_e4m3`), after which the cast is exact. The static kernel always
takes the latter path (its quotients may overflow: a checkpoint's scale bounds nothing).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from v1_engine.kernels import interpreting
from v1_engine.kernels.fp8 import FP8_DTYPE, FP8_MAX, FP8_MIN_SCALE
from v1_engine.kernels.pdl import launch_options, pdl_enter

MAX_BLOCK = 16384
"""Widest chunk of a row one loop iteration loads (registers stay bounded for long rows). Rows
up to 16k (the MLP width of 8B-70B models) take one chunk: a decode step has one row per token,
and a program walking its row chunk by chunk, twice, is pure latency there."""


@triton.jit
def _round_to_e4m3(v):
    """v (fp32, |v| <= 448) rounded to the nearest e4m3 value, ties to even, still in fp32.

    e4m3 keeps 3 mantissa bits, so the spacing around v is 2^(e - 3) for v's binary exponent e,
    floored at the subnormal spacing 2^-9. Scaling by a power of two is exact, and adding then
    subtracting 2^23 rounds to an integer with the fp32 adder's round-to-nearest-even.
    """
    exponent = ((v.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
    exponent = tl.maximum(exponent, -6)
    inv_step = ((130 - exponent) << 23).to(tl.float32, bitcast=True)  # 2^(3 - e)
    step = ((exponent + 124) << 23).to(tl.float32, bitcast=True)  # 2^(e - 3)
    magnitude = tl.abs(v) * inv_step
    rounded = ((magnitude + 8388608.0) - 8388608.0) * step
    # The sign is copied as a bit: `where(v < 0, -rounded, rounded)` lost it for values that
    # round to zero on the GPU (the compiler may ignore the sign of zero), giving +0 for the
    # reference's -0.
    sign = v.to(tl.uint32, bitcast=True) & 0x80000000
    return (rounded.to(tl.uint32, bitcast=True) | sign).to(tl.float32, bitcast=True)


@triton.jit
def _quantize_to_fp8(y, scale, FP8_MAX_: tl.constexpr, HW: tl.constexpr):
    """y / scale correctly rounded (as `div_rn`) and clamped to +-FP8_MAX_, then rounded to an
    e4m3 value: for dynamic scales (|y / scale| <= FP8_MAX_ up to the scale's rounding).

    HW (a GPU): one correctly rounded reciprocal per scale and three fp32 ops per element,
    Markstein's correction: with r = RN(1 / scale) and q0 = RN(y * r), the remainder
    y - q0 * scale is exact in one fma and RN(q0 + remainder * r) = RN(y / scale), where a
    `div.rn` per element (its range check and slow path included) made the fused SiLU kernel
    compute-bound. This holds while the quotient is a normal fp32; a smaller one rounds to a
    signed e4m3 zero either way. The e4m3 rounding and the clamp are the store's cast
    (cvt.rn.satfinite: nearest even, saturating at +-448). test_fp8_quant.py checks every bf16
    mantissa against every fp32 scale mantissa on the GPU, bit for bit.

    Not HW (the interpreter, whose fp8 cast truncates and whose fma rounds twice): `div_rn`,
    the clamp and `_round_to_e4m3`, after which the cast is exact."""
    if HW:
        r = tl.math.div_rn(1.0, scale)
        q0 = y * r
        q = tl.fma(tl.fma(-q0, scale, y), r, q0)
    else:
        q = _round_to_e4m3(tl.clamp(tl.math.div_rn(y, scale), -FP8_MAX_, FP8_MAX_))
    return q


@triton.jit
def _group_quant_kernel(
    x_ptr,
    q_ptr,
    scale_ptr,
    row_len,
    group_len,
    groups_per_row,
    x_row_stride,
    FP8_MAX_: tl.constexpr,
    MIN_SCALE: tl.constexpr,
    BLOCK: tl.constexpr,
    HW: tl.constexpr,
    PDL: tl.constexpr,
):
    """One program per (row, group): amax over the group, then quantize it. A per-token quant is
    the case of one group per row; a group longer than BLOCK is walked in BLOCK chunks."""
    pdl_enter(PDL)
    row = tl.program_id(0).to(tl.int64)
    group = tl.program_id(1)
    start = group * group_len
    end = tl.minimum(start + group_len, row_len)
    x_row = x_ptr + row * x_row_stride
    q_row = q_ptr + row * row_len
    offsets = tl.arange(0, BLOCK)

    amax = tl.zeros([BLOCK], dtype=tl.float32)
    for chunk in range(start, end, BLOCK):
        cols = chunk + offsets
        x = tl.load(x_row + cols, mask=cols < end, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(x))
    scale = tl.maximum(tl.math.div_rn(tl.max(amax, axis=0), FP8_MAX_), MIN_SCALE)
    tl.store(scale_ptr + row * groups_per_row + group, scale)

    for chunk in range(start, end, BLOCK):
        cols = chunk + offsets
        x = tl.load(x_row + cols, mask=cols < end, other=0.0).to(tl.float32)
        q = _quantize_to_fp8(x, scale, FP8_MAX_, HW)
        tl.store(q_row + cols, q.to(q_ptr.dtype.element_ty), mask=cols < end)


@triton.jit
def _static_quant_kernel(
    x_ptr,
    q_ptr,
    scale_ptr,
    row_len,
    x_row_stride,
    FP8_MAX_: tl.constexpr,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr,
):
    """One program per (row, BLOCK chunk): x / scale with the one per-tensor scale."""
    pdl_enter(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < row_len
    scale = tl.load(scale_ptr)
    x = tl.load(x_ptr + row * x_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
    q = _round_to_e4m3(tl.clamp(tl.math.div_rn(x, scale), -FP8_MAX_, FP8_MAX_))
    tl.store(q_ptr + row * row_len + cols, q.to(q_ptr.dtype.element_ty), mask=mask)


def _as_rows(x: torch.Tensor) -> torch.Tensor:
    """x viewed as [rows, K] with K contiguous (copied only when no such view exists)."""
    rows = x.reshape(-1, x.shape[-1])
    if rows.shape[1] > 1 and rows.stride(1) != 1:
        rows = rows.contiguous()
    return rows


def _block_for(length: int) -> int:
    return min(triton.next_power_of_2(max(length, 16)), MAX_BLOCK)


def _num_warps(block: int) -> int:
    return 1 if block <= 256 else 4 if block <= 2048 else 8 if block <= 8192 else 16


def per_token_group_quant(
    x: torch.Tensor, group_size: int | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """q [..., K] e4m3 and fp32 scales [..., ceil(K / group_size)]; group_size None = one group
    per row (per-token quantization, scales [..., 1])."""
    rows = _as_rows(x)
    num_rows, row_len = rows.shape
    group_len = row_len if group_size is None else group_size
    groups_per_row = -(-row_len // group_len)
    q = torch.empty(x.shape, dtype=FP8_DTYPE, device=x.device)
    scales = torch.empty((*x.shape[:-1], groups_per_row), dtype=torch.float32, device=x.device)
    if num_rows == 0:
        return q, scales
    block = _block_for(group_len)
    _group_quant_kernel[(num_rows, groups_per_row)](
        rows,
        q,
        scales,
        row_len,
        group_len,
        groups_per_row,
        rows.stride(0),
        FP8_MAX_=FP8_MAX,
        MIN_SCALE=FP8_MIN_SCALE,
        BLOCK=block,
        HW=not interpreting(),
        num_warps=_num_warps(block),
        **launch_options(x.device),
    )
    return q, scales


def static_quant(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """q [..., K] e4m3 = x / scale (one fp32 scale on the device), saturated to +-448."""
    rows = _as_rows(x)
    num_rows, row_len = rows.shape
    q = torch.empty(x.shape, dtype=FP8_DTYPE, device=x.device)
    if num_rows == 0:
        return q
    block = _block_for(min(row_len, 1024))
    grid = (num_rows, triton.cdiv(row_len, block))
    _static_quant_kernel[grid](
        rows,
        q,
        scale,
        row_len,
        rows.stride(0),
        FP8_MAX_=FP8_MAX,
        BLOCK=block,
        num_warps=_num_warps(block),
        **launch_options(x.device),
    )
    return q
