"""Host-side decisions of the Triton MLA decode kernel (kernels/triton_mla.py): its measured
default launch, the split-KV factor, the argument checks, and the bytes a step must read (the
benchmarks' roofline). Kept apart from the kernels, as skinny_tuned.py is from the skinny GEMM."""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from v1_engine.kernels.attention_launch import check_paged_metadata, target_programs

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
    """The default launch of the decode kernel for `num_heads` query heads, from sweeps on the
    H200 (batch 64 x 4k context, bf16, block size 64; benchmarks/RESULTS.md, "MLA decode:
    unmasked page-tiled steps, merge in the kernel", 2026-12-03): up to 16 heads one head tile
    streams 32 tokens of one cache block per step in the plain form, with 4 warps and 3 stages
    (two latent buffers); more heads take tiles of 64 heads (fewer re-reads of each latent), 64
    tokens of one cache block per step, 8 warps and 2 stages (two 64 x 576 buffers; 3 no longer
    fit the shared memory). A block size that the tile does not divide drops page_tile."""
    if dot_f32:
        return LaunchConfig(block_h=16, tile=16, num_warps=4, num_stages=2)
    if num_heads <= 16:
        return LaunchConfig(block_h=16, tile=32, num_warps=4, num_stages=3, page_tile=True)
    return LaunchConfig(block_h=64, tile=64, num_warps=8, num_stages=2, page_tile=True)


def choose_num_splits(
    num_programs: int, max_seq_len: int, tile: int, target_programs: int, max_splits: int = 32
) -> int:
    """Split-KV factor (a power of two, 1 = none): the most whole copies of the programs that fit
    in `target_programs` (rounded down: 128 programs on 132 slots stay unsplit, where a split's
    merge would cost more than the 4 idle slots), while each split keeps at least four tiles of
    keys."""
    by_occupancy = target_programs // max(num_programs, 1)
    by_length = max_seq_len // (4 * tile)
    splits = min(by_occupancy, by_length, max_splits)
    if splits < 2:
        return 1
    return 1 << (splits.bit_length() - 1)


@dataclass(frozen=True)
class MlaLaunch:
    """One step's launch: the config with the caller's overrides applied and checked, the
    output's latent dims padded to a power of two, and the grid they give."""

    config: LaunchConfig
    rank_pad: int
    num_head_tiles: int
    num_v_slices: int
    num_splits: int


def plan_launch(
    num_heads: int,
    rank: int,
    block_size: int,
    num_reqs: int,
    max_seq_len: int,
    dot_f32: bool,
    device: torch.device,
    num_splits: int | None = None,
    **overrides: int | bool | None,
) -> MlaLaunch:
    """`launch_config`'s default for the shape with the `overrides` that are not None applied
    (LaunchConfig's fields). Defaults that do not fit the shape fall back to the plain form
    (block_v capped at the padded rank, page_tile dropped where the tile does not divide the
    cache block); an override that does not fit raises ValueError naming it and what it allows.
    `num_splits` None picks the split-KV factor from the programs and `max_seq_len`."""
    default = launch_config(num_heads, dot_f32)
    chosen = {key: value for key, value in overrides.items() if value is not None}
    rank_pad = max(16, 1 << (rank - 1).bit_length())
    tile = chosen.get("tile", default.tile)
    chosen.setdefault("block_v", min(default.block_v or rank_pad, rank_pad))
    chosen.setdefault("page_tile", default.page_tile and block_size % tile == 0)
    config = replace(default, **chosen)
    if config.block_h < 16 or config.block_h & (config.block_h - 1):
        raise ValueError(f"block_h must be a power of two >= 16, got {config.block_h}")
    if config.tile < 16 or config.tile & (config.tile - 1):
        raise ValueError(f"tile must be a power of two >= 16, got {config.tile}")
    block_v = config.block_v
    if block_v < 16 or block_v & (block_v - 1) or block_v > rank_pad:
        raise ValueError(
            f"block_v must be a power of two in [16, {rank_pad}] (kv_lora_rank {rank} rounded "
            f"up), got {block_v}"
        )
    if config.page_tile and block_size % config.tile:
        raise ValueError(
            f"page_tile needs tile ({config.tile}) to divide the cache block size ({block_size})"
        )
    num_head_tiles = -(-num_heads // config.block_h)
    num_v_slices = rank_pad // block_v
    if num_splits is None:
        # A 16-head program's latent buffers take ~93 KB (two fit an SM), a 64-head one's
        # ~220 KB (one does).
        per_sm = 2 if config.block_h * config.tile <= 16 * 64 else 1
        num_splits = choose_num_splits(
            num_reqs * num_head_tiles * num_v_slices,
            max_seq_len,
            config.tile,
            target_programs(device, per_sm),
        )
    if num_splits < 1:
        raise ValueError(f"num_splits must be >= 1, got {num_splits}")
    return MlaLaunch(config, rank_pad, num_head_tiles, num_v_slices, num_splits)


def check_args(
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
