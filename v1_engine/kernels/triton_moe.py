"""Fused mixture-of-experts in Triton: align by expert, two grouped GEMMs, the top-k sum.

Each token picks top_k experts, giving T * top_k (token, expert) *pairs*, numbered
`pair = token * top_k + k`. Three launches compute Σ_k w_k · down_e(silu(gate_e(x)) · up_e(x)):

1. `moe_align` (one program): sorts the pairs by expert into `sorted_ids`, each expert's run
   padded to a multiple of BLOCK_M with the sentinel `num_pairs`, so every BLOCK_M-row block of
   the sorted order belongs to ONE expert (`expert_ids[block]`); `num_post_padded` is the sorted
   length. Counting is a one-hot sum per chunk of pairs, the offsets an exclusive cumsum over
   experts and a pair's rank inside its expert a cumsum down the chunk, so the order is stable
   and deterministic (no atomics).
2. the w13 GEMM: block b multiplies the rows of its pairs' tokens by expert_ids[b]'s gate and up
   weights (two accumulators over the same columns) and writes silu(gate) * up, in sorted
   order, into the intermediate [num_post_padded_max, I]: SiLU-and-mul is fused in the epilogue.
3. the w2 GEMM: block b multiplies its intermediate rows by the expert's down weights, scales
   each row by its pair's router weight and writes it at the pair's row of [T * top_k, H]; the
   top-k sum is then one reduction over k (torch, float32 accumulation).

Block FP8 (DeepSeek-V3 checkpoints): weights e4m3 with one float32 scale per 128x128 block,
activations quantized per 1x128 group just before each GEMM (per_token_group_fp8_quant); the
GEMMs step K by 128, so each step multiplies e4m3 tiles on the tensor cores and applies one
activation scale per row and one weight scale per column.

Nothing is read on the host: the grid is sized by the worst case of the sorted length
(T * top_k + min(E, T * top_k) * (BLOCK_M - 1)) and blocks past `num_post_padded` return at
once, so a launch can be captured in a CUDA graph.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from v1_engine.kernels import interpreting
from v1_engine.kernels.fp8 import BLOCK_SIZE as FP8_BLOCK
from v1_engine.kernels.fp8 import FP8_DTYPE
from v1_engine.kernels.pdl import launch_options, pdl_enter, pdl_release, pdl_wait

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


# ---- align ---------------------------------------------------------------------------------


@triton.jit
def _moe_align_kernel(
    topk_ids_ptr,
    sorted_ids_ptr,
    expert_ids_ptr,
    num_post_padded_ptr,
    num_pairs,
    num_experts,
    max_blocks,
    BLOCK_M: tl.constexpr,
    E_PAD: tl.constexpr,
    CHUNK: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_enter(PDL)
    experts = tl.arange(0, E_PAD)
    offs = tl.arange(0, CHUNK)
    counts = tl.zeros([E_PAD], dtype=tl.int32)
    for start in range(0, num_pairs, CHUNK):
        idx = start + offs
        ids = tl.load(topk_ids_ptr + idx, mask=idx < num_pairs, other=-1).to(tl.int32)
        counts += tl.sum((ids[:, None] == experts[None, :]).to(tl.int32), 0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, 0)
    starts = ends - padded
    total = tl.sum(padded, 0)
    tl.store(num_post_padded_ptr, total)

    # The expert owning block b is the number of experts whose padded run ends at or before its
    # first row; blocks at or past the sorted length get -1.
    for b0 in range(0, max_blocks, CHUNK):
        blocks = b0 + offs
        expert = tl.sum((ends[None, :] <= (blocks * BLOCK_M)[:, None]).to(tl.int32), 1)
        expert = tl.where(expert < num_experts, expert, -1)
        tl.store(expert_ids_ptr + blocks, expert, mask=blocks < max_blocks)

    # Padding rows of each run get the sentinel (the pairs fill the rest below).
    filled_ends = starts + counts
    for p0 in range(0, total, CHUNK):
        pos = p0 + offs
        owner = tl.sum((ends[None, :] <= pos[:, None]).to(tl.int32), 1)
        owned = owner[:, None] == experts[None, :]
        filled_end = tl.sum(tl.where(owned, filled_ends[None, :], 0), 1)
        tl.store(sorted_ids_ptr + pos, num_pairs, mask=(pos < total) & (pos >= filled_end))

    seen = tl.zeros([E_PAD], dtype=tl.int32)
    for start in range(0, num_pairs, CHUNK):
        idx = start + offs
        valid = idx < num_pairs
        ids = tl.load(topk_ids_ptr + idx, mask=valid, other=-1).to(tl.int32)
        onehot = (ids[:, None] == experts[None, :]).to(tl.int32)
        rank = tl.sum((tl.cumsum(onehot, 0) - onehot) * onehot, 1)
        base = tl.sum(onehot * (starts + seen)[None, :], 1)
        tl.store(sorted_ids_ptr + base + rank, idx, mask=valid)
        seen += tl.sum(onehot, 0)


@dataclass(frozen=True)
class AlignedPairs:
    """The pairs sorted by expert in BLOCK_M-row blocks of one expert each (device tensors)."""

    sorted_ids: torch.Tensor
    """int32 [max_padded]: pair index per sorted row; `num_pairs` marks padding."""
    expert_ids: torch.Tensor
    """int32 [max_blocks]: the expert of each block, -1 past num_post_padded."""
    num_post_padded: torch.Tensor
    """int32 [1]: rows of sorted_ids in use (a multiple of block_m)."""
    block_m: int

    @property
    def max_blocks(self) -> int:
        return self.expert_ids.shape[0]


def max_padded_rows(num_pairs: int, num_experts: int, block_m: int) -> int:
    """Worst-case sorted length: every expert that gets a pair pads at most block_m - 1 rows."""
    padded = num_pairs + min(num_experts, num_pairs) * (block_m - 1)
    return triton.cdiv(padded, block_m) * block_m


def moe_align(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> AlignedPairs:
    """Sort topk_ids [T, top_k]'s pairs by expert into blocks of block_m rows (see module doc)."""
    if topk_ids.dim() != 2:
        raise ValueError(f"topk_ids must be [num_tokens, top_k], got {tuple(topk_ids.shape)}")
    if block_m < 1 or block_m & (block_m - 1):
        raise ValueError(f"block_m must be a power of two, got {block_m}")
    num_pairs = topk_ids.numel()
    max_rows = max_padded_rows(num_pairs, num_experts, block_m)
    device = topk_ids.device
    sorted_ids = torch.empty(max_rows, dtype=torch.int32, device=device)
    expert_ids = torch.empty(max_rows // block_m, dtype=torch.int32, device=device)
    num_post_padded = torch.empty(1, dtype=torch.int32, device=device)
    e_pad = max(16, triton.next_power_of_2(num_experts))
    chunk = min(128, max(16, 8192 // e_pad))
    _moe_align_kernel[(1,)](
        topk_ids.contiguous(),
        sorted_ids,
        expert_ids,
        num_post_padded,
        num_pairs,
        num_experts,
        expert_ids.shape[0],
        BLOCK_M=block_m,
        E_PAD=e_pad,
        CHUNK=chunk,
        num_warps=8,
        **launch_options(device),
    )
    return AlignedPairs(sorted_ids, expert_ids, num_post_padded, block_m)


# ---- grouped GEMM --------------------------------------------------------------------------


@triton.jit
def _dot(a, b, IEEE: tl.constexpr):
    """a @ b with float32 accumulation; IEEE for float32 operands (tests, the interpreter)."""
    if IEEE:
        return tl.dot(a, b, input_precision="ieee")
    return tl.dot(a, b)


@triton.jit
def _moe_gemm_kernel(
    a_ptr,
    a_scale_ptr,
    b_ptr,
    b_scale_ptr,
    c_ptr,
    topk_weights_ptr,
    sorted_ids_ptr,
    expert_ids_ptr,
    num_post_padded_ptr,
    N,
    K,
    num_pairs,
    stride_am,
    stride_asm,
    stride_be,
    stride_bn,
    stride_bse,
    stride_bsn,
    stride_cm,
    TOP_K: tl.constexpr,
    GATED: tl.constexpr,
    FP8: tl.constexpr,
    DOT_F32: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PDL: tl.constexpr,
):
    """C = A @ B[expert].T over one block of sorted rows and BLOCK_N output columns.

    GATED (the w13 GEMM): A rows are the pairs' tokens, B holds [gate; up] (2N rows) and C gets
    silu(gate) * up at the sorted rows. Otherwise (the w2 GEMM): A rows are the sorted rows and C
    gets (A @ B.T) * router weight at the pairs' rows. FP8: BLOCK_K is the 128-wide scale group,
    so each K step takes one activation scale per row and one weight scale per column.
    """
    pdl_wait(PDL)
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    if pid_m * BLOCK_M >= tl.load(num_post_padded_ptr):
        return
    expert = tl.load(expert_ids_ptr + pid_m).to(tl.int64)
    pos = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(sorted_ids_ptr + pos)
    row_valid = pair < num_pairs
    if GATED:
        a_row = (pair // TOP_K).to(tl.int64)
    else:
        a_row = pos.to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_valid = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    b_base = b_ptr + expert * stride_be
    gate_ptrs = b_base + offs_n.to(tl.int64)[None, :] * stride_bn + offs_k[:, None]
    up_ptrs = gate_ptrs + N * stride_bn
    a_ptrs = a_ptr + a_row[:, None] * stride_am + offs_k[None, :]
    if FP8:
        a_scale_ptrs = a_scale_ptr + a_row * stride_asm
        gate_scale_ptrs = b_scale_ptr + expert * stride_bse + (offs_n // BLOCK_K) * stride_bsn
        up_scale_ptrs = b_scale_ptr + expert * stride_bse + ((offs_n + N) // BLOCK_K) * stride_bsn

    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k_step in range(tl.cdiv(K, BLOCK_K)):
        k_valid = offs_k < K - k_step * BLOCK_K
        a = tl.load(a_ptrs, mask=row_valid[:, None] & k_valid[None, :], other=0.0)
        b_mask = k_valid[:, None] & n_valid[None, :]
        gate = tl.load(gate_ptrs, mask=b_mask, other=0.0)
        if DOT_F32:
            a = a.to(tl.float32)
            gate = gate.to(tl.float32)
        if FP8:
            a_scale = tl.load(a_scale_ptrs + k_step, mask=row_valid, other=0.0)
            gate_scale = tl.load(gate_scale_ptrs + k_step, mask=n_valid, other=0.0)
            acc += _dot(a, gate, DOT_F32) * a_scale[:, None] * gate_scale[None, :]
        else:
            acc += _dot(a, gate, DOT_F32)
        if GATED:
            up = tl.load(up_ptrs, mask=b_mask, other=0.0)
            if DOT_F32:
                up = up.to(tl.float32)
            if FP8:
                up_scale = tl.load(up_scale_ptrs + k_step, mask=n_valid, other=0.0)
                acc_up += _dot(a, up, DOT_F32) * a_scale[:, None] * up_scale[None, :]
            else:
                acc_up += _dot(a, up, DOT_F32)
            up_ptrs += BLOCK_K
        a_ptrs += BLOCK_K
        gate_ptrs += BLOCK_K

    pdl_release(PDL)
    if GATED:
        result = acc / (1.0 + tl.exp(-acc)) * acc_up
        c_row = pos.to(tl.int64)
        c_mask = n_valid[None, :] & (pos[:, None] >= 0)
    else:
        weight = tl.load(topk_weights_ptr + pair, mask=row_valid, other=0.0)
        result = acc * weight[:, None]
        c_row = pair.to(tl.int64)
        c_mask = row_valid[:, None] & n_valid[None, :]
    tl.store(
        c_ptr + c_row[:, None] * stride_cm + offs_n[None, :],
        result.to(c_ptr.dtype.element_ty),
        mask=c_mask,
    )


@dataclass(frozen=True)
class GemmConfig:
    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


def gemm_config(num_pairs: int, num_experts: int, fp8: bool) -> GemmConfig:
    """Tiles by the average rows per expert: decode-sized batches stream weights (small M, many
    programs across N); prefill-sized ones reuse each weight tile over many rows."""
    rows_per_expert = num_pairs / num_experts
    block_k = FP8_BLOCK if fp8 else 64
    if rows_per_expert <= 16:
        return GemmConfig(16, 64, FP8_BLOCK, 4, 4)
    if rows_per_expert <= 64:
        return GemmConfig(32, 64, block_k, 4, 4)
    return GemmConfig(64, 128, block_k, 8, 3)


def _launch_gemm(
    a: torch.Tensor,
    a_scale: torch.Tensor | None,
    b: torch.Tensor,
    b_scale: torch.Tensor | None,
    c: torch.Tensor,
    topk_weights: torch.Tensor,
    aligned: AlignedPairs,
    n: int,
    top_k: int,
    gated: bool,
    config: GemmConfig,
) -> None:
    fp8 = b.dtype == FP8_DTYPE
    assert not fp8 or a.dtype == FP8_DTYPE, "block-FP8 weights take quantized activations"
    dummy = aligned.num_post_padded
    # The interpreter multiplies 16-bit and fp8 blocks incorrectly: upcast there.
    dot_f32 = a.dtype == torch.float32 or interpreting()
    grid = (aligned.max_blocks, triton.cdiv(n, config.block_n))
    _moe_gemm_kernel[grid](
        a,
        a_scale if fp8 else dummy,
        b,
        b_scale if fp8 else dummy,
        c,
        topk_weights,
        aligned.sorted_ids,
        aligned.expert_ids,
        aligned.num_post_padded,
        n,
        b.shape[2],
        topk_weights.numel(),
        a.stride(0),
        a_scale.stride(0) if fp8 else 0,
        b.stride(0),
        b.stride(1),
        b_scale.stride(0) if fp8 else 0,
        b_scale.stride(1) if fp8 else 0,
        c.stride(0),
        TOP_K=top_k,
        GATED=gated,
        FP8=fp8,
        DOT_F32=dot_f32,
        BLOCK_M=aligned.block_m,
        BLOCK_N=config.block_n,
        BLOCK_K=FP8_BLOCK if fp8 else config.block_k,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
        **launch_options(c.device),
    )


def _quantize_groups(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    from v1_engine.kernels.fp8 import per_token_group_fp8_quant

    return per_token_group_fp8_quant(x, FP8_BLOCK)


def fused_moe_triton(
    hidden_states: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    w13_scale: torch.Tensor | None = None,
    w2_scale: torch.Tensor | None = None,
    config: GemmConfig | None = None,
) -> torch.Tensor:
    """Σ_k topk_weights[t, k] · down_e(silu(gate_e(x_t)) · up_e(x_t)), e = topk_ids[t, k].

    hidden_states [T, H] (bf16/fp16/fp32); w13 [E, 2I, H] (gate rows then up rows) and w2
    [E, H, I] in hidden_states' dtype, or float8_e4m3fn with w13_scale [E, ceil(2I/128),
    ceil(H/128)] and w2_scale [E, ceil(H/128), ceil(I/128)] (float32 per 128x128 block).
    Returns [T, H] in hidden_states' dtype.
    """
    _check_moe_args(hidden_states, w13, w2, topk_weights, topk_ids, w13_scale, w2_scale)
    num_tokens, hidden = hidden_states.shape
    num_experts, two_inter, _ = w13.shape
    inter = two_inter // 2
    top_k = topk_ids.shape[1]
    fp8 = w13.dtype == FP8_DTYPE
    if num_tokens == 0:
        return hidden_states.new_empty(0, hidden)
    if config is None:
        config = gemm_config(topk_ids.numel(), num_experts, fp8)
    aligned = moe_align(topk_ids, num_experts, config.block_m)
    weights = topk_weights.reshape(-1).float().contiguous()
    intermediate = hidden_states.new_empty(aligned.sorted_ids.shape[0], inter)
    a, a_scale = hidden_states.contiguous(), None
    if fp8:
        a, a_scale = _quantize_groups(a)
    _launch_gemm(
        a, a_scale, w13, w13_scale, intermediate, weights, aligned, inter, top_k, True, config
    )
    a, a_scale = intermediate, None
    if fp8:
        a, a_scale = _quantize_groups(intermediate)
    pair_out = hidden_states.new_empty(num_tokens * top_k, hidden)
    _launch_gemm(a, a_scale, w2, w2_scale, pair_out, weights, aligned, hidden, top_k, False, config)
    return pair_out.view(num_tokens, top_k, hidden).sum(dim=1)


def _check_moe_args(
    hidden_states: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    w13_scale: torch.Tensor | None,
    w2_scale: torch.Tensor | None,
) -> None:
    """Raises ValueError naming the argument whose shape, dtype or layout does not fit."""
    if hidden_states.dim() != 2 or hidden_states.dtype not in SUPPORTED_DTYPES:
        raise ValueError(
            f"hidden_states must be [T, H] of {SUPPORTED_DTYPES}, got "
            f"{tuple(hidden_states.shape)} {hidden_states.dtype}"
        )
    hidden = hidden_states.shape[1]
    if w13.dim() != 3 or w13.shape[1] % 2 or w13.shape[2] != hidden:
        raise ValueError(f"w13 must be [E, 2I, {hidden}], got {tuple(w13.shape)}")
    num_experts, inter = w13.shape[0], w13.shape[1] // 2
    if tuple(w2.shape) != (num_experts, hidden, inter):
        raise ValueError(f"w2 must be [{num_experts}, {hidden}, {inter}], got {tuple(w2.shape)}")
    for name, w in (("w13", w13), ("w2", w2)):
        if w.dtype not in (hidden_states.dtype, FP8_DTYPE) or w.stride(2) != 1:
            raise ValueError(
                f"{name} must be {hidden_states.dtype} or {FP8_DTYPE} with a unit last stride, "
                f"got {w.dtype}"
            )
    if w13.dtype != w2.dtype:
        raise ValueError(f"w13 and w2 dtypes must match, got {w13.dtype} and {w2.dtype}")
    if w13.dtype == FP8_DTYPE:
        for name, scale, w in (("w13_scale", w13_scale, w13), ("w2_scale", w2_scale, w2)):
            blocks = (w.shape[0], -(-w.shape[1] // FP8_BLOCK), -(-w.shape[2] // FP8_BLOCK))
            if scale is None or tuple(scale.shape) != blocks or scale.dtype != torch.float32:
                raise ValueError(
                    f"{name} must be float32 {blocks} for block-FP8 experts, got "
                    f"{None if scale is None else (tuple(scale.shape), scale.dtype)}"
                )
            if scale.stride(2) != 1:
                raise ValueError(f"{name} must have a unit last stride")
    if topk_ids.dim() != 2 or topk_ids.shape[0] != hidden_states.shape[0]:
        raise ValueError(
            f"topk_ids must be [{hidden_states.shape[0]}, top_k], got {tuple(topk_ids.shape)}"
        )
    if topk_weights.shape != topk_ids.shape:
        raise ValueError(
            f"topk_weights must have topk_ids' shape {tuple(topk_ids.shape)}, got "
            f"{tuple(topk_weights.shape)}"
        )
    for name, tensor in (
        ("w13", w13),
        ("w2", w2),
        ("topk_ids", topk_ids),
        ("topk_weights", topk_weights),
    ):
        if tensor.device != hidden_states.device:
            raise ValueError(
                f"{name} is on {tensor.device}, hidden_states on {hidden_states.device}"
            )
