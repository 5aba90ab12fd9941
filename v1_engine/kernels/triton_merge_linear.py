"""Decode attention's split-KV merge and the FP8 o_proj after it in one launch: a candidate for
batch-1 decode of FP8 models, where the chain it replaces is three short kernels (the merge, the
per-token quant of the attention output, the o_proj GEMM) whose fixed costs weigh more than
their bytes. Not wired into the engine: `benchmarks/benchmark_merge_linear.py` times it against
both chains first.

For tokens t, heads h of D values, pieces s (the partials of kernels/triton_split_kv.py:
[T, H, S, HEAD_PAD] normalised outputs, [T, H, S] running max and sum, log2 domain):

    a[t, h*D:(h+1)*D] = sum_s w_s * o_s / sum_s w_s,  w_s = l_s * 2^(m_s - max m)   (the merge)
    a rounded to the output dtype                          (as the attention output is stored)
    y[t, n] = scale_b[n] * sum_k b[n, k] * a[t, k]         (b e4m3 [N, H*D], a not quantized)

y is what the chain merge -> `fp8_weight_only_gemm` (the o_proj of fp8_dynamic_linear) computes,
up to the order of the float32 sum over K.

Program (c, h, t) merges head h's pieces for token t (every chunk's program of a head merges
the same pieces: they are small and read from L2), multiplies those D activations by rows
[c * CHUNK, +CHUNK) of b's head-h columns, and stores the float32 partial at partial[t, h]. It
then counts itself in on (t, c)'s semaphore (kernels/semaphores.py); the last of the H heads to
arrive sums the chunk's H partials in head order, so the result does not depend on which
arrived last, scales, rounds and stores y, and zeroes the semaphore.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from v1_engine.kernels import interpreting
from v1_engine.kernels.pdl import launch_options, pdl_release, pdl_wait
from v1_engine.kernels.semaphores import split_semaphores
from v1_engine.kernels.triton_fused_quant import _round_to
from v1_engine.kernels.triton_gemv_fp8 import FP8_DTYPE, _to_f32
from v1_engine.kernels.triton_split_kv import merge_head

DEFAULT_LAUNCH: dict[str, int] = {"chunk": 512, "block_n": 64, "stages": 3, "num_warps": 4}
"""Output rows per program (`chunk`: 8 chunks x 32 heads = 256 programs for Llama-3-8B's
o_proj), rows per step of a program's walk over them (`block_n`: a [block_n, D] weight tile),
weight tiles in flight (`stages`: Triton's software pipeline), warps. Not yet swept."""

LAUNCH_KEYS = tuple(DEFAULT_LAUNCH)


@triton.jit(do_not_specialize=["num_splits"])
def _merge_linear_kernel(
    y_ptr,
    part_out_ptr,
    part_max_ptr,
    part_sum_ptr,
    b_ptr,
    scale_b_ptr,
    partial_ptr,
    semaphore_ptr,
    num_splits,
    N,
    stride_yt,
    stride_b,
    NUM_HEADS: tl.constexpr,
    HEAD_SIZE: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
    CHUNK: tl.constexpr,
    BLOCK_N: tl.constexpr,
    STAGES: tl.constexpr,
    SCALE_PER_ROW: tl.constexpr,
    DOT_F32: tl.constexpr,
    HW: tl.constexpr,
    PDL: tl.constexpr,
):
    chunk = tl.program_id(0)
    head = tl.program_id(1)
    token = tl.program_id(2).to(tl.int64)
    out_dtype = y_ptr.dtype.element_ty
    pdl_wait(PDL)

    # The merge of head `head`'s pieces, as the merge kernel does it.
    merged = merge_head(part_out_ptr, part_max_ptr, part_sum_ptr, token, head, num_splits,
                        NUM_HEADS, HEAD_PAD, SPLITS_PAD)  # fmt: skip
    dims = tl.arange(0, HEAD_PAD)
    dim_valid = dims < HEAD_SIZE
    a = tl.where(dim_valid, _round_to(merged, out_dtype, HW), 0.0)

    # This head's share of rows [chunk * CHUNK, +CHUNK) of y, in float32.
    k_cols = head * HEAD_SIZE + dims
    partial_row = partial_ptr + (token * NUM_HEADS + head) * N
    for n0 in tl.range(0, CHUNK, BLOCK_N, num_stages=STAGES):
        rows = chunk * CHUNK + n0 + tl.arange(0, BLOCK_N)
        row_valid = rows < N
        w = tl.load(
            b_ptr + rows[:, None].to(tl.int64) * stride_b + k_cols[None, :],
            mask=row_valid[:, None] & dim_valid[None, :],
            other=0.0,
            eviction_policy="evict_first",
        )
        tl.store(partial_row + rows, tl.sum(_to_f32(w, DOT_F32) * a[None, :], 1), mask=row_valid)
    pdl_release(PDL)

    # The barrier orders every thread's stores before the one thread's atomic, whose release
    # publishes them; its acquire in the last head to arrive makes the others' visible there.
    tl.debug_barrier()
    semaphore = semaphore_ptr + token * tl.num_programs(0) + chunk
    if tl.atomic_add(semaphore, 1, sem="acq_rel") == NUM_HEADS - 1:
        out_rows = chunk * CHUNK + tl.arange(0, CHUNK)
        out_valid = out_rows < N
        acc = tl.zeros([CHUNK], dtype=tl.float32)
        for h in range(NUM_HEADS):
            acc += tl.load(
                partial_ptr + (token * NUM_HEADS + h) * N + out_rows,
                mask=out_valid,
                other=0.0,
                cache_modifier=".cg",
            )
        if SCALE_PER_ROW:
            scale = tl.load(scale_b_ptr + out_rows, mask=out_valid, other=0.0)
        else:
            scale = tl.load(scale_b_ptr)
        out = (acc * scale).to(out_dtype)
        tl.store(y_ptr + token * stride_yt + out_rows, out, mask=out_valid)
        tl.atomic_xchg(semaphore, 0)  # zero again for the next launch


def resolve_launch(launch: dict[str, int] | None = None) -> dict[str, int]:
    """DEFAULT_LAUNCH with `launch`'s keys over it; a ValueError names a key that is unknown
    or out of range."""
    config = dict(DEFAULT_LAUNCH)
    for key, value in (launch or {}).items():
        if key not in LAUNCH_KEYS:
            raise ValueError(f"unknown merge_linear launch key {key!r}; allowed: {LAUNCH_KEYS}")
        config[key] = int(value)
    for key in ("chunk", "block_n"):
        value = config[key]
        if value < 1 or value & (value - 1):
            raise ValueError(f"{key} must be a power of two, got {value}")
    if config["stages"] < 1:
        raise ValueError(f"stages must be >= 1, got {config['stages']}")
    if config["block_n"] > config["chunk"]:
        raise ValueError(f"block_n ({config['block_n']}) must not exceed chunk ({config['chunk']})")
    if config["num_warps"] not in (1, 2, 4, 8, 16):
        raise ValueError(f"num_warps must be one of 1, 2, 4, 8, 16, got {config['num_warps']}")
    return config


def _check(part_out, part_max, part_sum, head_size, b, scale_b, out_dtype) -> None:
    if part_out.dim() != 4:
        raise ValueError(
            f"part_out must be [tokens, heads, splits, pad], got {tuple(part_out.shape)}"
        )
    tokens, heads, splits, head_pad = part_out.shape
    if part_max.shape != (tokens, heads, splits) or part_sum.shape != part_max.shape:
        raise ValueError(
            f"part_max / part_sum must be [tokens, heads, splits] = {(tokens, heads, splits)}, "
            f"got {tuple(part_max.shape)} / {tuple(part_sum.shape)}"
        )
    if not 1 <= head_size <= head_pad:
        raise ValueError(
            f"head_size must be in [1, {head_pad}] (the partials' pad), got {head_size}"
        )
    if b.dtype != FP8_DTYPE or b.dim() != 2 or b.shape[1] != heads * head_size:
        raise ValueError(
            f"b must be e4m3 [N, heads * head_size = {heads * head_size}], got {b.dtype} "
            f"{tuple(b.shape)}"
        )
    if scale_b.numel() not in (1, b.shape[0]):
        raise ValueError(f"scale_b must hold 1 or N = {b.shape[0]} values, got {scale_b.numel()}")
    if out_dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"out_dtype must be bfloat16 or float16, got {out_dtype}")


def merge_linear(
    part_out: torch.Tensor,
    part_max: torch.Tensor,
    part_sum: torch.Tensor,
    head_size: int,
    b: torch.Tensor,
    scale_b: torch.Tensor,
    out_dtype: torch.dtype,
    **launch: int,
) -> torch.Tensor:
    """y [T, N] in out_dtype (see the module): the partials of every piece (float32, contiguous,
    as paged attention stores them for its merge kernel, empty pieces with a zero sum), b e4m3
    [N, H * head_size] with rows contiguous, scale_b float32 of 1 or N values. `launch`
    overrides DEFAULT_LAUNCH's keys."""
    _check(part_out, part_max, part_sum, head_size, b, scale_b, out_dtype)
    assert part_out.is_contiguous() and part_max.is_contiguous() and part_sum.is_contiguous()
    assert b.stride(1) == 1
    config = resolve_launch(launch)
    tokens, heads, num_splits, head_pad = part_out.shape
    n = b.shape[0]
    y = torch.empty((tokens, n), dtype=out_dtype, device=b.device)
    if tokens == 0:
        return y
    chunk = min(config["chunk"], max(config["block_n"], triton.next_power_of_2(n)))
    chunks = triton.cdiv(n, chunk)
    partial = torch.empty((tokens, heads, n), dtype=torch.float32, device=b.device)
    semaphores = split_semaphores(b.device, tokens * chunks)
    _merge_linear_kernel[(chunks, heads, tokens)](
        y,
        part_out,
        part_max,
        part_sum,
        b,
        scale_b.reshape(-1).to(torch.float32),
        partial,
        semaphores,
        num_splits,
        n,
        y.stride(0),
        b.stride(0),
        NUM_HEADS=heads,
        HEAD_SIZE=head_size,
        HEAD_PAD=head_pad,
        SPLITS_PAD=max(2, triton.next_power_of_2(num_splits)),
        CHUNK=chunk,
        BLOCK_N=config["block_n"],
        STAGES=config["stages"],
        SCALE_PER_ROW=scale_b.numel() > 1,
        DOT_F32=interpreting(),
        HW=not interpreting(),
        num_warps=config["num_warps"],
        **launch_options(b.device),
    )
    return y


def merge_linear_reference(
    part_out: torch.Tensor,
    part_max: torch.Tensor,
    part_sum: torch.Tensor,
    head_size: int,
    b: torch.Tensor,
    scale_b: torch.Tensor,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """The module's formula in PyTorch: the merge in float32, the attention output rounded to
    out_dtype, the product in float64 (the exact value the kernel's float32 sums round)."""
    _check(part_out, part_max, part_sum, head_size, b, scale_b, out_dtype)
    a = merge_reference(part_out, part_max, part_sum, head_size, out_dtype).double()
    y = (a @ b.double().t()) * scale_b.reshape(-1).double()
    return y.to(out_dtype)


def merge_reference(
    part_out: torch.Tensor,
    part_max: torch.Tensor,
    part_sum: torch.Tensor,
    head_size: int,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """The merge in PyTorch, float32: the attention output [T, H * head_size] in out_dtype, as
    the merge kernel stores it on the GPU (whose cast rounds; the interpreter's truncates)."""
    m = part_max.float()
    weights = torch.exp2(m - m.amax(dim=2, keepdim=True)) * part_sum.float()
    total = weights.sum(dim=2, keepdim=True)
    parts = part_out[..., :head_size].float()
    merged = (parts * weights[..., None]).sum(dim=2) / torch.where(total > 0, total, 1.0)
    return merged.to(out_dtype).reshape(part_out.shape[0], -1)
