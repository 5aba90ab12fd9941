"""Multi-head Latent Attention decode in Triton: paged latent cache, split-KV, head tiles.

The cache holds one entry per token shared by every head: the latent `c` (kv_lora_rank values)
followed by the rotated rope key `k_pe` (rope_dim values). After weight absorption each head's
query is `q_nope` in the latent space (kv_lora_rank) plus `q_pe` (rope_dim), and

    score(h, t) = q_nope[h] . c[t] + q_pe[h] . k_pe[t],     out[h] = softmax_t(score) @ c

so the keys AND the values are the same cached latents. The output stays in the latent space;
the layer maps it through W_UV afterwards.

Work decomposition. A program owns one decode request, a tile of BLOCK_H heads and one split of
the request's sequence. Every latent it loads feeds all BLOCK_H heads (scores as one
[BLOCK_H, R] x [R, TILE] product, values as [BLOCK_H, TILE] x [TILE, R]), so with heads <= BLOCK_H
each cached byte is read once per step, and once per head tile beyond that (the other tiles
usually find it in L2).

Launch variants (LaunchConfig; the defaults are the plain form above):
- swap: the same products transposed, scores^T = latent @ q_nope^T + k_pe @ q_pe^T [TILE, BLOCK_H]
  and out^T += latent^T @ p^T [R, BLOCK_H]. The tokens and the latent dims become the M of the
  dots and the heads their N: a tensor-core dot on Hopper (wgmma) needs M >= 64, so with 16
  heads only the transposed form reads the latent tile from shared memory; the plain one pulls
  it into registers.
- block_v: a program accumulates only a slice of block_v latent (value) dims of the output, so
  its accumulator is [BLOCK_H, block_v]. Each slice's program still computes the full scores
  (every one of the R + P dims enters q . k): the scores are computed once per slice, and the
  slice is loaded a second time for the value product (from L2, the scores' load just brought
  it there).
- page_tile: a loop step's TILE tokens lie in one cache block (TILE divides the block size), so
  the step loads one block id and the rows are consecutive slots, not one block id per token.

Split-KV (flash-decoding). With few requests the (request, head tile) programs cannot fill the
device, so the sequence is cut into `num_splits` pieces handled by separate programs; each writes
its output normalised by its own softmax sum plus its log-sum-exp and counts itself in on a
semaphore per (request, head tile, value slice); the last to arrive merges the pieces in split
order (deterministic) and zeroes the semaphore, all in the one kernel. (A second merge kernel
cost ~7 us of a 64 x 4k step's ~100. The semaphores are kernels/semaphores.py's, shared with
the split-K GEMMs: such launches must not run on two streams at once.)

Only decode requests (query length 1) are served: a program whose request has another query
length returns at once, so a mixed batch can be passed as is (prefill chunks go through the
expanded form elsewhere). Everything per request comes from device tensors (query_start_loc,
seq_lens, block_table); the host passes only python ints, so a launch can be captured in a CUDA
graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from v1_engine.kernels import interpreting
from v1_engine.kernels.mla_launch import (
    SUPPORTED_DTYPES,
    LaunchConfig,
    check_args,
    choose_num_splits,
    launch_config,
    mla_decode_bytes,
    plan_launch,
)
from v1_engine.kernels.pdl import launch_options, pdl_release, pdl_wait
from v1_engine.kernels.semaphores import split_semaphores
from v1_engine.kernels.triton_split_kv import merge_latent_pieces, split_tile_range

__all__ = [
    "SUPPORTED_DTYPES",
    "LaunchConfig",
    "choose_num_splits",
    "launch_config",
    "mla_decode",
    "mla_decode_bytes",
]

_LOG2E = 1.4426950408889634


@triton.jit
def _page_offset(
    table_row, tile, stride_cb, stride_cs, BLOCK_SIZE: tl.constexpr, TILE: tl.constexpr
):
    """Offset into the cache of loop step `tile`'s first row, its TILE rows being consecutive
    slots of one block (PAGE_TILE). tile < num_tiles, so the step's first token is cached and
    its block id is valid."""
    block_id = tl.load(table_row + tile * TILE // BLOCK_SIZE).to(tl.int64)
    return block_id * stride_cb + (tile * TILE % BLOCK_SIZE) * stride_cs


@triton.jit
def _row_offsets(
    table_row, tile, offs_t, seq_len, stride_cb, stride_cs, BLOCK_SIZE: tl.constexpr,
    TILE: tl.constexpr,
):  # fmt: skip
    """Offsets into the cache of loop step `tile`'s rows, one per token position (positions
    past seq_len read block 0: their loads are masked)."""
    pos = tile * TILE + offs_t
    block_id = tl.load(table_row + pos // BLOCK_SIZE, mask=pos < seq_len, other=0).to(tl.int64)
    return block_id * stride_cb + (pos % BLOCK_SIZE).to(tl.int64) * stride_cs


@triton.jit
def _load_rows(ptrs, row_valid, col_valid, MASK_ROWS: tl.constexpr, MASK_COLS: tl.constexpr):
    """A [rows, cols] cache tile; masks only where a constexpr says a row or column can be out
    of range (a full step of a latent whose width is a power of two loads unmasked)."""
    if MASK_ROWS and MASK_COLS:
        return tl.load(ptrs, mask=row_valid[:, None] & col_valid[None, :], other=0.0)
    elif MASK_ROWS:
        return tl.load(ptrs, mask=row_valid[:, None], other=0.0)
    elif MASK_COLS:
        return tl.load(ptrs, mask=col_valid[None, :], other=0.0)
    else:
        return tl.load(ptrs)


@triton.jit
def _mla_tiles(
    m_i,
    l_i,
    acc,
    q_nope,
    q_pe,
    tile_lo,
    tile_hi,
    seq_len,
    table_row,
    cache_ptr,
    scale_log2,
    dims,
    dim_valid,
    rope_dims,
    rope_valid,
    v_dims,
    v_valid,
    stride_cb,
    stride_cs,
    RANK: tl.constexpr,
    ROPE: tl.constexpr,
    RANK_PAD: tl.constexpr,
    ROPE_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    TILE: tl.constexpr,
    BLOCK_V: tl.constexpr,
    SWAP: tl.constexpr,
    PAGE_TILE: tl.constexpr,
    MASKED: tl.constexpr,
    DOT_F32: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """Online softmax over the loop steps [tile_lo, tile_hi); MASKED masks the positions past
    seq_len (off for steps whose TILE tokens are all cached: all but a sequence's last)."""
    offs_t = tl.arange(0, TILE)
    if PAGE_TILE:
        # Loop-invariant offsets of a step's rows from its first: a step then costs one scalar
        # lookup and one pointer add per loaded vector, not a 64-bit row address per token.
        latent_offs = offs_t[:, None] * stride_cs + dims[None, :]
        rope_offs = offs_t[:, None] * stride_cs + RANK + rope_dims[None, :]
        value_offs = offs_t[:, None] * stride_cs + v_dims[None, :]
    # A step's cache rows are looked up one step early (loop-carried; an empty range looks up a
    # valid step, never used). With the lookup inside the step Triton's pipeliner spent a stage
    # on the block-id -> latent chain and left one latent buffer; now every stage is one
    # (test_pipelining.py). As in paged attention, the compiled loop may still order a step's
    # copies after the same iteration's table load.
    first = tl.maximum(tl.minimum(tile_lo, tile_hi - 1), 0)
    if PAGE_TILE:
        next_off = _page_offset(table_row, first, stride_cb, stride_cs, BLOCK_SIZE, TILE)
    else:
        next_off = _row_offsets(
            table_row, first, offs_t, seq_len, stride_cb, stride_cs, BLOCK_SIZE, TILE
        )
    for tile in range(tile_lo, tile_hi):
        pos = tile * TILE + offs_t
        pos_valid = pos < seq_len
        off = next_off
        following = tl.minimum(tile + 1, tile_hi - 1)
        if PAGE_TILE:
            next_off = _page_offset(table_row, following, stride_cb, stride_cs, BLOCK_SIZE, TILE)
        else:
            next_off = _row_offsets(
                table_row, following, offs_t, seq_len, stride_cb, stride_cs, BLOCK_SIZE, TILE
            )
        if PAGE_TILE:
            base = cache_ptr + off
            latent_ptrs = base + latent_offs
            rope_ptrs = base + rope_offs
            value_ptrs = base + value_offs
        else:
            rows = cache_ptr + off
            latent_ptrs = rows[:, None] + dims[None, :]
            rope_ptrs = rows[:, None] + RANK + rope_dims[None, :]
            value_ptrs = rows[:, None] + v_dims[None, :]
        latent = _load_rows(latent_ptrs, pos_valid, dim_valid, MASKED, RANK != RANK_PAD)
        k_pe = _load_rows(rope_ptrs, pos_valid, rope_valid, MASKED, ROPE != ROPE_PAD)
        if DOT_F32:
            latent = latent.to(tl.float32)
            k_pe = k_pe.to(tl.float32)
        if BLOCK_V == RANK_PAD:
            latent_v = latent
        else:
            latent_v = _load_rows(value_ptrs, pos_valid, v_valid, MASKED, True)
            if DOT_F32:
                latent_v = latent_v.to(tl.float32)
        if SWAP:
            scores = tl.dot(latent, tl.trans(q_nope), input_precision=DOT_PRECISION)
            scores = tl.dot(k_pe, tl.trans(q_pe), acc=scores, input_precision=DOT_PRECISION)
            scores = scores * scale_log2
            if MASKED:
                scores = tl.where(pos_valid[:, None], scores, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(scores, 0))
            p = tl.exp2(scores - m_new[None, :])
            alpha = tl.exp2(m_i - m_new)
            l_i = l_i * alpha + tl.sum(p, 0)
            acc = acc * alpha[None, :]
            acc = tl.dot(
                tl.trans(latent_v),
                p.to(latent_v.dtype),
                acc=acc,
                input_precision=DOT_PRECISION,
            )
        else:
            scores = tl.dot(q_nope, tl.trans(latent), input_precision=DOT_PRECISION)
            scores = tl.dot(q_pe, tl.trans(k_pe), acc=scores, input_precision=DOT_PRECISION)
            scores = scores * scale_log2
            if MASKED:
                scores = tl.where(pos_valid[None, :], scores, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(scores, 1))
            p = tl.exp2(scores - m_new[:, None])
            alpha = tl.exp2(m_i - m_new)
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None]
            acc = tl.dot(p.to(latent_v.dtype), latent_v, acc=acc, input_precision=DOT_PRECISION)
        m_i = m_new
    return m_i, l_i, acc


@triton.jit(do_not_specialize=["num_splits"])
def _mla_decode_kernel(
    out_ptr,
    part_out_ptr,
    part_lse_ptr,
    arrivals_ptr,
    q_nope_ptr,
    q_pe_ptr,
    cache_ptr,
    block_table_ptr,
    seq_lens_ptr,
    query_start_loc_ptr,
    scale_log2,
    num_splits,
    stride_qn_t,
    stride_qn_h,
    stride_qp_t,
    stride_qp_h,
    stride_ot,
    stride_oh,
    stride_cb,
    stride_cs,
    stride_bt,
    NUM_HEADS: tl.constexpr,
    RANK: tl.constexpr,
    ROPE: tl.constexpr,
    RANK_PAD: tl.constexpr,
    ROPE_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    TILE: tl.constexpr,
    BLOCK_V: tl.constexpr,
    SWAP: tl.constexpr,
    PAGE_TILE: tl.constexpr,
    USE_SPLITS: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
    DOT_F32: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_wait(PDL)
    # Value slices, then head tiles vary fastest, so the programs reading one request's split
    # run side by side and all but the first find its latents in L2.
    head_tile = tl.program_id(0) // (RANK_PAD // BLOCK_V)
    v_slice = tl.program_id(0) % (RANK_PAD // BLOCK_V)
    req = tl.program_id(1)
    split = tl.program_id(2)

    q_start = tl.load(query_start_loc_ptr + req)
    if tl.load(query_start_loc_ptr + req + 1) - q_start != 1:
        return  # not a decode request (a prefill chunk, or an empty padding request)
    token = q_start.to(tl.int64)
    seq_len = tl.load(seq_lens_ptr + req)

    heads = head_tile * BLOCK_H + tl.arange(0, BLOCK_H)
    head_valid = heads < NUM_HEADS
    dims = tl.arange(0, RANK_PAD)
    dim_valid = dims < RANK
    rope_dims = tl.arange(0, ROPE_PAD)
    rope_valid = rope_dims < ROPE
    v_dims = v_slice * BLOCK_V + tl.arange(0, BLOCK_V)
    v_valid = v_dims < RANK
    q_nope = tl.load(
        q_nope_ptr + token * stride_qn_t + heads[:, None] * stride_qn_h + dims[None, :],
        mask=head_valid[:, None] & dim_valid[None, :],
        other=0.0,
    )
    q_pe = tl.load(
        q_pe_ptr + token * stride_qp_t + heads[:, None] * stride_qp_h + rope_dims[None, :],
        mask=head_valid[:, None] & rope_valid[None, :],
        other=0.0,
    )
    if DOT_F32:
        q_nope = q_nope.to(tl.float32)
        q_pe = q_pe.to(tl.float32)

    tile_lo, tile_hi = split_tile_range(tl.cdiv(seq_len, TILE), split, num_splits, USE_SPLITS)

    # A finite initial max keeps exp2(m_i - m_new) finite for splits that see no key.
    m_i = tl.full([BLOCK_H], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    if SWAP:
        acc = tl.zeros([BLOCK_V, BLOCK_H], dtype=tl.float32)
    else:
        acc = tl.zeros([BLOCK_H, BLOCK_V], dtype=tl.float32)
    table_row = block_table_ptr + req.to(tl.int64) * stride_bt
    # Steps whose TILE tokens are all cached load unmasked; only a sequence's last step pays.
    full_hi = tl.maximum(tl.minimum(seq_len // TILE, tile_hi), tile_lo)
    m_i, l_i, acc = _mla_tiles(
        m_i, l_i, acc, q_nope, q_pe, tile_lo, full_hi, seq_len, table_row, cache_ptr, scale_log2,
        dims, dim_valid, rope_dims, rope_valid, v_dims, v_valid, stride_cb, stride_cs, RANK, ROPE,
        RANK_PAD, ROPE_PAD, BLOCK_SIZE, TILE, BLOCK_V, SWAP, PAGE_TILE, False, DOT_F32,
        DOT_PRECISION,
    )  # fmt: skip
    m_i, l_i, acc = _mla_tiles(
        m_i, l_i, acc, q_nope, q_pe, full_hi, tile_hi, seq_len, table_row, cache_ptr, scale_log2,
        dims, dim_valid, rope_dims, rope_valid, v_dims, v_valid, stride_cb, stride_cs, RANK, ROPE,
        RANK_PAD, ROPE_PAD, BLOCK_SIZE, TILE, BLOCK_V, SWAP, PAGE_TILE, True, DOT_F32,
        DOT_PRECISION,
    )  # fmt: skip

    pdl_release(PDL)
    if SWAP:
        acc = tl.trans(acc)
    result = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
    if USE_SPLITS:
        # Partials: out [num_reqs, NUM_HEADS, num_splits, RANK_PAD] (this program's value slice)
        # and lse [.., num_splits] (log2; every value slice stores the same values). The last
        # split of a (request, head tile, value slice) to arrive merges them.
        stat_off = (req.to(tl.int64) * NUM_HEADS + heads) * num_splits + split
        lse = tl.where(l_i > 0.0, m_i + tl.log2(tl.where(l_i > 0.0, l_i, 1.0)), float("-inf"))
        tl.store(part_lse_ptr + stat_off, lse, mask=head_valid)
        tl.store(
            part_out_ptr + stat_off[:, None] * RANK_PAD + v_dims[None, :],
            result,
            mask=head_valid[:, None],
        )
        # The barrier orders every thread's stores before the one thread's atomic, whose
        # release publishes them; its acquire in the last program makes the other splits'
        # visible there (read past L1: .cg).
        tl.debug_barrier()
        semaphore = arrivals_ptr + req * tl.num_programs(0) + tl.program_id(0)
        if tl.atomic_add(semaphore, 1, sem="acq_rel") == num_splits - 1:
            merge_latent_pieces(
                out_ptr, part_out_ptr, part_lse_ptr, token, req, heads, head_valid,
                v_slice * BLOCK_V, num_splits, stride_ot, stride_oh, NUM_HEADS, RANK, RANK_PAD,
                BLOCK_H, BLOCK_V, SPLITS_PAD,
            )  # fmt: skip
            tl.atomic_xchg(semaphore, 0)  # zero again for the next launch
    else:
        tl.store(
            out_ptr + token * stride_ot + heads[:, None] * stride_oh + v_dims[None, :],
            result.to(out_ptr.dtype.element_ty),
            mask=head_valid[:, None] & v_valid[None, :],
        )


def mla_decode(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    max_seq_len: int,
    scale: float,
    output: torch.Tensor,
    num_splits: int | None = None,
    block_h: int | None = None,
    tile: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    swap: bool | None = None,
    block_v: int | None = None,
    page_tile: bool | None = None,
    maxnreg: int | None = None,
) -> None:
    """Absorbed MLA of every decode request's token over its cached latents, into output.

    q_nope [T, H, R] (the query already moved into the latent space through W_UK), q_pe [T, H, P]
    (rotated), kv_cache [num_blocks, block_size, R + P]; request i owns query rows
    query_start_loc[i]:query_start_loc[i+1] and attends to its first seq_lens[i] cache entries
    (the new token's latent already written). Only requests with exactly one query row are
    computed; output [T, H, R] rows of other requests are left untouched. block_table
    [num_reqs, max_blocks] / seq_lens [num_reqs] / query_start_loc [num_reqs + 1] are int32 on
    the query's device. `num_splits` forces the split-KV factor (None picks it from the shape);
    `max_seq_len` bounds every seq_lens entry. `block_h` (heads per program), `tile` (cached
    tokens per loop step), `num_warps`, `num_stages`, `swap` (transposed dots), `block_v` (latent
    dims of the output per program; a power of two up to kv_lora_rank's) and `page_tile` (one
    cache block per loop step; tile must divide the block size) override the launch
    configuration (None picks it from the shape, see `launch_config` and `LaunchConfig`);
    `maxnreg` caps the registers a thread (tuning: more programs then fit an SM).
    """
    check_args(q_nope, q_pe, kv_cache, block_table, seq_lens, query_start_loc, output)
    num_reqs = seq_lens.shape[0]
    num_heads, rank = q_nope.shape[1], q_nope.shape[2]
    rope = q_pe.shape[2]
    if q_nope.shape[0] == 0 or num_reqs == 0:
        return
    dot_f32 = q_nope.dtype == torch.float32 or (interpreting() and q_nope.dtype == torch.bfloat16)
    plan = plan_launch(
        num_heads,
        rank,
        kv_cache.shape[1],
        num_reqs,
        max_seq_len,
        dot_f32,
        q_nope.device,
        num_splits,
        block_h=block_h,
        tile=tile,
        num_warps=num_warps,
        num_stages=num_stages,
        swap=swap,
        block_v=block_v,
        page_tile=page_tile,
    )
    config, rank_pad, num_splits = plan.config, plan.rank_pad, plan.num_splits
    num_head_tiles, num_v_slices = plan.num_head_tiles, plan.num_v_slices
    use_splits = num_splits > 1
    if use_splits:
        part_out = torch.empty(
            (num_reqs, num_heads, num_splits, rank_pad), dtype=torch.float32, device=q_nope.device
        )
        part_lse = torch.empty(
            (num_reqs, num_heads, num_splits), dtype=torch.float32, device=q_nope.device
        )
        arrivals = split_semaphores(q_nope.device, num_reqs * num_head_tiles * num_v_slices)
    else:
        part_out = part_lse = arrivals = output  # unused by the kernel
    _mla_decode_kernel[(num_head_tiles * num_v_slices, num_reqs, num_splits)](
        output,
        part_out,
        part_lse,
        arrivals,
        q_nope,
        q_pe,
        kv_cache,
        block_table,
        seq_lens,
        query_start_loc,
        scale * _LOG2E,
        num_splits,
        q_nope.stride(0),
        q_nope.stride(1),
        q_pe.stride(0),
        q_pe.stride(1),
        output.stride(0),
        output.stride(1),
        kv_cache.stride(0),
        kv_cache.stride(1),
        block_table.stride(0),
        NUM_HEADS=num_heads,
        RANK=rank,
        ROPE=rope,
        RANK_PAD=rank_pad,
        ROPE_PAD=max(16, triton.next_power_of_2(rope)),
        BLOCK_SIZE=kv_cache.shape[1],
        BLOCK_H=config.block_h,
        TILE=config.tile,
        BLOCK_V=config.block_v,
        SWAP=bool(config.swap),
        PAGE_TILE=bool(config.page_tile),
        USE_SPLITS=use_splits,
        SPLITS_PAD=max(2, triton.next_power_of_2(num_splits)),
        DOT_F32=dot_f32,
        DOT_PRECISION="ieee" if dot_f32 else "tf32",
        num_warps=config.num_warps,
        num_stages=config.num_stages,
        **({"maxnreg": maxnreg} if maxnreg is not None and not interpreting() else {}),
        **launch_options(q_nope.device),
    )
