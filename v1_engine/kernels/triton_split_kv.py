"""Split-KV (flash-decoding) pieces of the paged attention kernel (kernels/triton_attention.py):
which key tiles a piece owns, how it stores its partial result, and the two ways the partials are
merged, by the last piece to arrive inside the attention launch (`merge_pieces_in_program`) or
by a second kernel (`merge_pieces`). A partial is the piece's output normalised by its own
softmax sum, with its running max and sum: [tokens, heads, num_splits, HEAD_PAD] and [tokens,
heads, num_splits] float32. `split_tile_range` is shared with the MLA decode kernel.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from v1_engine.kernels.pdl import launch_options, pdl_enter

MERGE_CHUNK = tl.constexpr(4)
"""Split pieces the merging program loads per trip (see `merge_pieces_in_program`)."""


@triton.jit
def split_tile_range(num_tiles, split, num_splits, USE_SPLITS: tl.constexpr):
    """The key tiles [lo, hi) split `split` of `num_splits` owns (whole tiles, the last splits
    possibly empty); all of them without splits. Shared with the MLA decode kernel."""
    if USE_SPLITS:
        per_split = tl.cdiv(num_tiles, num_splits)
        lo = split * per_split
        hi = tl.minimum(lo + per_split, num_tiles)
    else:
        lo = 0
        hi = num_tiles
    return lo, hi


@triton.jit
def store_partial(part_out_ptr, part_max_ptr, part_sum_ptr, stat_off, m_i, l_i, result,
                  row_valid, dims, HEAD_PAD: tl.constexpr):  # fmt: skip
    """A piece's rows: normalised output, running max and sum at `stat_off` of the partials."""
    tl.store(part_max_ptr + stat_off, m_i, mask=row_valid)
    tl.store(part_sum_ptr + stat_off, l_i, mask=row_valid)
    tl.store(
        part_out_ptr + stat_off[:, None] * HEAD_PAD + dims[None, :], result, mask=row_valid[:, None]
    )


@triton.jit
def active_splits(num_tiles, num_splits):
    """How many pieces of `split_tile_range` own a tile."""
    return tl.cdiv(num_tiles, tl.cdiv(num_tiles, num_splits))


@triton.jit
def merge_pieces_in_program(part_out_ptr, part_max_ptr, part_sum_ptr, stat_base, row_valid,
                            dims, active, HEAD_PAD: tl.constexpr,
                            BLOCK_M: tl.constexpr):  # fmt: skip
    """sum_s w_s * o_s / sum_s w_s over the `active` splits of each row, w_s = l_s * 2^(m_s -
    max m), in split order (the same result whichever split arrived last). MERGE_CHUNK pieces
    are loaded per trip, independent loads in flight together; more would hold as many
    [BLOCK_M, HEAD_PAD] float32 tiles in registers at once."""
    m_run = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
    l_run = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_PAD], dtype=tl.float32)
    for s0 in range(0, active, MERGE_CHUNK):
        for i in tl.static_range(MERGE_CHUNK):
            ok = row_valid & (tl.full([BLOCK_M], s0 + i, tl.int32) < active)
            off = stat_base + s0 + i
            m = tl.load(part_max_ptr + off, mask=ok, other=-1.0e30, cache_modifier=".cg")
            l_s = tl.load(part_sum_ptr + off, mask=ok, other=0.0, cache_modifier=".cg")
            o = tl.load(part_out_ptr + off[:, None] * HEAD_PAD + dims[None, :], mask=ok[:, None],
                        other=0.0, cache_modifier=".cg")  # fmt: skip
            m_new = tl.maximum(m_run, m)
            alpha = tl.exp2(m_run - m_new)
            weight = tl.exp2(m - m_new) * l_s
            acc = acc * alpha[:, None] + o * weight[:, None]
            l_run = l_run * alpha + weight
            m_run = m_new
    return acc / tl.where(l_run > 0.0, l_run, 1.0)[:, None]


@triton.jit
def merge_head(part_out_ptr, part_max_ptr, part_sum_ptr, token, head, num_splits,
               NUM_HEADS: tl.constexpr, HEAD_PAD: tl.constexpr,
               SPLITS_PAD: tl.constexpr):  # fmt: skip
    """The merged [HEAD_PAD] float32 output of (token, head) from all its pieces' partials,
    every piece loaded at once: sum_s w_s * o_s / sum_s w_s, w_s = l_s * 2^(m_s - max_s m_s).
    Shared with kernels/triton_merge_linear.py."""
    splits = tl.arange(0, SPLITS_PAD)
    split_valid = splits < num_splits
    stat_off = (token * NUM_HEADS + head) * num_splits + splits
    m = tl.load(part_max_ptr + stat_off, mask=split_valid, other=-1.0e30)
    l_sum = tl.load(part_sum_ptr + stat_off, mask=split_valid, other=0.0)
    weights = tl.exp2(m - tl.max(m, 0)) * l_sum
    total = tl.sum(weights, 0)
    dims = tl.arange(0, HEAD_PAD)
    parts = tl.load(
        part_out_ptr + stat_off[:, None] * HEAD_PAD + dims[None, :],
        mask=split_valid[:, None],
        other=0.0,
    )
    return tl.sum(parts * weights[:, None], 0) / tl.where(total > 0.0, total, 1.0)


@triton.jit(do_not_specialize=["num_splits"])
def _merge_splits_kernel(
    out_ptr,
    part_out_ptr,
    part_max_ptr,
    part_sum_ptr,
    num_splits,
    stride_ot,
    stride_oh,
    NUM_HEADS: tl.constexpr,
    HEAD_SIZE: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
    PDL: tl.constexpr,
):
    """out[t, h] = sum_s w_s * o_s / sum_s w_s with w_s = l_s * 2^(m_s - max_s m_s)."""
    pdl_enter(PDL)
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    merged = merge_head(part_out_ptr, part_max_ptr, part_sum_ptr, token, head, num_splits,
                        NUM_HEADS, HEAD_PAD, SPLITS_PAD)  # fmt: skip
    dims = tl.arange(0, HEAD_PAD)
    tl.store(
        out_ptr + token * stride_ot + head * stride_oh + dims,
        merged.to(out_ptr.dtype.element_ty),
        mask=dims < HEAD_SIZE,
    )


def merge_pieces(
    output: torch.Tensor,
    part_out: torch.Tensor,
    part_max: torch.Tensor,
    part_sum: torch.Tensor,
    num_splits: int,
) -> None:
    """output [T, H, D] from the partials of every piece (empty ones included), one program a
    (token, head) loading all its pieces at once."""
    num_tokens, num_heads, head_size = output.shape
    head_pad = part_out.shape[-1]
    _merge_splits_kernel[(num_tokens, num_heads)](
        output,
        part_out,
        part_max,
        part_sum,
        num_splits,
        output.stride(0),
        output.stride(1),
        NUM_HEADS=num_heads,
        HEAD_SIZE=head_size,
        HEAD_PAD=head_pad,
        SPLITS_PAD=max(2, triton.next_power_of_2(num_splits)),
        num_warps=4 if head_pad >= 128 else 2,
        **launch_options(output.device),
    )
