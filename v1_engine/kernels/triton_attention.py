"""Paged attention in Triton: one varlen kernel for a mixed batch, plus a split-KV reduce.

`paged_attention` serves every request of a step in one launch, whatever its shape: a prefill
chunk (many query tokens attending to its cached context and, causally, to itself) and a decode
token (one query token over its whole context) are the same program with different lengths.

Work decomposition. A program owns one *q-block* (up to BLOCK_Q consecutive query tokens of one
request) for one kv head, and computes every query head of that kv head's GQA group at once: the
tile's rows are (token, group member) pairs, so K/V are read once per group, not once per query
head. Q-blocks of request i are numbered from `query_start_loc[i] // BLOCK_Q + i`, which is
increasing in i and bounded by `num_tokens // BLOCK_Q + num_reqs`: the grid size is known on the
host without reading any device tensor, and a program finds its request by binary search.

Split-KV (flash-decoding). With few requests and long contexts, one program per (q-block, kv head)
leaves most of the GPU idle. Then the KV range of each q-block is cut into `num_splits` pieces
handled by separate programs, each writing a partial result normalised by its own softmax sum,
with its running max and sum. Up to FUSED_MERGE_MAX_SPLITS pieces, each piece that owns a tile
counts itself in on a semaphore per (q-block, kv head) (kernels/semaphores.py), and the last to
arrive merges the pieces in split order and zeroes the semaphore, in the same launch; a short
context (the decode graphs split for max_model_len) fills only the first pieces, the rest
return at once, and a context of one piece is written directly. With more pieces (batch 1 and
2 on 132 SMs), a second kernel merges them per (token, head), which measured faster there.

Precision: scores and the softmax run in float32 (exp2 with the scale folded into log2 units);
float32 inputs use IEEE dot products, 16-bit inputs the tensor cores with float32 accumulation.
Head sizes that are not powers of two are padded to the next one with masked loads.

FP8 cache. An e4m3 cache (KV_FP8) is read as it is stored and widened to the query's dtype, which
holds every e4m3 value exactly, so the dot products see the stored values. The per-layer scales
are scalars, so dequantizing (k * k_scale, v * v_scale in float32) is folded into the float32
math: k_scale into the score scale, v_scale into the normalised output. They are loaded from
device memory (pointers, not values), so a captured CUDA graph follows a scale set later. With a
16-bit cache the flag is off and the kernel is the same code as before.

Nothing here reads a device tensor on the host, so a launch can be captured in a CUDA graph; the
host decisions use only python ints (token count, request count, max query/seq length).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from v1_engine.kernels import interpreting
from v1_engine.kernels.attention_launch import (
    FP8_CACHE_DTYPE,
    check_args,
    plan_launch,
    target_programs,
)
from v1_engine.kernels.cache_ops import check_fp8_scales
from v1_engine.kernels.pdl import launch_options, pdl_release, pdl_wait
from v1_engine.kernels.semaphores import split_semaphores
from v1_engine.kernels.triton_cache import quantize_e4m3
from v1_engine.kernels.triton_rope import (
    check_rope_decode_args,
    rope_dims,
    rope_tables,
    rotate_rows,
)
from v1_engine.kernels.triton_split_kv import (
    active_splits,
    merge_pieces,
    merge_pieces_in_program,
    split_tile_range,
    store_partial,
)

_LOG2E = 1.4426950408889634


@triton.jit
def _find_request(query_start_loc_ptr, q_block_id, num_reqs, BLOCK_Q: tl.constexpr):
    """The request whose q-blocks contain `q_block_id` (last i with start_block(i) <= id)."""
    lo = 0
    hi = num_reqs
    while lo < hi:
        mid = (lo + hi) // 2
        first_block = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
        if first_block <= q_block_id:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def _kv_offsets(
    table_row,
    tile,
    offs_t,
    kv_len,
    kv_head,
    stride_cb,
    stride_cs,
    stride_ch,
    BLOCK_SIZE: tl.constexpr,
    TILE: tl.constexpr,
):
    """Offsets into the K/V caches of the TILE token positions of loop step `tile` (positions
    at or past kv_len read block 0: their loads are masked)."""
    pos = tile * TILE + offs_t
    block_id = tl.load(table_row + pos // BLOCK_SIZE, mask=pos < kv_len, other=0).to(tl.int64)
    return block_id * stride_cb + (pos % BLOCK_SIZE) * stride_cs + kv_head * stride_ch


@triton.jit
def _first_offsets(table_row, tile_lo, tile_hi, kv_len, kv_head, stride_cb, stride_cs, stride_ch,
                   BLOCK_SIZE: tl.constexpr, TILE: tl.constexpr):  # fmt: skip
    """The cache offsets of the first step of the tile range [tile_lo, tile_hi) (an empty
    range looks up a masked step, never used)."""
    tile = tl.maximum(tl.minimum(tile_lo, tile_hi - 1), 0)
    return _kv_offsets(table_row, tile, tl.arange(0, TILE), kv_len, kv_head, stride_cb, stride_cs,
                       stride_ch, BLOCK_SIZE, TILE)  # fmt: skip


@triton.jit
def _attend_tiles(
    m_i,
    l_i,
    acc,
    q,
    q_pos,
    next_off,
    tile_lo,
    tile_hi,
    kv_len,
    table_row,
    k_cache_ptr,
    v_cache_ptr,
    kv_head,
    dims,
    dim_valid,
    scale_log2,
    stride_cb,
    stride_cs,
    stride_ch,
    BLOCK_SIZE: tl.constexpr,
    TILE: tl.constexpr,
    MASKED: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    DOT_F32: tl.constexpr,
    KV_FP8: tl.constexpr,
):
    """Online softmax over key tiles [tile_lo, tile_hi); MASKED applies the causal and
    end-of-sequence masks (off for tiles every row sees whole)."""
    offs_t = tl.arange(0, TILE)
    # A step's cache offsets are computed one step early (loop-carried; `next_off` arrives as
    # the first step's, `_first_offsets`). In the compiled loop the next step's K/V copies still
    # follow the block-table load of the same iteration; what this form gained over a lookup
    # inside the step was registers (120 vs 145 a thread under Triton 3.6: 4 vs 3 programs an
    # SM), which set the bytes in flight here (benchmarks/RESULTS.md; test_pipelining.py).
    for tile in range(tile_lo, tile_hi):
        pos = tile * TILE + offs_t
        if MASKED:
            pos_valid = pos < kv_len
        kv_off = next_off
        next_off = _kv_offsets(
            table_row, tl.minimum(tile + 1, tile_hi - 1), offs_t, kv_len, kv_head, stride_cb,
            stride_cs, stride_ch, BLOCK_SIZE, TILE,
        )  # fmt: skip
        if MASKED:
            k_mask = pos_valid[None, :] & dim_valid[:, None]
            k = tl.load(k_cache_ptr + kv_off[None, :] + dims[:, None], mask=k_mask, other=0.0)
        else:
            k = tl.load(k_cache_ptr + kv_off[None, :] + dims[:, None], mask=dim_valid[:, None])
        if DOT_F32 or KV_FP8:
            k = k.to(q.dtype)
        scores = tl.dot(q, k, input_precision=DOT_PRECISION) * scale_log2
        if MASKED:
            visible = (pos[None, :] <= q_pos[:, None]) & pos_valid[None, :]
            scores = tl.where(visible, scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        p = tl.exp2(scores - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        if MASKED:
            kv_mask = pos_valid[:, None] & dim_valid[None, :]
            v = tl.load(v_cache_ptr + kv_off[:, None] + dims[None, :], mask=kv_mask, other=0.0)
        else:
            v = tl.load(v_cache_ptr + kv_off[:, None] + dims[None, :], mask=dim_valid[None, :])
        if DOT_F32 or KV_FP8:
            v = v.to(q.dtype)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new
    return m_i, l_i, acc


# Per-step counts are not specialised on (Triton would compile a variant for a value of 1 and for
# multiples of 16): a new batch size must never stall a running engine on a compile.
@triton.jit(do_not_specialize=["num_reqs", "num_splits"])
def _paged_attention_kernel(
    out_ptr, part_out_ptr, part_max_ptr, part_sum_ptr, arrivals_ptr,
    q_ptr, k_cache_ptr, v_cache_ptr, block_table_ptr, seq_lens_ptr, query_start_loc_ptr,
    k_scale_ptr, v_scale_ptr,
    k_new_ptr, v_new_ptr, positions_ptr, cos_ptr, sin_ptr, slot_ptr,  # read with ROPE only
    scale_log2, num_reqs, num_splits,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_cb, stride_cs, stride_ch, stride_bt,
    stride_knt, stride_knh, stride_vnt, stride_vnh,
    NUM_HEADS: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
    HEAD_SIZE: tl.constexpr, HEAD_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr, TILE: tl.constexpr,
    USE_SPLITS: tl.constexpr, FUSED_MERGE: tl.constexpr,
    DOT_PRECISION: tl.constexpr, DOT_F32: tl.constexpr, KV_FP8: tl.constexpr,
    ROPE: tl.constexpr, IS_NEOX: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    # The paging metadata (query starts, sequence lengths, block table, and with ROPE the
    # position and slot) is read before the PDL wait: the step writes it
    # before its forward starts, and the QKV GEMM in front of every attention waits on its own
    # predecessor before it lets this kernel launch, so it is complete by then. Everything a
    # kernel of this step writes (the query, the new K/V, the cache) is read after the wait.
    q_block_id = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    req = _find_request(query_start_loc_ptr, q_block_id, num_reqs, BLOCK_Q)
    q_start = tl.load(query_start_loc_ptr + req)
    q_len = tl.load(query_start_loc_ptr + req + 1) - q_start
    local_block = q_block_id - (q_start // BLOCK_Q + req)
    seq_len = tl.load(seq_lens_ptr + req)
    context_len = seq_len - q_len

    # Keys visible to this q-block: positions up to its last token's (causal).
    last_local = tl.minimum(local_block * BLOCK_Q + BLOCK_Q, q_len) - 1
    kv_len = context_len + last_local + 1
    tile_lo, tile_hi = split_tile_range(tl.cdiv(kv_len, TILE), split, num_splits, USE_SPLITS)
    table_row = block_table_ptr + req.to(tl.int64) * stride_bt
    # Tiles wholly at or before the block's first query position need no mask (every row sees
    # every key there, all valid); only the tiles on the causal diagonal and the sequence's end
    # pay for it.
    first_pos = context_len + local_block * BLOCK_Q
    full_hi = tl.maximum(tl.minimum((first_pos + 1) // TILE, tile_hi), tile_lo)
    if not ROPE:
        first_off = _first_offsets(table_row, tile_lo, full_hi, kv_len, kv_head, stride_cb,
                                   stride_cs, stride_ch, BLOCK_SIZE, TILE)  # fmt: skip
    dims = tl.arange(0, HEAD_PAD)
    dim_valid = dims < HEAD_SIZE
    if ROPE:  # scalars only: the cos/sin rows held across the wait cost 14 registers
        # A request without a query token (padding) may start at num_tokens: read nothing.
        has_token = q_len > 0
        position = tl.load(positions_ptr + q_start, mask=has_token, other=0).to(tl.int64)
        slot = tl.load(slot_ptr + q_start, mask=has_token, other=-1).to(tl.int64)
        # The first block-table entries and the position's cos / sin rows, fetched into L2
        # here (volatile loads, values unused) and loaded again after the wait: holding the
        # tile's offsets across the rotation cost 15 registers (5 -> 4 programs an SM). An
        # empty split's range may start past the table row: its first tile is clamped, as
        # `_first_offsets` clamps it, and nothing is read past kv_len.
        warm_pos = tl.maximum(tl.minimum(tile_lo, tile_hi - 1), 0) * TILE
        tl.load(table_row + warm_pos // BLOCK_SIZE, mask=warm_pos < kv_len, volatile=True)
        half = tl.arange(0, HEAD_PAD // 2)
        half_ok = half < HEAD_SIZE // 2
        tl.load(cos_ptr + position * (HEAD_SIZE // 2) + half, mask=half_ok, volatile=True)
        tl.load(sin_ptr + position * (HEAD_SIZE // 2) + half, mask=half_ok, volatile=True)

    pdl_wait(PDL)
    if local_block * BLOCK_Q >= q_len:
        return
    if FUSED_MERGE:  # noqa: SIM102 - a constexpr branch around a runtime one
        # A short context fills fewer pieces than the launch has: the rest own no tile and,
        # merged here, need not store an empty partial.
        if tile_lo >= tile_hi:
            return
    rows = tl.arange(0, BLOCK_M)
    tok_local = local_block * BLOCK_Q + rows // GROUP_PAD
    member = rows % GROUP_PAD
    row_valid = (tok_local < q_len) & (member < GROUP)
    token = (q_start + tok_local).to(tl.int64)
    head = kv_head * GROUP + member
    q_mask = row_valid[:, None] & dim_valid[None, :]
    q_rows = q_ptr + token[:, None] * stride_qt + head[:, None] * stride_qh
    if ROPE:
        # Decode (one query token per request, host-checked): rotate the token's query heads
        # and its key head here and write its K/V to the cache before the tiles are read.
        src, partner, pair, first = rope_dims(dims, HEAD_SIZE // 2, IS_NEOX)
        cos, sin = rope_tables(cos_ptr, sin_ptr, position, pair, dim_valid,
                               q_ptr.dtype.element_ty, HEAD_SIZE // 2, IS_NEOX)  # fmt: skip
        q_src = tl.load(q_rows + src[None, :], mask=q_mask, other=0.0)
        q_partner = tl.load(q_rows + partner[None, :], mask=q_mask, other=0.0)
        q = rotate_rows(q_src, q_partner, cos[None, :], sin[None, :], first[None, :])
        q = q.to(q_ptr.dtype.element_ty)
        k_row = k_new_ptr + q_start.to(tl.int64) * stride_knt + kv_head * stride_knh
        k_src = tl.load(k_row + src, mask=dim_valid, other=0.0)
        k_partner = tl.load(k_row + partner, mask=dim_valid, other=0.0)
        k_new = rotate_rows(k_src, k_partner, cos, sin, first).to(q_ptr.dtype.element_ty)
        v_row = v_new_ptr + q_start.to(tl.int64) * stride_vnt + kv_head * stride_vnh
        v_new = tl.load(v_row + dims, mask=dim_valid, other=0.0)
        # Only the split whose tiles hold the new position reads it, so it alone writes it;
        # the barrier makes the stores visible to the program's other threads (CTA scope).
        new_tile = (seq_len - 1) // TILE
        if (new_tile >= tile_lo) & (new_tile < tile_hi) & (slot >= 0):
            cache_off = (slot // BLOCK_SIZE) * stride_cb + (slot % BLOCK_SIZE) * stride_cs
            cache_off += kv_head * stride_ch + dims
            cache_ty = k_cache_ptr.dtype.element_ty
            if KV_FP8:  # as the FP8 cache write stores the rotated (model-dtype) key
                k_q = quantize_e4m3(k_new, tl.load(k_scale_ptr))
                v_q = quantize_e4m3(v_new, tl.load(v_scale_ptr))
                tl.store(k_cache_ptr + cache_off, k_q.to(cache_ty), mask=dim_valid)
                tl.store(v_cache_ptr + cache_off, v_q.to(cache_ty), mask=dim_valid)
            else:
                tl.store(k_cache_ptr + cache_off, k_new, mask=dim_valid)
                tl.store(v_cache_ptr + cache_off, v_new, mask=dim_valid)
        tl.debug_barrier()
    else:
        q = tl.load(q_rows + dims[None, :], mask=q_mask, other=0.0)
    if ROPE:
        first_off = _first_offsets(table_row, tile_lo, full_hi, kv_len, kv_head, stride_cb,
                                   stride_cs, stride_ch, BLOCK_SIZE, TILE)  # fmt: skip
    if DOT_F32:
        q = q.to(tl.float32)
    q_pos = context_len + tok_local  # absolute position of each row's token
    if KV_FP8:
        scale_log2 = scale_log2 * tl.load(k_scale_ptr)

    # The running max starts finite (-1e30), so a row with no visible key in a tile gets
    # exp2(-inf - m) = 0 and exp2(m - m) = 1 instead of NaN.
    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_PAD], dtype=tl.float32)
    m_i, l_i, acc = _attend_tiles(
        m_i, l_i, acc, q, q_pos, first_off, tile_lo, full_hi, kv_len, table_row, k_cache_ptr,
        v_cache_ptr, kv_head, dims, dim_valid, scale_log2, stride_cb, stride_cs, stride_ch, BLOCK_SIZE, TILE,
        False, DOT_PRECISION, DOT_F32, KV_FP8,
    )  # fmt: skip
    masked_off = _first_offsets(table_row, full_hi, tile_hi, kv_len, kv_head, stride_cb,
                                stride_cs, stride_ch, BLOCK_SIZE, TILE)  # fmt: skip
    m_i, l_i, acc = _attend_tiles(
        m_i, l_i, acc, q, q_pos, masked_off, full_hi, tile_hi, kv_len, table_row, k_cache_ptr,
        v_cache_ptr, kv_head, dims, dim_valid, scale_log2, stride_cb, stride_cs, stride_ch, BLOCK_SIZE, TILE,
        True, DOT_PRECISION, DOT_F32, KV_FP8,
    )  # fmt: skip

    pdl_release(PDL)
    l_safe = tl.where(l_i > 0.0, l_i, 1.0)
    result = acc / l_safe[:, None]
    if KV_FP8:
        result = result * tl.load(v_scale_ptr)
    out_rows = out_ptr + token[:, None] * stride_ot + head[:, None] * stride_oh + dims[None, :]
    if FUSED_MERGE:
        active = active_splits(tl.cdiv(kv_len, TILE), num_splits)
        if active == 1:  # the whole range in this program: no partials
            tl.store(out_rows, result.to(out_ptr.dtype.element_ty), mask=q_mask)
        else:
            # Partials are [tokens, NUM_HEADS, num_splits, HEAD_PAD] and [.., num_splits]. The
            # barrier orders every thread's stores before the one thread's atomic, whose release
            # publishes them; its acquire in the last program to arrive makes the other splits'
            # visible there, and that program merges (loads past L1: .cg).
            stat_off = (token * NUM_HEADS + head) * num_splits + split
            store_partial(part_out_ptr, part_max_ptr, part_sum_ptr, stat_off, m_i, l_i, result,
                          row_valid, dims, HEAD_PAD)  # fmt: skip
            tl.debug_barrier()
            semaphore = arrivals_ptr + q_block_id * tl.num_programs(1) + kv_head
            if tl.atomic_add(semaphore, 1, sem="acq_rel") == active - 1:
                merged = merge_pieces_in_program(
                    part_out_ptr, part_max_ptr, part_sum_ptr, stat_off - split, row_valid, dims,
                    active, HEAD_PAD, BLOCK_M,
                )  # fmt: skip
                tl.store(out_rows, merged.to(out_ptr.dtype.element_ty), mask=q_mask)
                tl.atomic_xchg(semaphore, 0)  # zero again for the next launch
    elif USE_SPLITS:  # every piece, empty ones too, stores its partial for `merge_pieces`
        stat_off = (token * NUM_HEADS + head) * num_splits + split
        store_partial(part_out_ptr, part_max_ptr, part_sum_ptr, stat_off, m_i, l_i, result,
                      row_valid, dims, HEAD_PAD)  # fmt: skip
    else:
        tl.store(out_rows, result.to(out_ptr.dtype.element_ty), mask=q_mask)


def _rope_arguments(
    rope: tuple | None,
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    seq_lens: torch.Tensor,
    max_query_len: int,
) -> tuple[tuple, tuple[int, ...], bool]:
    """The kernel's rope arguments from `paged_attention`'s `rope` (checked): the (key, value,
    positions, cos, sin, slot_mapping) tensors, the key's and value's (token, head) strides,
    and is_neox; without rope, stand-ins the kernel never reads."""
    if rope is None:
        return (query, query, seq_lens, query, query, seq_lens), (0, 0, 0, 0), False
    key, value, positions, cos_cache, sin_cache, is_neox, slot_mapping = rope
    check_rope_decode_args(positions, query, key, value, cos_cache, sin_cache, kv_cache,
                           slot_mapping, max_query_len)  # fmt: skip
    rope_args = (key, value, positions, cos_cache, sin_cache, slot_mapping)
    rope_strides = (key.stride(0), key.stride(1), value.stride(0), value.stride(1))
    return rope_args, rope_strides, bool(is_neox)


def paged_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    max_query_len: int,
    max_seq_len: int,
    scale: float,
    output: torch.Tensor,
    num_splits: int | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    launch: dict[str, int] | None = None,
    rope: tuple | None = None,
) -> None:
    """Causal attention of query [T, Hq, D] over the paged cache, written into output [T, Hq, D].

    kv_cache [2, num_blocks, block_size, Hkv, D] already holds every token's K/V (context and the
    new ones); request i owns query rows query_start_loc[i]:query_start_loc[i+1], the last rows of
    its seq_lens[i] positions. block_table [R, max_blocks] int32, seq_lens [R] int32,
    query_start_loc [R+1] int32, all on query's device. `num_splits` forces the split-KV factor
    (None picks it from the shape). A float8_e4m3fn cache holds K / k_scale and V / v_scale
    (float32 [1] tensors, required then); a cache in the query's dtype ignores the scales.
    `launch` overrides the launch configuration (keys block_m, tile, num_warps, num_stages,
    maxnreg: a cap on registers per thread, so more programs fit an SM; fused_merge: 1 / 0 to
    merge split-KV pieces in the launch or in a second kernel; tuning).

    `rope` = (key, value, positions, cos_cache, sin_cache, is_neox_style, slot_mapping), decode
    steps only (max_query_len 1): query and key arrive not yet rotated (views of the QKV GEMM
    output), and this one launch rotates them as kernels/triton_rope.py does, writes the new K/V
    at slot_mapping (quantized as kernels/triton_cache.py does for an e4m3 cache) and attends,
    so the cache need not hold the new tokens beforehand.
    """
    num_tokens, num_heads, head_size = query.shape
    num_kv_heads = kv_cache.shape[3]
    check_args(query, kv_cache, block_table, seq_lens, query_start_loc, output)
    rope_args, rope_strides, is_neox = _rope_arguments(
        rope, query, kv_cache, seq_lens, max_query_len
    )
    kv_fp8 = kv_cache.dtype == FP8_CACHE_DTYPE
    if kv_fp8:
        check_fp8_scales(k_scale, v_scale, kv_cache.device)
    else:
        k_scale = v_scale = seq_lens  # unused by the kernel
    num_reqs = seq_lens.shape[0]
    if num_tokens == 0 or num_reqs == 0:
        return
    if query.stride(2) != 1:
        query = query.contiguous()
    group = num_heads // num_kv_heads
    group_pad = triton.next_power_of_2(group)
    head_pad = max(16, triton.next_power_of_2(head_size))
    plan = plan_launch(query.dtype, num_tokens, num_reqs, num_kv_heads, group_pad, head_pad,
                       max_query_len, max_seq_len, target_programs(query.device), num_splits,
                       launch)  # fmt: skip
    use_splits = plan.num_splits > 1
    part_out = part_max = part_sum = arrivals = output  # unused by the kernel without splits
    if use_splits:
        part_out = torch.empty((num_tokens, num_heads, plan.num_splits, head_pad),
                               dtype=torch.float32, device=query.device)  # fmt: skip
        part_max = torch.empty(part_out.shape[:3], dtype=torch.float32, device=query.device)
        part_sum = torch.empty_like(part_max)
        if plan.fused_merge:  # else the second kernel merges: no semaphores
            arrivals = split_semaphores(query.device, plan.num_q_blocks * num_kv_heads)
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    # The interpreter multiplies bfloat16 blocks as their raw bits: upcast there.
    dot_f32 = query.dtype == torch.float32 or (interpreting() and query.dtype == torch.bfloat16)
    _paged_attention_kernel[(plan.num_q_blocks, num_kv_heads, plan.num_splits)](
        output, part_out, part_max, part_sum, arrivals,
        query, k_cache, v_cache, block_table, seq_lens, query_start_loc,
        k_scale, v_scale, *rope_args,
        scale * _LOG2E, num_reqs, plan.num_splits,
        query.stride(0), query.stride(1), output.stride(0), output.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_table.stride(0),
        *rope_strides,
        NUM_HEADS=num_heads, GROUP=group, GROUP_PAD=group_pad, HEAD_SIZE=head_size,
        HEAD_PAD=head_pad, BLOCK_SIZE=kv_cache.shape[2], BLOCK_Q=plan.block_q,
        BLOCK_M=plan.block_m, TILE=plan.tile, USE_SPLITS=use_splits, FUSED_MERGE=plan.fused_merge,
        DOT_PRECISION="ieee" if dot_f32 else "tf32", DOT_F32=dot_f32, KV_FP8=kv_fp8,
        ROPE=rope is not None, IS_NEOX=is_neox, num_warps=plan.num_warps,
        num_stages=plan.num_stages, **plan.options, **launch_options(query.device),
    )  # fmt: skip
    if use_splits and not plan.fused_merge:
        merge_pieces(output, part_out, part_max, part_sum, plan.num_splits)
