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


ONE_PASS_MAX = MAX_BLOCK
"""Longest row the group quant kernel and the fused norm / SiLU-and-mul + quant kernels
(triton_fused_quant.py) hold in registers whole: the input is read (and a fused activation
computed) once. Longer ones take the chunked bodies, which read the input twice (amax, then
quantization) and compute a fused activation twice; at prefill sizes that doubled arithmetic made
the fused kernels compute-bound."""


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

    Not HW (the interpreter, whose fp8 cast truncates): `div_rn`, the clamp and
    `_round_to_e4m3`, after which the cast is exact."""
    if HW:
        r = tl.math.div_rn(1.0, scale)
        q0 = y * r
        # q0 - (q0 * scale - y) * r: the signs written as `* -1.0` (an exact negation) so that
        # y = -0 gives -0 like div_rn; Triton's unary minus is `0 - x`, which makes +0 of -0.
        q = tl.fma(tl.fma(q0, scale, y * -1.0), r * -1.0, q0)
    else:
        q = _round_to_e4m3(tl.clamp(tl.math.div_rn(y, scale), -FP8_MAX_, FP8_MAX_))
    return q


@triton.jit
def _dynamic_scale(amax, FP8_MAX_: tl.constexpr, MIN_SCALE: tl.constexpr):
    """A dynamic e4m3 scale, max(amax / FP8_MAX_, MIN_SCALE), the division correctly rounded
    (fp8._scale_from_amax's, the references')."""
    return tl.maximum(tl.math.div_rn(amax, FP8_MAX_), MIN_SCALE)


@triton.jit
def _store_groups(
    y,
    q_row,
    scale_row,
    cols,
    mask,
    num_groups,
    FP8_MAX_: tl.constexpr,
    MIN_SCALE: tl.constexpr,
    BLOCK: tl.constexpr,
    GROUP: tl.constexpr,
    HW: tl.constexpr,
):
    """Quantizes a [BLOCK] row held in registers per GROUP-wide group (the first num_groups
    groups; lanes past the row are zeros): scales to scale_row, e4m3 values to q_row."""
    groups = tl.reshape(y, [BLOCK // GROUP, GROUP])
    amax = tl.max(tl.abs(groups), axis=1)
    scale = _dynamic_scale(amax, FP8_MAX_, MIN_SCALE)
    group_ids = tl.arange(0, BLOCK // GROUP)
    tl.store(scale_row + group_ids, scale, mask=group_ids < num_groups)
    q = tl.reshape(_quantize_to_fp8(groups, scale[:, None], FP8_MAX_, HW), [BLOCK])
    tl.store(q_row + cols, q.to(q_row.dtype.element_ty), mask=mask)


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
    ONE_PASS_GROUP: tl.constexpr,
    HW: tl.constexpr,
    PDL: tl.constexpr,
):
    """ONE_PASS_GROUP > 0: one program per row, loaded once into a BLOCK tile and quantized per
    ONE_PASS_GROUP-wide group from registers (BLOCK: one group per row = per token). 0: one
    program per (row, group), which reads its group twice (amax, then quantization), in BLOCK
    chunks."""
    pdl_enter(PDL)
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * x_row_stride
    q_row = q_ptr + row * row_len
    offsets = tl.arange(0, BLOCK)

    if ONE_PASS_GROUP > 0:
        mask = offsets < row_len
        x = tl.load(x_row + offsets, mask=mask, other=0.0).to(tl.float32)
        _store_groups(
            x,
            q_row,
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
        end = tl.minimum(start + group_len, row_len)
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


def _one_pass_group(row_len: int, group_len: int, block: int) -> int:
    """ONE_PASS_GROUP of the group quant and fused quant kernels: the group width of the one-pass body over a
    `block`-wide tile (0: the chunked body). The row must fit the tile and ONE_PASS_MAX, and
    several groups per row must be a power of two wide to split the tile evenly; one group per
    row spans the tile."""
    if block > ONE_PASS_MAX or row_len > block:
        return 0
    if group_len >= row_len:
        return block
    return group_len if group_len & (group_len - 1) == 0 else 0


def _tiling(row_len: int, group_len: int) -> tuple[int, int]:
    """(BLOCK, ONE_PASS_GROUP) of the group quant and fused quant kernels for rows of row_len
    values in group_len-wide groups: the whole row's power-of-two tile where the one-pass body
    takes it, else one group's chunk."""
    row_block = triton.next_power_of_2(max(row_len, 16))
    one_pass_group = _one_pass_group(row_len, group_len, row_block)
    return (row_block if one_pass_group else _block_for(group_len)), one_pass_group


def _quant_outputs(
    shape: tuple[int, ...], group_len: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, int]:
    groups_per_row = -(-shape[-1] // group_len)
    q = torch.empty(shape, dtype=FP8_DTYPE, device=device)
    scales = torch.empty((*shape[:-1], groups_per_row), dtype=torch.float32, device=device)
    return q, scales, groups_per_row


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
    q, scales, groups_per_row = _quant_outputs(tuple(x.shape), group_len, x.device)
    if num_rows == 0:
        return q, scales
    block, one_pass_group = _tiling(row_len, group_len)
    grid = (num_rows, 1) if one_pass_group else (num_rows, groups_per_row)
    _group_quant_kernel[grid](
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
        ONE_PASS_GROUP=one_pass_group,
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
