"""Skinny FP8 GEMMs in Triton for decode-sized M (1..64): the CUDA bodies of `v1_engine::scaled_mm`
and `v1_engine::block_scaled_mm` (fp8.py) run them on the shapes FP8_TUNED_LAUNCH holds.

At decode sizes an FP8 linear only streams its e4m3 weight from HBM; the CUTLASS kernels, tiled
for large M, read it well below bandwidth there. Here, as in the bf16 skinny GEMM (triton_gemv.py,
whose launch keys, bodies and helpers this module shares), each program owns BLOCK_N rows of the
weight and walks the whole of K with pipelined loads, one kernel per linear; a launch's
`split_k` splits K over that many programs per column tile, whose float32 partials the last one
to arrive sums in slice order (triton_gemv's split epilogue, shared). The e4m3 operands are
upcast in registers to float16 (exact: every e4m3 value is an fp16 value, and products of two
are exact in the float32 accumulator) and multiplied on tensor
cores with the weight tile as the left operand (triton_gemv's "dot_swap" body). Both kinds
also have an "fma" body for M <= 4, as the bf16 kernel, whose fastest body it is at M = 1 (no
tensor core layouts: each thread multiplies its loaded bytes into a [BLOCK_N, BLOCK_K] float32
accumulator per activation row, summed over K once at the end); it upcasts e4m3 through
float16 to float32 (Triton 3.6 on the H200 has no direct e4m3 -> float32 conversion; both steps
are exact). The "dot" body fails to compile with e4m3 operands there (at its tl.dot). The
"wgmma" body is dot_swap without the upcast: with column tiles of 64 weight rows or more, Triton
multiplies the e4m3 tiles as loaded in Hopper's FP8 warpgroup MMA (QGMMA.64x16x32 in the sm_90
SASS: 0.03-0.04 warp instructions a weight byte, against dot_swap's 0.06-0.08 and fma's
0.11-0.16), adding each K step's partial sums in float32. Two kinds:

- "channel" (`fp8_skinny_gemm`): out = (a @ b^T) * scale_a[m or 0] * scale_b[n or 0] (+ bias),
  scales applied once in the epilogue in scaled_mm_ref's order;
- "block" (`fp8_block_skinny_gemm`, DeepSeek-V3 layout): K is walked one 128-wide scale group per
  step and each step's float32 partial product is scaled by scale_a[m, kb] * scale_b[n // 128, kb]
  before it is added to the accumulator (the fma body scales the activation row instead, 128
  products a row and step rather than a tile's).

Nothing changes until a shape is measured: the ops keep CUTLASS for every shape without an entry
in FP8_TUNED_LAUNCH (`benchmarks/sweep_skinny_gemm.py --fp8 channel|block` prints the entries),
and V1ENGINE_SKINNY_GEMM=0 (skinny_launch.SKINNY_GEMM_ENABLED) keeps them on CUTLASS everywhere.
kernels/fp8_launch.py holds the launch rules: a shape's config from the table or a default, the
validation of launch overrides, and that dispatch rule (`prefers_fp8_skinny`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from v1_engine.kernels import interpreting, skinny_launch, triton_gemv
from v1_engine.kernels.fp8_launch import (
    DECODE_KINDS,
    SCALE_GROUP,
    WGMMA_PROMOTE_K,
    resolve_fp8_launch,
)
from v1_engine.kernels.pdl import launch_options, pdl_release, pdl_wait
from v1_engine.kernels.triton_gemv import _dot, _split_arrive, _split_sum

FP8_DTYPE = torch.float8_e4m3fn
_PROMOTE_K = tl.constexpr(WGMMA_PROMOTE_K)
"""fp8_launch.WGMMA_PROMOTE_K as the kernels read it (a global a kernel reads is a constexpr)."""
OUT_DTYPES = (torch.bfloat16, torch.float16)


@triton.jit
def _swapped_dot(a_ptrs, b_ptrs, m_mask, n_mask, k_mask, DOT_F32: tl.constexpr,
                 NATIVE: tl.constexpr):  # fmt: skip
    """One K step: b [BLOCK_N, BLOCK_K] @ a [BLOCK_M, BLOCK_K]^T as float32 [BLOCK_N, BLOCK_M].
    "dot_swap": the operands upcast from e4m3 (exact) to float16 first. NATIVE ("wgmma"): the
    e4m3 tiles as loaded, which sm_90 multiplies in FP8 warpgroup MMAs (QGMMA) with no
    conversion; its partial sums are added in float32 every 128 of K (max_num_imprecise_acc:
    the tensor core's reduced-precision accumulation covers 128 products at most, as DeepSeek-V3
    promotes them; block_k is a multiple, see fp8_launch.WGMMA_PROMOTE_K). float32 under the
    interpreter. The weight streams through once (evict first); the activations are reread by
    every program."""
    b = tl.load(b_ptrs, mask=n_mask[:, None] & k_mask, other=0.0, eviction_policy="evict_first")
    a = tl.load(a_ptrs, mask=m_mask[:, None] & k_mask, other=0.0, eviction_policy="evict_last")
    return _swapped_mma(a, b, DOT_F32, NATIVE)


@triton.jit
def _swapped_mma(a, b, DOT_F32: tl.constexpr, NATIVE: tl.constexpr):
    """`_swapped_dot`'s product of tiles already loaded: b [BLOCK_N, BLOCK_K] @ a^T."""
    if DOT_F32:
        return _dot(b.to(tl.float32), tl.trans(a.to(tl.float32)), DOT_F32)
    if NATIVE:
        return tl.dot(b, tl.trans(a), max_num_imprecise_acc=_PROMOTE_K)
    return _dot(b.to(tl.float16), tl.trans(a.to(tl.float16)), DOT_F32)


@triton.jit
def _to_f32(x, DOT_F32: tl.constexpr):
    """float32 values of a loaded tile: e4m3 through float16 on the device (Triton 3.6 has no
    direct e4m3 -> float32 there; both steps exact), 16-bit floats directly."""
    if x.dtype.is_fp8() and not DOT_F32:
        return x.to(tl.float16).to(tl.float32)
    return x.to(tl.float32)


@triton.jit
def _load_weight_f32(b_ptrs, n_mask, k_row, DOT_F32: tl.constexpr):
    """One K step's [BLOCK_N, BLOCK_K] weight tile of the fma body, as float32."""
    b = tl.load(b_ptrs, mask=n_mask[:, None] & k_row[None, :], other=0.0,
                eviction_policy="evict_first")  # fmt: skip
    return _to_f32(b, DOT_F32)


@triton.jit
def _row_fma(acc, a_row, row: tl.constexpr, stride_am, M, w32, k_row, scale_ptr, stride_s,
             scale_b, SCALED: tl.constexpr, DOT_F32: tl.constexpr):  # fmt: skip
    """acc [BLOCK_N, BLOCK_K] plus activation row `row` (zeros past M) times w32; SCALED (the
    block kind: one scale group a K step) first multiplies the row by its group scale
    scale_ptr[row * stride_s] times the weight tile's scale_b, BLOCK_K products a row instead
    of BLOCK_N x BLOCK_K on the weight."""
    row_ok = (k_row.to(tl.int32) * 0 + row) < M
    a = tl.load(a_row + row * stride_am, mask=k_row & row_ok, other=0.0,
                eviction_policy="evict_last")  # fmt: skip
    a32 = _to_f32(a, DOT_F32)
    if SCALED:
        a32 = a32 * (tl.load(scale_ptr + row * stride_s, mask=row < M, other=0.0) * scale_b)
    return acc + a32[None, :] * w32


@triton.jit
def _fma_rows(acc0, acc1, acc2, acc3, a_row, stride_am, M, w32, k_row, scale_ptr, stride_s,
              scale_b, SCALED: tl.constexpr, BLOCK_M: tl.constexpr,
              DOT_F32: tl.constexpr):  # fmt: skip
    """One K step of the "fma" body: the weight tile w32 times each of the BLOCK_M (1, 2 or 4)
    activation rows, into that row's 2-D [BLOCK_N, BLOCK_K] float32 accumulator (SCALED: each
    row times its scales first, see _row_fma; unscaled callers pass a_row, 0, 1.0). 2-D tiles
    keep the loads 16-byte vectors: a [BLOCK_M, BLOCK_N, BLOCK_K] broadcast had Triton read the
    e4m3 tile back from shared memory byte by byte on sm_90 (200 instructions a 4 KB K step,
    against 160 this way and the bf16 kernel's 106)."""
    scaling = (scale_ptr, stride_s, scale_b, SCALED, DOT_F32)
    acc0 = _row_fma(acc0, a_row, 0, stride_am, M, w32, k_row, *scaling)
    if BLOCK_M > 1:
        acc1 = _row_fma(acc1, a_row, 1, stride_am, M, w32, k_row, *scaling)
    if BLOCK_M > 2:
        acc2 = _row_fma(acc2, a_row, 2, stride_am, M, w32, k_row, *scaling)
        acc3 = _row_fma(acc3, a_row, 3, stride_am, M, w32, k_row, *scaling)
    return acc0, acc1, acc2, acc3


@triton.jit
def _fma_accumulators(BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """The fma body's four per-row [BLOCK_N, BLOCK_K] float32 accumulators, zeroed (rows past
    BLOCK_M are never touched)."""
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    return acc, tl.zeros_like(acc), tl.zeros_like(acc), tl.zeros_like(acc)


@triton.jit
def _fma_result(acc0, acc1, acc2, acc3, offs_m, BLOCK_M: tl.constexpr):
    """The [BLOCK_M, BLOCK_N] tile of the per-row accumulators, each summed over K."""
    rows = offs_m[:, None]
    result = tl.where(rows == 0, tl.sum(acc0, axis=1)[None, :], 0.0)
    if BLOCK_M > 1:
        result = tl.where(rows == 1, tl.sum(acc1, axis=1)[None, :], result)
    if BLOCK_M > 2:
        result = tl.where(rows == 2, tl.sum(acc2, axis=1)[None, :], result)
        result = tl.where(rows == 3, tl.sum(acc3, axis=1)[None, :], result)
    return result


@triton.jit
def _store_rows(out_ptr, result, offs_m, offs_n, m_mask, n_mask, stride_om):
    out_ptrs = out_ptr + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :]
    tl.store(out_ptrs, result.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


@triton.jit(do_not_specialize=["M", "stride_sa", "stride_sb"])
def _fp8_skinny_kernel(
    a_ptr,
    b_ptr,
    scale_a_ptr,
    scale_b_ptr,
    bias_ptr,
    out_ptr,
    partial_ptr,
    arrivals_ptr,
    M,
    N,
    K,
    k_per_split,
    stride_am,
    stride_bn,
    stride_om,
    stride_sa,
    stride_sb,
    HAS_BIAS: tl.constexpr,
    DOT_F32: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    NUM_STAGES: tl.constexpr,
    SPLIT_K: tl.constexpr,
    FMA: tl.constexpr,
    NATIVE: tl.constexpr,
    PDL: tl.constexpr,
):
    """Per-tensor/per-channel kind: program (n, s) owns BLOCK_N output columns over the s-th
    k_per_split-wide slice of K (all of K unsplit); scale strides are 0 for a per-tensor scale.
    The scales (and bias) apply once, to the summed tile. FMA picks the "fma" body, NATIVE the
    "wgmma" one (else "dot_swap")."""
    pdl_wait(PDL)
    tile = tl.program_id(0)
    k_start = tl.program_id(1) * k_per_split
    k_end = tl.minimum(K, k_start + k_per_split)
    offs_n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    n_mask = offs_n < N
    m_mask = offs_m < M
    a_ptrs = a_ptr + offs_m[:, None].to(tl.int64) * stride_am + (k_start + offs_k)[None, :]
    b_ptrs = b_ptr + offs_n[:, None].to(tl.int64) * stride_bn + (k_start + offs_k)[None, :]
    a_row = a_ptr + k_start + offs_k  # the fma body's row 0 (rows follow at stride_am)
    if FMA:
        acc0, acc1, acc2, acc3 = _fma_accumulators(BLOCK_N, BLOCK_K)
    else:
        acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    for k in tl.range(k_start, k_end, BLOCK_K, num_stages=NUM_STAGES):
        if FMA:
            k_row = offs_k < k_end - k
            w32 = _load_weight_f32(b_ptrs, n_mask, k_row, DOT_F32)
            acc0, acc1, acc2, acc3 = _fma_rows(acc0, acc1, acc2, acc3, a_row, stride_am, M, w32,
                                               k_row, a_row, 0, 1.0, False, BLOCK_M,
                                               DOT_F32)  # fmt: skip
        else:
            k_mask = offs_k[None, :] < k_end - k
            acc += _swapped_dot(a_ptrs, b_ptrs, m_mask, n_mask, k_mask, DOT_F32, NATIVE)
        a_ptrs += BLOCK_K
        a_row += BLOCK_K
        b_ptrs += BLOCK_K
    pdl_release(PDL)
    if FMA:
        result = _fma_result(acc0, acc1, acc2, acc3, offs_m, BLOCK_M)
    else:
        result = tl.trans(acc)
    epilogue = (scale_a_ptr, scale_b_ptr, bias_ptr, out_ptr, offs_m, offs_n, m_mask, n_mask,
                stride_sa, stride_sb, stride_om, HAS_BIAS)  # fmt: skip
    if SPLIT_K > 1:
        tile_mask = m_mask[:, None] & n_mask[None, :]
        split = (partial_ptr, arrivals_ptr, tile, offs_m, offs_n, tile_mask, M, N)
        if _split_arrive(result, *split, SPLIT_K):
            _scale_and_store(_split_sum(result, *split, SPLIT_K), *epilogue)
            tl.atomic_xchg(arrivals_ptr + tile, 0)
    else:
        _scale_and_store(result, *epilogue)


@triton.jit
def _scale_and_store(result, scale_a_ptr, scale_b_ptr, bias_ptr, out_ptr, offs_m, offs_n, m_mask,
                     n_mask, stride_sa, stride_sb, stride_om, HAS_BIAS: tl.constexpr):  # fmt: skip
    """The channel kind's epilogue: the float32 tile times scale_a[m] and scale_b[n] (+ bias),
    stored in out's dtype."""
    scale_a = tl.load(scale_a_ptr + offs_m * stride_sa, mask=m_mask, other=0.0)
    scale_b = tl.load(scale_b_ptr + offs_n * stride_sb, mask=n_mask, other=0.0)
    result = result * scale_a[:, None] * scale_b[None, :]
    if HAS_BIAS:
        result += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    _store_rows(out_ptr, result, offs_m, offs_n, m_mask, n_mask, stride_om)


@triton.jit(do_not_specialize=["M", "stride_sam", "stride_sak", "stride_sbn", "stride_sbk"])
def _fp8_block_skinny_kernel(
    a_ptr,
    b_ptr,
    scale_a_ptr,
    scale_b_ptr,
    out_ptr,
    partial_ptr,
    arrivals_ptr,
    M,
    N,
    K,
    k_per_split,
    stride_am,
    stride_bn,
    stride_om,
    stride_sam,
    stride_sak,
    stride_sbn,
    stride_sbk,
    DOT_F32: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    NUM_STAGES: tl.constexpr,
    SPLIT_K: tl.constexpr,
    FMA: tl.constexpr,
    NATIVE: tl.constexpr,
    PDL: tl.constexpr,
):
    """Block-scaled kind: BLOCK_K is the scale group and BLOCK_N divides it, so each step's weight
    tile has one scale (scale_b[n // BLOCK_K, kb]) and each activation row one (scale_a[m, kb]).
    Program (n, s) walks the s-th k_per_split-wide slice of K (whole groups; all of K unsplit);
    the partial sums are scaled already, so a split only adds them. FMA picks the "fma" body,
    which scales each activation row by its two scales before multiplying it into the row's
    accumulator (the sums over K then come out scaled), else "dot_swap" ("wgmma" with NATIVE),
    which scales each step's partial product: one 128-wide group in the tensor core's
    accumulation precision, as DeepSeek-V3's recipe promotes them."""
    tile = tl.program_id(0)
    pdl_wait(PDL)
    kb_start = tl.program_id(1) * (k_per_split // BLOCK_K)
    kb_end = tl.minimum(tl.cdiv(K, BLOCK_K), kb_start + k_per_split // BLOCK_K)
    offs_n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    n_mask = offs_n < N
    m_mask = offs_m < M
    k_offs = kb_start * BLOCK_K + offs_k
    a_ptrs = a_ptr + offs_m[:, None].to(tl.int64) * stride_am + k_offs[None, :]
    b_ptrs = b_ptr + offs_n[:, None].to(tl.int64) * stride_bn + k_offs[None, :]
    a_row = a_ptr + k_offs  # the fma body's row 0 (rows follow at stride_am)
    scale_a_ptrs = scale_a_ptr + offs_m * stride_sam
    scale_b_ptr += (tile * BLOCK_N // BLOCK_K) * stride_sbn
    if FMA:
        acc0, acc1, acc2, acc3 = _fma_accumulators(BLOCK_N, BLOCK_K)
    else:
        acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    for kb in tl.range(kb_start, kb_end, num_stages=NUM_STAGES):
        scale_b = tl.load(scale_b_ptr + kb * stride_sbk)
        if FMA:
            k_row = offs_k < K - kb * BLOCK_K
            w32 = _load_weight_f32(b_ptrs, n_mask, k_row, DOT_F32)
            acc0, acc1, acc2, acc3 = _fma_rows(acc0, acc1, acc2, acc3, a_row, stride_am, M, w32,
                                               k_row, scale_a_ptr + kb * stride_sak, stride_sam,
                                               scale_b, True, BLOCK_M, DOT_F32)  # fmt: skip
        else:
            k_mask = offs_k[None, :] < K - kb * BLOCK_K
            partial = _swapped_dot(a_ptrs, b_ptrs, m_mask, n_mask, k_mask, DOT_F32, NATIVE)
            scale_a = tl.load(scale_a_ptrs + kb * stride_sak, mask=m_mask, other=0.0)
            acc += partial * scale_a[None, :] * scale_b
        a_ptrs += BLOCK_K
        a_row += BLOCK_K
        b_ptrs += BLOCK_K
    pdl_release(PDL)
    if FMA:
        result = _fma_result(acc0, acc1, acc2, acc3, offs_m, BLOCK_M)
    else:
        result = tl.trans(acc)
    if SPLIT_K > 1:
        tile_mask = m_mask[:, None] & n_mask[None, :]
        split = (partial_ptr, arrivals_ptr, tile, offs_m, offs_n, tile_mask, M, N)
        if _split_arrive(result, *split, SPLIT_K):
            total = _split_sum(result, *split, SPLIT_K)
            _store_rows(out_ptr, total, offs_m, offs_n, m_mask, n_mask, stride_om)
            tl.atomic_xchg(arrivals_ptr + tile, 0)
    else:
        _store_rows(out_ptr, result, offs_m, offs_n, m_mask, n_mask, stride_om)


def fits_fp8_skinny(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None = None) -> bool:
    """Whether the kernels take these operands: e4m3 a and b laid out as
    triton_gemv.skinny_operands needs, and a contiguous bias. Scales may have any strides (the
    kernels read them through strides)."""
    if a.dtype != FP8_DTYPE or b.dtype != FP8_DTYPE or not triton_gemv.skinny_operands(a, b):
        return False
    return bias is None or (bias.shape == (b.shape[0],) and bias.is_contiguous())


def _vector_stride(scale: torch.Tensor) -> int:
    """Element stride between consecutive values of a scale holding one value ([1], [1, 1]: 0,
    broadcast) or one per row/column ([M], [M, 1], [1, M]), read in place (no copy)."""
    if scale.numel() == 1:
        return 0
    long_dims = [d for d in range(scale.dim()) if scale.shape[d] > 1]
    assert len(long_dims) == 1, f"scale of shape {tuple(scale.shape)} is not a vector"
    return scale.stride(long_dims[0])


def _constexprs(
    m: int, config: dict[str, int | str], device: torch.device
) -> dict[str, int | bool]:
    """Compile-time arguments and launch options shared by both kernels."""
    return {
        "DOT_F32": interpreting(),
        "BLOCK_M": skinny_launch.block_rows(str(config["mode"]), m),
        "BLOCK_N": config["block_n"],
        "BLOCK_K": config["block_k"],
        "NUM_STAGES": config["num_stages"],
        "SPLIT_K": config["split_k"],
        "NATIVE": config["mode"] == "wgmma",
        "num_warps": config["num_warps"],
        "num_stages": config["num_stages"],
    } | launch_options(device)


def _check_out_dtype(out_dtype: torch.dtype) -> None:
    if out_dtype not in OUT_DTYPES:
        raise ValueError(f"out_dtype must be one of {OUT_DTYPES}, got {out_dtype}")


def fp8_skinny_gemm(
    a: torch.Tensor,
    b: torch.Tensor,
    scale_a: torch.Tensor,
    scale_b: torch.Tensor,
    out_dtype: torch.dtype,
    bias: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    **launch: int | str,
) -> torch.Tensor:
    """out [M, N] = (a @ b^T) * scale_a * scale_b (+ bias) in out_dtype, float32 accumulation.

    a e4m3 [M, K] (K contiguous), b e4m3 [N, K] contiguous, scale_a fp32 with 1 or M values,
    scale_b fp32 with 1 or N values, bias [N]. Any M works but the kernel is meant for
    M <= SKINNY_MAX_M. `launch` overrides keys of `fp8_launch_config` (tuning). Arguments are
    validated by fp8.scaled_mm; here only internal invariants are asserted.
    """
    _check_out_dtype(out_dtype)
    m, k = a.shape
    n = b.shape[0]
    assert b.shape[1] == k and a.stride(1) == 1 and b.stride(1) == 1
    assert scale_a.numel() in (1, m) and scale_b.numel() in (1, n)
    config = resolve_fp8_launch("channel", m, n, k, launch)
    if out is None:
        out = torch.empty((m, n), dtype=out_dtype, device=a.device)
    tiles, split = triton.cdiv(n, config["block_n"]), config["split_k"]
    partials, arrivals = triton_gemv.split_workspace(out, tiles, split)
    _fp8_skinny_kernel[(tiles, split)](
        a,
        b,
        scale_a,
        scale_b,
        bias if bias is not None else out,
        out,
        partials,
        arrivals,
        m,
        n,
        k,
        skinny_launch.k_per_split(k, config),
        a.stride(0),
        b.stride(0),
        out.stride(0),
        _vector_stride(scale_a),
        _vector_stride(scale_b),
        HAS_BIAS=bias is not None,
        FMA=config["mode"] == "fma",
        **_constexprs(m, config, a.device),
    )
    return out


def fp8_block_skinny_gemm(
    a: torch.Tensor,
    b: torch.Tensor,
    scale_a: torch.Tensor,
    scale_b: torch.Tensor,
    out_dtype: torch.dtype,
    out: torch.Tensor | None = None,
    **launch: int | str,
) -> torch.Tensor:
    """out [M, N] in out_dtype from block-scaled e4m3 operands: scale_a fp32 [M, ceil(K/128)]
    (per 1x128 group), scale_b fp32 [ceil(N/128), ceil(K/128)] (per 128x128 block); K and N
    may end in a partial group. `launch` overrides keys of `fp8_launch_config` (tuning)."""
    _check_out_dtype(out_dtype)
    m, k = a.shape
    n = b.shape[0]
    groups_k = triton.cdiv(k, SCALE_GROUP)
    assert b.shape[1] == k and a.stride(1) == 1 and b.stride(1) == 1
    assert scale_a.shape == (m, groups_k)
    assert scale_b.shape == (triton.cdiv(n, SCALE_GROUP), groups_k)
    config = resolve_fp8_launch("block", m, n, k, launch)
    if out is None:
        out = torch.empty((m, n), dtype=out_dtype, device=a.device)
    tiles, split = triton.cdiv(n, config["block_n"]), config["split_k"]
    partials, arrivals = triton_gemv.split_workspace(out, tiles, split)
    _fp8_block_skinny_kernel[(tiles, split)](
        a,
        b,
        scale_a,
        scale_b,
        out,
        partials,
        arrivals,
        m,
        n,
        k,
        skinny_launch.k_per_split(k, config),
        a.stride(0),
        b.stride(0),
        out.stride(0),
        *scale_a.stride(),
        *scale_b.stride(),
        FMA=config["mode"] == "fma",
        **_constexprs(m, config, a.device),
    )
    return out


def precompile_fp8(
    kind: str, out_dtype: torch.dtype, m: int, n: int, k: int, **launch: int | str
) -> None:
    """Compile (into Triton's cache) the kernel the `kind` GEMM would launch for contiguous,
    16-byte aligned operands of this shape without launching it (bias-free for the channel
    kind): lets a tuning sweep compile its configurations in parallel processes. Scale strides
    are never specialized, so one compile serves every scale granularity."""
    config = resolve_fp8_launch(kind, m, n, k, launch)
    fp8, fp32 = FP8_DTYPE, torch.float32
    if kind in DECODE_KINDS:
        from v1_engine.kernels import triton_gemv_fp8_decode

        triton_gemv_fp8_decode.precompile_decode(kind, out_dtype, m, n, k, config)
        return
    constexprs = _constexprs(m, config, torch.device("cuda"))
    split = config["split_k"] > 1
    workspace = (fp32 if split else out_dtype, torch.int32 if split else out_dtype)
    sizes = (m, n, k, skinny_launch.k_per_split(k, config), k, k, n)
    if kind == "channel":
        args = (fp8, fp8, fp32, fp32, out_dtype, out_dtype, *workspace, *sizes, 1, 1)
        _fp8_skinny_kernel.warmup(
            *args, grid=(1,), HAS_BIAS=False, FMA=config["mode"] == "fma", **constexprs
        )
    else:
        groups_k = triton.cdiv(k, SCALE_GROUP)
        args = (fp8, fp8, fp32, fp32, out_dtype, *workspace, *sizes, groups_k, 1, groups_k, 1)
        _fp8_block_skinny_kernel.warmup(*args, grid=(1,), FMA=config["mode"] == "fma", **constexprs)
