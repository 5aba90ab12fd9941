"""Split-KV (flash-decoding) pieces of the decode attention kernels: which key tiles a piece
owns (`split_tile_range`, shared by paged attention and MLA decode), how paged attention stores a
piece's partial, and the merges of the partials:

- paged attention (kernels/triton_attention.py): a partial is the piece's output normalised by
  its own softmax sum, with its running max and sum, [tokens, heads, num_splits, HEAD_PAD] and
  [tokens, heads, num_splits] float32; merged by the last piece to arrive inside the launch
  (`merge_pieces_in_program`) or by a second kernel (`merge_pieces`);
- MLA decode (kernels/triton_mla.py): normalised outputs [reqs, heads, num_splits, RANK_PAD]
  with their log-sum-exps, merged by the kernel's last piece to arrive (`merge_latent_pieces`).
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
    merged = tl.sum(parts * weights[:, None], 0) / tl.where(total > 0.0, total, 1.0)
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


@triton.jit
def merge_latent_pieces(
    out_ptr,
    part_out_ptr,
    part_lse_ptr,
    token,
    req,
    heads,
    head_valid,
    v_start,
    num_splits,
    stride_ot,
    stride_oh,
    NUM_HEADS: tl.constexpr,
    RANK: tl.constexpr,
    RANK_PAD: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_V: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
):
    """The MLA decode kernel's merge (kernels/triton_mla.py), by its last piece to arrive:
    out[token, h] = sum_s 2^(lse_s - max lse) * o_s / sum_s 2^(lse_s - max lse) for the
    program's heads and its value dims [v_start, v_start + BLOCK_V), in a fixed order
    (deterministic whichever split arrives last), 128 dims at a time (the program's own
    accumulator is dead by now, but a 64-head tile's whole [64, 512] would be a second one).
    Loading every split's piece of a chunk at once ([SPLITS_PAD, BLOCK_H, 128]) measured far
    slower on the H200 (125 vs 88 us a 64 x 4k step; RESULTS.md); up to 8 splits the loop over
    the pieces is unrolled instead (separate 2-D loads, weights from the one lse load): 85.8 vs
    86.7 us."""
    splits = tl.arange(0, SPLITS_PAD)
    stat_base = (req.to(tl.int64) * NUM_HEADS + heads) * num_splits
    lse = tl.load(
        part_lse_ptr + stat_base[:, None] + splits[None, :],
        mask=head_valid[:, None] & (splits[None, :] < num_splits),
        other=float("-inf"),
        cache_modifier=".cg",
    )
    # Padding heads see only -inf: a finite max keeps their (unstored) rows free of NaN.
    lse_max = tl.max(lse, 1)
    lse_max = tl.where(lse_max == float("-inf"), 0.0, lse_max)
    weights = tl.exp2(lse - lse_max[:, None])  # [BLOCK_H, SPLITS_PAD]; 0 past num_splits
    total = tl.sum(weights, 1)
    total = tl.where(total > 0.0, total, 1.0)
    CHUNK: tl.constexpr = 128 if BLOCK_V > 128 else BLOCK_V  # noqa: FURB136 (a constexpr)
    for v0 in tl.static_range(0, BLOCK_V, CHUNK):
        dims = v_start + v0 + tl.arange(0, CHUNK)
        acc = tl.zeros([BLOCK_H, CHUNK], dtype=tl.float32)
        if SPLITS_PAD <= 8:
            # Unrolled: a chunk's pieces are independent loads in flight together, one trip
            # to L2 a chunk instead of one a piece.
            for s in tl.static_range(SPLITS_PAD):
                part = tl.load(
                    part_out_ptr + (stat_base + s)[:, None] * RANK_PAD + dims[None, :],
                    mask=(head_valid & (tl.full([BLOCK_H], s, tl.int32) < num_splits))[:, None],
                    other=0.0,
                    cache_modifier=".cg",
                )
                weight = tl.sum(tl.where(splits[None, :] == s, weights, 0.0), 1)
                acc += weight[:, None] * part
        else:
            for s in range(num_splits):
                lse_s = tl.load(
                    part_lse_ptr + stat_base + s,
                    mask=head_valid,
                    other=float("-inf"),
                    cache_modifier=".cg",
                )
                part = tl.load(
                    part_out_ptr + (stat_base + s)[:, None] * RANK_PAD + dims[None, :],
                    mask=head_valid[:, None],
                    other=0.0,
                    cache_modifier=".cg",
                )
                acc += tl.exp2(lse_s - lse_max)[:, None] * part
        tl.store(
            out_ptr + token * stride_ot + heads[:, None] * stride_oh + dims[None, :],
            (acc / total[:, None]).to(out_ptr.dtype.element_ty),
            mask=head_valid[:, None] & (dims < RANK)[None, :],
        )
