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
its output normalised by its own softmax sum plus its log-sum-exp, and a second kernel merges
the pieces per (request, head).

Only decode requests (query length 1) are served: a program whose request has another query
length returns at once, so a mixed batch can be passed as is (prefill chunks go through the
expanded form elsewhere). Everything per request comes from device tensors (query_start_loc,
seq_lens, block_table); the host passes only python ints, so a launch can be captured in a CUDA
graph.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch
import triton
import triton.language as tl

from v1_engine.kernels import interpreting
from v1_engine.kernels.pdl import launch_options, pdl_enter, pdl_release, pdl_wait
from v1_engine.kernels.triton_attention import check_paged_metadata

_LOG2E = 1.4426950408889634
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@dataclass(frozen=True)
class LaunchConfig:
    block_h: int
    """Heads per program (the M of the score dot; 16 is the smallest a tensor-core dot takes)."""
    tile: int
    """Cached tokens per loop iteration."""
    num_warps: int
    num_stages: int
    swap: bool = False
    """Transposed dots: tokens and latent dims as the dots' M, heads as their N."""
    block_v: int | None = None
    """Latent (value) dims of the output per program; None = all of them."""
    page_tile: bool = False
    """One cache block per loop step (TILE divides the block size): one block id per step."""


def launch_config(num_heads: int, dot_f32: bool) -> LaunchConfig:
    """The default launch of the decode kernel for `num_heads` query heads, from a sweep on the
    H200 with the cache rows looked up a step early (batch 64 x 4k context, bf16, block size
    64; benchmarks/RESULTS.md "MLA decode: cache rows looked up a step early", 2026-12-03): up
    to 16 heads one head tile streams 32 tokens per step in the plain form, with 4 warps and 3
    stages (101 us, 70% of HBM; the transposed form 105 us); more heads take tiles of 64 heads
    (fewer re-reads of each latent), 64 tokens of one cache block per step, 8 warps and 2
    stages (two 64 x 576 buffers; 3 no longer fit the shared memory)."""
    if dot_f32:
        return LaunchConfig(block_h=16, tile=16, num_warps=4, num_stages=2)
    if num_heads <= 16:
        return LaunchConfig(block_h=16, tile=32, num_warps=4, num_stages=3)
    return LaunchConfig(block_h=64, tile=64, num_warps=8, num_stages=2, page_tile=True)


@triton.jit
def _cache_rows(
    table_row,
    cache_ptr,
    tile,
    offs_t,
    seq_len,
    stride_cb,
    stride_cs,
    BLOCK_SIZE: tl.constexpr,
    TILE: tl.constexpr,
    PAGE_TILE: tl.constexpr,
):
    """Row pointers of the cache entries of loop step `tile` (its TILE token positions)."""
    if PAGE_TILE:
        # tile < num_tiles, so the step's first token is cached and its block id is valid.
        block_id = tl.load(table_row + tile * TILE // BLOCK_SIZE).to(tl.int64)
        slots = (tile * TILE % BLOCK_SIZE + offs_t).to(tl.int64)
        return cache_ptr + block_id * stride_cb + slots * stride_cs
    pos = tile * TILE + offs_t
    block_id = tl.load(table_row + pos // BLOCK_SIZE, mask=pos < seq_len, other=0).to(tl.int64)
    return cache_ptr + block_id * stride_cb + (pos % BLOCK_SIZE).to(tl.int64) * stride_cs


@triton.jit(do_not_specialize=["num_splits"])
def _mla_decode_kernel(
    out_ptr,
    part_out_ptr,
    part_lse_ptr,
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

    num_tiles = tl.cdiv(seq_len, TILE)
    if USE_SPLITS:
        tiles_per_split = tl.cdiv(num_tiles, num_splits)
        tile_lo = split * tiles_per_split
        tile_hi = tl.minimum(tile_lo + tiles_per_split, num_tiles)
    else:
        tile_lo = 0
        tile_hi = num_tiles

    # A finite initial max keeps exp2(m_i - m_new) finite for splits that see no key.
    m_i = tl.full([BLOCK_H], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    if SWAP:
        acc = tl.zeros([BLOCK_V, BLOCK_H], dtype=tl.float32)
    else:
        acc = tl.zeros([BLOCK_H, BLOCK_V], dtype=tl.float32)
    offs_t = tl.arange(0, TILE)
    table_row = block_table_ptr + req.to(tl.int64) * stride_bt
    # A step's cache rows are looked up one step early (loop-carried; an empty split looks up a
    # valid step, never used). With the lookup inside the step Triton's pipeliner spent a stage
    # on the block-id -> latent chain and left one latent buffer; now every stage is one
    # (test_pipelining.py). As in paged attention, the compiled loop may still order a step's
    # copies after the same iteration's table load.
    next_row = _cache_rows(
        table_row, cache_ptr, tl.maximum(tl.minimum(tile_lo, num_tiles - 1), 0), offs_t,
        seq_len, stride_cb, stride_cs, BLOCK_SIZE, TILE, PAGE_TILE,
    )  # fmt: skip
    for tile in range(tile_lo, tile_hi):
        pos = tile * TILE + offs_t
        pos_valid = pos < seq_len
        row = next_row
        next_row = _cache_rows(
            table_row, cache_ptr, tl.minimum(tile + 1, tile_hi - 1), offs_t, seq_len, stride_cb,
            stride_cs, BLOCK_SIZE, TILE, PAGE_TILE,
        )  # fmt: skip
        latent = tl.load(
            row[:, None] + dims[None, :], mask=pos_valid[:, None] & dim_valid[None, :], other=0.0
        )
        k_pe = tl.load(
            row[:, None] + RANK + rope_dims[None, :],
            mask=pos_valid[:, None] & rope_valid[None, :],
            other=0.0,
        )
        if DOT_F32:
            latent = latent.to(tl.float32)
            k_pe = k_pe.to(tl.float32)
        if BLOCK_V == RANK_PAD:
            latent_v = latent
        else:
            latent_v = tl.load(
                row[:, None] + v_dims[None, :],
                mask=pos_valid[:, None] & v_valid[None, :],
                other=0.0,
            )
            if DOT_F32:
                latent_v = latent_v.to(tl.float32)
        if SWAP:
            scores = tl.dot(latent, tl.trans(q_nope), input_precision=DOT_PRECISION)
            scores = tl.dot(k_pe, tl.trans(q_pe), acc=scores, input_precision=DOT_PRECISION)
            scores = tl.where(pos_valid[:, None], scores * scale_log2, float("-inf"))
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
            scores = tl.where(pos_valid[None, :], scores * scale_log2, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(scores, 1))
            p = tl.exp2(scores - m_new[:, None])
            alpha = tl.exp2(m_i - m_new)
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None]
            acc = tl.dot(p.to(latent_v.dtype), latent_v, acc=acc, input_precision=DOT_PRECISION)
        m_i = m_new

    pdl_release(PDL)
    if SWAP:
        acc = tl.trans(acc)
    result = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
    if USE_SPLITS:
        # Partials: out [num_reqs, NUM_HEADS, num_splits, RANK_PAD] (this program's value slice)
        # and lse [.., num_splits] (log2).
        stat_off = (req.to(tl.int64) * NUM_HEADS + heads) * num_splits + split
        if v_slice == 0:  # every value slice computes the same lse; one writes it
            lse = tl.where(l_i > 0.0, m_i + tl.log2(tl.where(l_i > 0.0, l_i, 1.0)), float("-inf"))
            tl.store(part_lse_ptr + stat_off, lse, mask=head_valid)
        tl.store(
            part_out_ptr + stat_off[:, None] * RANK_PAD + v_dims[None, :],
            result,
            mask=head_valid[:, None],
        )
    else:
        tl.store(
            out_ptr + token * stride_ot + heads[:, None] * stride_oh + v_dims[None, :],
            result.to(out_ptr.dtype.element_ty),
            mask=head_valid[:, None] & v_valid[None, :],
        )


@triton.jit(do_not_specialize=["num_splits"])
def _mla_merge_kernel(
    out_ptr,
    part_out_ptr,
    part_lse_ptr,
    query_start_loc_ptr,
    num_splits,
    stride_ot,
    stride_oh,
    NUM_HEADS: tl.constexpr,
    RANK: tl.constexpr,
    RANK_PAD: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
    PDL: tl.constexpr,
):
    """out[token, h] = sum_s 2^(lse_s - max lse) * o_s / sum_s 2^(lse_s - max lse)."""
    pdl_enter(PDL)
    req = tl.program_id(0)
    head = tl.program_id(1)
    q_start = tl.load(query_start_loc_ptr + req)
    if tl.load(query_start_loc_ptr + req + 1) - q_start != 1:
        return
    splits = tl.arange(0, SPLITS_PAD)
    stat_base = (req.to(tl.int64) * NUM_HEADS + head) * num_splits
    lse = tl.load(part_lse_ptr + stat_base + splits, mask=splits < num_splits, other=float("-inf"))
    lse_max = tl.max(lse, 0)
    weights = tl.exp2(lse - lse_max)
    total = tl.sum(weights, 0)
    dims = tl.arange(0, RANK_PAD)
    acc = tl.zeros([RANK_PAD], dtype=tl.float32)
    for s in range(num_splits):
        weight = tl.exp2(tl.load(part_lse_ptr + stat_base + s) - lse_max)
        acc += weight * tl.load(part_out_ptr + (stat_base + s) * RANK_PAD + dims)
    tl.store(
        out_ptr + q_start.to(tl.int64) * stride_ot + head * stride_oh + dims,
        (acc / total).to(out_ptr.dtype.element_ty),
        mask=dims < RANK,
    )


@lru_cache(maxsize=8)
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def choose_num_splits(
    num_programs: int, max_seq_len: int, tile: int, target_programs: int, max_splits: int = 32
) -> int:
    """Split-KV factor (a power of two, 1 = none): enough programs to fill `target_programs`,
    while each split keeps at least four tiles of keys."""
    if num_programs >= target_programs:
        return 1
    by_occupancy = -(-target_programs // max(num_programs, 1))
    by_length = max_seq_len // (4 * tile)
    splits = min(by_occupancy, by_length, max_splits)
    if splits < 2:
        return 1
    return 1 << (splits.bit_length() - 1)


def _target_programs(device: torch.device) -> int:
    """Programs that keep the device's memory pipes full: two per SM on a GPU (the sweep's best
    split count at batch 64 x 4k gives about that many)."""
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        return 2 * _num_sms(index)
    return 8


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
    _check_args(q_nope, q_pe, kv_cache, block_table, seq_lens, query_start_loc, output)
    num_reqs = seq_lens.shape[0]
    num_heads, rank = q_nope.shape[1], q_nope.shape[2]
    rope = q_pe.shape[2]
    if q_nope.shape[0] == 0 or num_reqs == 0:
        return
    dot_f32 = q_nope.dtype == torch.float32 or (interpreting() and q_nope.dtype == torch.bfloat16)
    default = launch_config(num_heads, dot_f32)
    block_h = default.block_h if block_h is None else block_h
    tile = default.tile if tile is None else tile
    num_warps = default.num_warps if num_warps is None else num_warps
    num_stages = default.num_stages if num_stages is None else num_stages
    swap = default.swap if swap is None else swap
    rank_pad = max(16, triton.next_power_of_2(rank))
    # Defaults that do not fit this shape fall back to the plain form; overrides must fit.
    if block_v is None:
        block_v = min(default.block_v or rank_pad, rank_pad)
    if page_tile is None:
        page_tile = default.page_tile and kv_cache.shape[1] % tile == 0
    if block_h < 16 or block_h & (block_h - 1):
        raise ValueError(f"block_h must be a power of two >= 16, got {block_h}")
    if tile < 16 or tile & (tile - 1):
        raise ValueError(f"tile must be a power of two >= 16, got {tile}")
    if block_v < 16 or block_v & (block_v - 1) or block_v > rank_pad:
        raise ValueError(
            f"block_v must be a power of two in [16, {rank_pad}] (kv_lora_rank {rank} rounded "
            f"up), got {block_v}"
        )
    if page_tile and kv_cache.shape[1] % tile:
        raise ValueError(
            f"page_tile needs tile ({tile}) to divide the cache block size ({kv_cache.shape[1]})"
        )
    num_head_tiles = triton.cdiv(num_heads, block_h)
    num_v_slices = rank_pad // block_v
    if num_splits is None:
        num_splits = choose_num_splits(
            num_reqs * num_head_tiles * num_v_slices,
            max_seq_len,
            tile,
            _target_programs(q_nope.device),
        )
    if num_splits < 1:
        raise ValueError(f"num_splits must be >= 1, got {num_splits}")
    use_splits = num_splits > 1
    if use_splits:
        part_out = torch.empty(
            (num_reqs, num_heads, num_splits, rank_pad), dtype=torch.float32, device=q_nope.device
        )
        part_lse = torch.empty(
            (num_reqs, num_heads, num_splits), dtype=torch.float32, device=q_nope.device
        )
    else:
        part_out = part_lse = output  # unused by the kernel
    _mla_decode_kernel[(num_head_tiles * num_v_slices, num_reqs, num_splits)](
        output,
        part_out,
        part_lse,
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
        BLOCK_H=block_h,
        TILE=tile,
        BLOCK_V=block_v,
        SWAP=bool(swap),
        PAGE_TILE=bool(page_tile),
        USE_SPLITS=use_splits,
        DOT_F32=dot_f32,
        DOT_PRECISION="ieee" if dot_f32 else "tf32",
        num_warps=num_warps,
        num_stages=num_stages,
        **({"maxnreg": maxnreg} if maxnreg is not None and not interpreting() else {}),
        **launch_options(q_nope.device),
    )
    if use_splits:
        _mla_merge_kernel[(num_reqs, num_heads)](
            output,
            part_out,
            part_lse,
            query_start_loc,
            num_splits,
            output.stride(0),
            output.stride(1),
            NUM_HEADS=num_heads,
            RANK=rank,
            RANK_PAD=rank_pad,
            SPLITS_PAD=max(2, triton.next_power_of_2(num_splits)),
            num_warps=4,
            **launch_options(q_nope.device),
        )


def _check_args(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    output: torch.Tensor,
) -> None:
    """Raises ValueError naming the argument whose shape, dtype or device does not fit."""
    if q_nope.dim() != 3 or q_pe.dim() != 3 or q_pe.shape[:2] != q_nope.shape[:2]:
        raise ValueError(
            f"q_nope must be [T, H, kv_lora_rank] and q_pe [T, H, rope_dim], got "
            f"{tuple(q_nope.shape)} and {tuple(q_pe.shape)}"
        )
    rank, rope = q_nope.shape[2], q_pe.shape[2]
    if kv_cache.dim() != 3 or kv_cache.shape[2] != rank + rope or kv_cache.stride(2) != 1:
        raise ValueError(
            f"kv_cache must be [num_blocks, block_size, {rank + rope}] with a unit last stride, "
            f"got {tuple(kv_cache.shape)}"
        )
    if q_nope.dtype not in SUPPORTED_DTYPES or {q_pe.dtype, kv_cache.dtype} != {q_nope.dtype}:
        raise ValueError(
            f"q_nope, q_pe and kv_cache dtypes must match and be one of {SUPPORTED_DTYPES}, got "
            f"{q_nope.dtype}, {q_pe.dtype} and {kv_cache.dtype}"
        )
    if q_nope.stride(2) != 1 or q_pe.stride(2) != 1:
        raise ValueError("q_nope and q_pe must have a unit last stride")
    if output.shape != q_nope.shape or output.dtype != q_nope.dtype or output.stride(2) != 1:
        raise ValueError(
            f"output must be {tuple(q_nope.shape)} {q_nope.dtype} with a unit last stride, got "
            f"{tuple(output.shape)} {output.dtype}"
        )
    for name, tensor in (("kv_cache", kv_cache), ("output", output)):
        if tensor.device != q_nope.device:
            raise ValueError(f"{name} is on {tensor.device}, q_nope on {q_nope.device}")
    check_paged_metadata(block_table, seq_lens, query_start_loc, q_nope.device, "q_nope")


def mla_decode_bytes(seq_lens: list[int], rank: int, rope: int, elem: int) -> int:
    """Latent-cache bytes one decode step must read: every cached entry once."""
    return sum(seq_lens) * (rank + rope) * elem
