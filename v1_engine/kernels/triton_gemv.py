"""Skinny GEMM in Triton: y [M, N] = x [M, K] @ W[N, K]^T (+ bias) for decode-sized M (1..64).

At decode sizes a linear layer only streams its weight from HBM; the matmul itself is free. The
vendor GEMM reads small weights well below bandwidth there and splits K on some shapes (two extra
kernels per linear: a copy and a reduction). Here each linear is one kernel: the grid runs over
BLOCK_N-row tiles of W and each program walks the whole of K with pipelined loads, accumulating in
float32 and storing in x's dtype.

`split_k` > 1 (a launch key; 1 unless a launch asks) splits K into that many slices, one program
each: every program stores its float32 partial tile to a workspace and counts itself in on a
per-tile semaphore, and the last to arrive sums the partials in slice order (so results stay
deterministic), stores the tile and resets the semaphore for the next launch, still in one
kernel (`_split_arrive` / `_split_sum`, which the FP8 skinny kernels share). At M = 32..64 each
column tile re-reads all of x from L2: wider tiles read it fewer times, and the split keeps
their number of programs up; at small M a split puts more programs, so more loads, in flight per
SM. Only entries the sweep measured faster carry a split.

Three bodies, picked by the launch config's `mode` (the sweep compares them):

- "dot": acc[BLOCK_M, BLOCK_N] = x @ W^T on tensor cores, BLOCK_M being M rounded up to a power
  of two and at least 16 (the padding rows are masked, never read);
- "dot_swap": acc[BLOCK_N, BLOCK_M] = W @ x^T, the weight tile as the dot's left operand;
- "fma": broadcast multiply into a [BLOCK_M, BLOCK_N, BLOCK_K] float32 accumulator, summed over K
  once at the end; BLOCK_M is M rounded up to a power of two (no padding to 16), at most
  FMA_MAX_M (the accumulator lives in registers).

The launch rules (SKINNY_MAX_M, FMA_MAX_M, the bodies, the measured table and the validation of a
launch's overrides) are kernels/skinny_launch.py. The `v1_engine::skinny_linear` op that the
unquantized linear layers call on CUDA, and that picks between this kernel, the CUTLASS GEMM and
F.linear, is kernels/skinny_linear_op.py.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from v1_engine.kernels import interpreting, pdl, skinny_launch
from v1_engine.kernels.pdl import (
    launch_options,
    pdl_release_early,
    pdl_release_unless,
    pdl_wait,
)
from v1_engine.kernels.semaphores import split_semaphores
from v1_engine.kernels.triton_fused_quant import _round_to, _silu_mul_values

SKINNY_DTYPES = (torch.bfloat16, torch.float16)
"""Operand dtypes the op routes to the kernel (the kernel itself also takes float32)."""

_MODE_IDS = {name: index for index, name in enumerate(skinny_launch.MODES)}
"""The kernel's MODE constexpr of each body (the bodies and the other launch rules:
kernels/skinny_launch.py)."""

_ALIGN_BYTES = 16
"""K and x's row stride must keep rows 16-byte aligned for vector loads."""


@triton.jit
def _dot(a, b, DOT_F32: tl.constexpr):
    """a @ b with float32 accumulation; exact float32 products for float32 operands (and under
    the interpreter, whose dot cannot take 16-bit floats: operands are upcast there)."""
    if DOT_F32:
        return tl.dot(a, b, input_precision="ieee")
    return tl.dot(a, b)


@triton.jit(do_not_specialize=["M", "early_from"])
def _skinny_gemm_kernel(
    x_ptr,
    w_ptr,
    bias_ptr,
    out_ptr,
    partial_ptr,
    arrivals_ptr,
    residual_ptr,
    norm_w_ptr,
    normed_ptr,
    residual_out_ptr,
    M,
    N,
    K,
    k_per_split,
    stride_xm,
    stride_wn,
    stride_om,
    stride_rm,
    eps,
    early_from,
    HAS_BIAS: tl.constexpr,
    MODE: tl.constexpr,
    DOT_F32: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    NUM_STAGES: tl.constexpr,
    SPLIT_K: tl.constexpr,
    GATED: tl.constexpr,
    ADD_NORM: tl.constexpr,
    NORM_IN: tl.constexpr,
    NORM_BLOCK: tl.constexpr,
    HW: tl.constexpr,
    PDL: tl.constexpr,
    EARLY_RELEASE: tl.constexpr,
):
    """Program (n, s): BLOCK_N output columns over the s-th k_per_split-wide slice of K (all of K
    when SPLIT_K is 1; MODE, the split and the GATED / ADD_NORM epilogues: see the module).
    NORM_IN (SPLIT_K 1): x is rmsnorm(x + residual) * norm_w, folded in (see _fold_norm_step);
    program 0 stores x + residual to residual_out. Under PDL with EARLY_RELEASE the programs
    from `early_from` on, in launch order, signal the next kernel as they start
    (EARLY_RELEASE_PER_SM), the rest after their loop."""
    pdl_wait(PDL)
    tile = tl.program_id(0)
    program = tl.program_id(1) * tl.num_programs(0) + tile
    released = pdl_release_early(PDL, EARLY_RELEASE, program, early_from)
    k_start = tl.program_id(1) * k_per_split
    k_end = tl.minimum(K, k_start + k_per_split)
    offs_n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    n_mask = offs_n < N
    m_mask = offs_m < M
    w_ptrs = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn + (k_start + offs_k)[None, :]
    x_ptrs = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm + (k_start + offs_k)[None, :]
    if MODE == 0:
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    elif MODE == 1:
        acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N, BLOCK_K], dtype=tl.float32)
    if GATED:  # the up rows sit N rows below the gate rows; their own accumulator
        u_ptrs = w_ptrs + N.to(tl.int64) * stride_wn
        acc_u = tl.zeros_like(acc)
    ss = tl.zeros([BLOCK_M], dtype=tl.float32)  # NORM_IN: each row's sum of squares
    r_ptrs = residual_ptr + offs_m[:, None].to(tl.int64) * stride_rm + offs_k[None, :]
    h_ptrs = residual_out_ptr + offs_m[:, None].to(tl.int64) * K + offs_k[None, :]
    # An explicit num_stages on the loop pipelines the loads even where no tl.dot consumes them.
    for k in tl.range(k_start, k_end, BLOCK_K, num_stages=NUM_STAGES):
        k_mask = offs_k[None, :] < k_end - k
        w_mask = n_mask[:, None] & k_mask
        w = tl.load(w_ptrs, mask=w_mask, other=0.0, eviction_policy="evict_first")
        x = tl.load(x_ptrs, mask=m_mask[:, None] & k_mask, other=0.0, eviction_policy="evict_last")
        if NORM_IN:
            x, ss = _fold_norm_step(x, r_ptrs, h_ptrs, norm_w_ptr + k, offs_k, m_mask, k_mask,
                                    tile, ss, MODE, DOT_F32, HW)  # fmt: skip
            r_ptrs += BLOCK_K
            h_ptrs += BLOCK_K
        elif DOT_F32:
            x = x.to(tl.float32)
        acc = _accumulate(acc, x, w, MODE, DOT_F32)
        if GATED:
            u = tl.load(u_ptrs, mask=w_mask, other=0.0, eviction_policy="evict_first")
            acc_u = _accumulate(acc_u, x, u, MODE, DOT_F32)
            u_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
    pdl_release_unless(PDL, released)
    result = _tile_result(acc, MODE)
    if NORM_IN:
        rstd = tl.rsqrt(ss / K + eps)[:, None]
        result = result * rstd
    if GATED:
        up = _tile_result(acc_u, MODE)
        if NORM_IN:
            up = up * rstd
        result = _silu_mul(result, up, out_ptr.dtype.element_ty, HW)
    tile_mask = m_mask[:, None] & n_mask[None, :]
    if SPLIT_K > 1:
        split = (partial_ptr, arrivals_ptr, tile, offs_m, offs_n, tile_mask, M, N)
        if _split_arrive(result, *split, SPLIT_K):
            total = _split_sum(result, *split, SPLIT_K)
            _store_tile(total, bias_ptr, out_ptr, offs_m, offs_n, n_mask, tile_mask,
                        stride_om, HAS_BIAS)  # fmt: skip
            tl.atomic_xchg(arrivals_ptr + tile, 0)
            if ADD_NORM:
                _add_norm_last(out_ptr, residual_ptr, norm_w_ptr, normed_ptr, residual_out_ptr,
                               arrivals_ptr + tl.num_programs(0), M, N, stride_om, stride_rm,
                               eps, NORM_BLOCK, HW)  # fmt: skip
    else:
        _store_tile(result, bias_ptr, out_ptr, offs_m, offs_n, n_mask, tile_mask, stride_om,
                    HAS_BIAS)  # fmt: skip
        if ADD_NORM:
            _add_norm_last(out_ptr, residual_ptr, norm_w_ptr, normed_ptr, residual_out_ptr,
                           arrivals_ptr + tl.num_programs(0), M, N, stride_om, stride_rm, eps,
                           NORM_BLOCK, HW)  # fmt: skip


@triton.jit
def _fold_norm_step(x, r_ptrs, h_ptrs, norm_w_ptrs, offs_k, m_mask, k_mask, tile, ss,
                    MODE: tl.constexpr, DOT_F32: tl.constexpr, HW: tl.constexpr):  # fmt: skip
    """NORM_IN's K step: h = x + residual rounded to x's dtype as the unfused add rounds it
    (program `tile` 0 stores it, the next residual), ss + each row's h^2, and the GEMM's
    operand h * norm_w (float32 for the fma body and under DOT_F32, x's dtype for the tensor
    cores). RMSNorm is a per-row scale, so it factors out of the GEMM:
    (rmsnorm(h) * w) @ W^T = rsqrt(mean(h^2) + eps) * ((h * w) @ W^T), applied at the end."""
    dtype = x.dtype
    mask = m_mask[:, None] & k_mask
    r = tl.load(r_ptrs, mask=mask, other=0.0, eviction_policy="evict_last")
    h = _round_to(x.to(tl.float32) + r.to(tl.float32), dtype, HW)
    lane = (offs_k[None, :] * 0 + m_mask[:, None].to(tl.int32) * 0) + tile
    tl.store(h_ptrs, h.to(dtype), mask=mask & (lane == 0))
    wn = tl.load(
        norm_w_ptrs + offs_k[None, :], mask=k_mask, other=0.0, eviction_policy="evict_last"
    )
    a = h * wn.to(tl.float32)
    if MODE != 2 and not DOT_F32:
        a = a.to(dtype)
    return a, ss + tl.sum(h * h, axis=1)


@triton.jit
def _accumulate(acc, x, w, MODE: tl.constexpr, DOT_F32: tl.constexpr):
    """acc plus this K step's products of x [BLOCK_M, BLOCK_K] and w [BLOCK_N, BLOCK_K], in the
    body's accumulator layout (see the module)."""
    if DOT_F32:
        w = w.to(tl.float32)
    if MODE == 0:
        acc += _dot(x, tl.trans(w), DOT_F32)
    elif MODE == 1:
        acc += _dot(w, tl.trans(x), DOT_F32)
    else:
        acc += x.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :]
    return acc


@triton.jit
def _tile_result(acc, MODE: tl.constexpr):
    """The float32 [BLOCK_M, BLOCK_N] tile of a body's accumulator."""
    if MODE == 0:
        return acc
    elif MODE == 1:
        return tl.trans(acc)
    else:
        return tl.sum(acc, axis=2)


@triton.jit
def _silu_mul(gate, up, DTYPE: tl.constexpr, HW: tl.constexpr):
    """The gated epilogue: silu(gate) * up of float32 GEMM tiles, each first rounded to DTYPE
    as the unfused GEMM stores it, then kernels/triton_fused.py's SiLU-and-mul roundings."""
    return _silu_mul_values(_round_to(gate, DTYPE, HW), _round_to(up, DTYPE, HW), DTYPE, HW)


@triton.jit
def _add_norm_last(out_ptr, residual_ptr, norm_w_ptr, normed_ptr, residual_out_ptr, counter_ptr,
                   M, N, stride_om, stride_rm, eps, NORM_BLOCK: tl.constexpr, HW: tl.constexpr):  # fmt: skip
    """The ADD_NORM epilogue, after a program stored its output tile: it counts itself in on
    `counter_ptr`, and the last of the column tiles to arrive computes, for every row m,
    residual_out = out + residual and normed = norm_w * rmsnorm(residual_out) with the roundings
    of kernels/triton_fused.py's add + RMSNorm, reading the other tiles' outputs past L1 (.cg),
    then resets the counter for the next launch (the split-K semaphores' protocol)."""
    tl.debug_barrier()
    count = tl.atomic_add(counter_ptr, 1, sem="acq_rel")
    if count == tl.num_programs(0) - 1:
        dtype = out_ptr.dtype.element_ty
        offsets = tl.arange(0, NORM_BLOCK)
        for m in range(M):
            # Row offsets in int32: M <= SKINNY_MAX_M rows of at most a vocabulary's width.
            out_row = out_ptr + m * stride_om
            res_row = residual_ptr + m * stride_rm
            res_out_row = residual_out_ptr + m * N
            squares = tl.zeros([NORM_BLOCK], dtype=tl.float32)
            for chunk in range(0, N, NORM_BLOCK):
                cols = chunk + offsets
                mask = cols < N
                y = tl.load(out_row + cols, mask=mask, other=0.0, cache_modifier=".cg")
                r = tl.load(res_row + cols, mask=mask, other=0.0)
                s = _round_to(y.to(tl.float32) + r.to(tl.float32), dtype, HW)
                tl.store(res_out_row + cols, s.to(dtype), mask=mask)
                squares += s * s
            variance = tl.math.div_rn(tl.sum(squares, axis=0), N * 1.0)
            rstd = tl.math.rsqrt(variance + eps)
            for chunk in range(0, N, NORM_BLOCK):
                cols = chunk + offsets
                mask = cols < N
                s = tl.load(res_out_row + cols, mask=mask, other=0.0).to(tl.float32)
                normed = _round_to(s * rstd, dtype, HW)
                w = tl.load(norm_w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
                y = _round_to(w * normed, normed_ptr.dtype.element_ty, HW)
                tl.store(normed_ptr + m * N + cols, y.to(normed_ptr.dtype.element_ty), mask=mask)
        tl.atomic_xchg(counter_ptr, 0)


@triton.jit
def _split_arrive(result, partial_ptr, arrivals_ptr, tile, offs_m, offs_n, tile_mask, M, N,
                  SPLIT_K: tl.constexpr):  # fmt: skip
    """The split-K epilogue shared by the skinny kernels (here and in triton_gemv_fp8.py), for
    program (tile, s) of a launch over (column tiles, SPLIT_K): stores this slice's float32
    [BLOCK_M, BLOCK_N] tile `result` into partial [SPLIT_K, M, N], counts itself in on the tile's
    semaphore and returns whether it arrived last (then `_split_sum` gives the tile's total).

    The barrier orders every thread's partial stores before the one thread's atomic, whose
    release (acq_rel) publishes them; its acquire in the last program makes the other slices'
    visible there (`_split_sum` reads past L1: .cg)."""
    tile_offsets = offs_m[:, None].to(tl.int64) * N + offs_n[None, :]
    tl.store(partial_ptr + tl.program_id(1) * M.to(tl.int64) * N + tile_offsets, result,
             mask=tile_mask)  # fmt: skip
    tl.debug_barrier()
    return tl.atomic_add(arrivals_ptr + tile, 1, sem="acq_rel") == SPLIT_K - 1


@triton.jit
def _split_sum(result, partial_ptr, arrivals_ptr, tile, offs_m, offs_n, tile_mask, M, N,
               SPLIT_K: tl.constexpr):  # fmt: skip
    """In the program `_split_arrive` found last: the sum of every slice's partial tile in slice
    order (deterministic whichever program is last), in a tile shaped as `result` (whose values
    are in the partials by now). The caller stores it from inside its `if` on the arrival (one
    tile live), then resets the tile's semaphore for the next launch: an atomic between these
    loads and that store holds the whole sum in registers (at 64 x 128 it spills)."""
    tile_offsets = offs_m[:, None].to(tl.int64) * N + offs_n[None, :]
    slice_size = M.to(tl.int64) * N
    total = tl.zeros(result.shape, dtype=tl.float32)
    for s in tl.static_range(SPLIT_K):
        part = partial_ptr + s * slice_size + tile_offsets
        total += tl.load(part, mask=tile_mask, other=0.0, cache_modifier=".cg")
    return total


@triton.jit
def _store_tile(result, bias_ptr, out_ptr, offs_m, offs_n, n_mask, tile_mask, stride_om,
                HAS_BIAS: tl.constexpr):  # fmt: skip
    """The float32 tile (+ bias) stored in out's dtype."""
    if HAS_BIAS:
        result += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    out_ptrs = out_ptr + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :]
    tl.store(out_ptrs, result.to(out_ptr.dtype.element_ty), mask=tile_mask)


def split_workspace(out: torch.Tensor, tiles: int, split: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A split launch's (partials [split, M, N] float32, semaphores) for output `out` [M, N] over
    `tiles` column tiles; for an unsplit launch (split 1) both are `out`, never read."""
    if split == 1:
        return out, out
    m, n = out.shape
    partials = torch.empty((split, m, n), dtype=torch.float32, device=out.device)
    return partials, split_semaphores(out.device, tiles)


def _constexprs(
    m: int, dtype: torch.dtype, has_bias: bool, config: dict, device: torch.device
) -> dict:
    """The kernel's compile-time arguments and launch options for a resolved config (no
    epilogue; `_launch` sets GATED / ADD_NORM)."""
    mode = _MODE_IDS[config["mode"]]
    return {
        "HAS_BIAS": has_bias,
        "MODE": mode,
        "DOT_F32": dtype == torch.float32 or interpreting(),
        "BLOCK_M": skinny_launch.block_rows(config["mode"], m),
        "BLOCK_N": config["block_n"],
        "BLOCK_K": config["block_k"],
        "NUM_STAGES": config["num_stages"],
        "SPLIT_K": config["split_k"],
        "GATED": False,
        "ADD_NORM": False,
        "NORM_IN": False,
        "NORM_BLOCK": NORM_BLOCK,
        "HW": not interpreting(),
        "EARLY_RELEASE": EARLY_RELEASE_PER_SM > 0,  # (a launch: whether any program does)
        "num_warps": config["num_warps"],
        "num_stages": config["num_stages"],
    } | launch_options(device)


NORM_BLOCK = 1024
"""Columns per chunk of the ADD_NORM epilogue's row walk."""

EARLY_RELEASE_PER_SM = 2
"""Programs per SM, counted from the end of a launch, that signal the next kernel right after
their wait (`pdl.pdl_release_early`; 0: every program after its loop), as the FP8 decode GEMV's
last two do (triton_gemv_fp8_decode.EARLY_RELEASE_PER_SM). Measured on an H100 (RESULTS.md,
"The bf16 skinny GEMM's last waves signal early"): bf16 batch 1 5.424 / 5.434 -> 5.416 / 5.418
ms a step, batch 64 at 1k 9.045 -> 9.036."""


def _launch(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    out: torch.Tensor,
    config: dict,
    gated: bool = False,
    norm: tuple | None = None,
    norm_in: tuple | None = None,
) -> None:
    """One launch of the kernel over out's N columns; `norm` = (residual, norm_weight, eps,
    normed, residual_out) turns the ADD_NORM epilogue on; `norm_in` = (residual, norm_weight,
    eps, residual_out) folds the add + RMSNorm before the GEMM in (x is the add's input)."""
    m, k = x.shape
    n = out.shape[1]
    tiles, split = triton.cdiv(n, config["block_n"]), config["split_k"]
    partials, arrivals = split_workspace(out, tiles, split)
    residual = norm_w = normed = residual_out = out  # unused without the epilogue
    eps, stride_rm = 0.0, 0
    if norm is not None:
        residual, norm_w, eps, normed, residual_out = norm
        stride_rm = residual.stride(0)
        arrivals = split_semaphores(x.device, tiles + 1)  # tile counters, then the row counter
    if norm_in is not None:
        assert split == 1, "the folded norm needs each program's whole K"
        residual, norm_w, eps, residual_out = norm_in
        stride_rm = residual.stride(0)
    early_from = pdl.early_release_from(tiles * split, x.device, EARLY_RELEASE_PER_SM)
    _skinny_gemm_kernel[(tiles, split)](
        x,
        weight,
        bias if bias is not None else weight,
        out,
        partials,
        arrivals,
        residual,
        norm_w,
        normed,
        residual_out,
        m,
        n,
        k,
        skinny_launch.k_per_split(k, config),
        x.stride(0),
        weight.stride(0),
        out.stride(0),
        stride_rm,
        eps,
        early_from,
        **_constexprs(m, x.dtype, bias is not None, config, x.device)
        | {"GATED": gated, "ADD_NORM": norm is not None, "NORM_IN": norm_in is not None}
        | {"EARLY_RELEASE": early_from < tiles * split},
    )


def skinny_gemm(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    **launch: int | str,
) -> torch.Tensor:
    """out [M, N] = x [M, K] @ weight[N, K]^T (+ bias [N]) in x's dtype, float32 accumulation.

    x's last dim and weight must be contiguous (x's rows may be strided); any M works but the
    kernel is meant for M <= SKINNY_MAX_M. `launch` overrides keys of `launch_config` (mode,
    block_n, block_k, num_warps, num_stages, split_k) for tuning.
    """
    m, k = x.shape
    n = weight.shape[0]
    assert weight.shape[1] == k and x.stride(1) == 1 and weight.stride(1) == 1
    config = skinny_launch.resolve_launch(m, n, k, launch)
    if out is None:
        out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    _launch(x, weight, bias, out, config)
    return out


def precompile(dtype: torch.dtype, m: int, n: int, k: int, **launch: int | str) -> None:
    """Compile (into Triton's cache) the kernel skinny_gemm would launch for contiguous,
    16-byte aligned operands of this shape, without launching it: lets a tuning sweep compile
    its configurations in parallel processes."""
    config = skinny_launch.resolve_launch(m, n, k, launch)
    split = config["split_k"] > 1
    _skinny_gemm_kernel.warmup(
        dtype,
        dtype,
        dtype,
        dtype,
        torch.float32 if split else dtype,
        torch.int32 if split else dtype,
        dtype,
        dtype,
        dtype,
        dtype,
        m,
        n,
        k,
        skinny_launch.k_per_split(k, config),
        k,
        k,
        n,
        0,
        0.0,
        1,
        grid=(1,),
        **_constexprs(m, dtype, False, config, torch.device("cuda")),
    )


def skinny_operands(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """The layout every skinny kernel (bf16 here, FP8 in triton_gemv_fp8.py) needs: 2-D x of
    1..SKINNY_MAX_M rows with K contiguous, a contiguous 2-D weight of the same K, and rows that
    start 16-byte aligned (vector loads). Dtypes are the caller's to check."""
    if x.dim() != 2 or weight.dim() != 2 or not 1 <= x.shape[0] <= skinny_launch.SKINNY_MAX_M:
        return False
    k = x.shape[1]
    if weight.shape[1] != k or not weight.is_contiguous() or x.stride(1) != 1:
        return False
    align = _ALIGN_BYTES // x.element_size()
    if k % align or (x.shape[0] > 1 and x.stride(0) % align):
        return False
    return x.data_ptr() % _ALIGN_BYTES == 0 and weight.data_ptr() % _ALIGN_BYTES == 0
