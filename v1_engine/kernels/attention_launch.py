"""Paged attention's host side (kernels/triton_attention.py): the launch decisions (split-KV
factor, tile and warps per step shape, the `launch` overrides; `plan_launch` makes them all for
a step), the argument checks, and the FLOP count benchmarks use. Plain python over ints and
tensor metadata; nothing here launches or reads a device tensor."""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache

import torch

from v1_engine.kernels import interpreting

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
FP8_CACHE_DTYPE = torch.float8_e4m3fn


@lru_cache(maxsize=8)
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def target_programs(device: torch.device, per_sm: int = 2) -> int:
    """Programs that keep the device busy: `per_sm` on each SM on a GPU (as many as fit one:
    two for the decode kernels here and MLA's 16-head tiles), a token amount elsewhere."""
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        return per_sm * _num_sms(index)
    return 8


def choose_num_splits(
    num_programs: int, max_query_len: int, max_seq_len: int, tile: int, target_programs: int
) -> int:
    """How many pieces to cut each q-block's KV range into (a power of two, 1 = no split).

    Splitting pays when the (q-block, kv head) programs cannot fill the device and each piece
    still gets several tiles of keys; prefill-heavy steps already have enough programs.
    """
    if max_query_len > 16 or num_programs >= target_programs:
        return 1
    by_occupancy = -(-target_programs // max(num_programs, 1))
    by_length = max_seq_len // (4 * tile)
    splits = min(by_occupancy, by_length, 64)
    if splits < 2:
        return 1
    return 1 << (splits.bit_length() - 1)


def launch_config(
    dtype: torch.dtype, head_pad: int, group_pad: int, max_query_len: int
) -> tuple[int, int, int]:
    """(BLOCK_M, TILE, num_warps) for this step's shape."""
    wide = dtype != torch.float32 and head_pad <= 128
    if max_query_len <= 16:  # decode-like: few query rows per program
        block_m = max(16, group_pad * min(max_query_len, 4))
        block_m = 1 << (block_m - 1).bit_length()
        return block_m, 64 if wide else 32, 4
    if wide:  # prefill 4k on the H200: 64 x 64 with 4 warps 313 TFLOP/s, 128 x 64 with 8: 293
        return max(64, group_pad), 64, 4
    return max(64, group_pad), 32, 4


SPLIT_DECODE_TILE = 32
"""Key tile of a latency-bound decode step: one whose (q-block, kv head) programs fill at most a
quarter of the device (batch <= 8 at 8 kv heads on the H200), so each split-KV piece is short
and its critical path is what counts. H200, Llama-3-8B heads, same-call A/Bs (RESULTS "Decode
attention tile by occupancy"): batch 1 4.120 -> 4.099 ms a step with 32-row tiles (4.095 -> 4.066
with graphs captured for max_model_len 8192). Bandwidth-bound steps keep the wide tile: batch 64
at 1k context went 6.953 -> 7.213 ms with 32-row tiles; batches 16-32 are not measured with
them, so they stay on the wide tile too."""


def split_decode_tile(tile: int, max_query_len: int, programs: int, target_programs: int) -> int:
    """The key tile for this step: SPLIT_DECODE_TILE for a decode-like step whose programs fill
    at most a quarter of `target_programs`, when `tile` is wider; `tile` otherwise."""
    if max_query_len <= 16 and 4 * programs <= target_programs:
        return min(tile, SPLIT_DECODE_TILE)
    return tile


FUSED_MERGE_MAX_SPLITS = 8
"""Split-KV pieces are merged in the attention launch (the last piece of a q-block and kv head
to arrive merges them, MERGE_CHUNK pieces a trip) up to this many splits, by a second kernel
above it (one program a (token, head), every piece in one load). H100, bf16 Llama-3-8B heads,
decode graphs captured for 8192 (`sweep_attention.py --graph-len 8192`, us; benchmarks/
RESULTS.md, "Split-KV merge in the launch"): 32 splits (batch 1) 1 x 1k 13.5 in the launch
vs 6.7, 1 x 4k 18.2 vs 11.5; 16 (batch 2) 2 x 1k 11.9 vs 9.0; 8 (batch 4) 4 x 4k 40.4 vs 45.6;
4 (batch 8) 8 x 1k 20.1 vs 26.0, 8 x 4k 69.6 vs 84.2; 2 (batch 16 / 32) 16 x 4k 106.9 vs 103.5,
32 x 4k 187.8 vs 190.2."""


def fused_merge_for(num_splits: int, launch: dict[str, int] | None) -> bool:
    """Whether a split launch merges its pieces itself: `launch["fused_merge"]` where given,
    else up to FUSED_MERGE_MAX_SPLITS splits."""
    if launch and "fused_merge" in launch:
        return bool(launch["fused_merge"])
    return num_splits <= FUSED_MERGE_MAX_SPLITS


LAUNCH_KEYS = ("block_m", "tile", "num_warps", "num_stages", "maxnreg", "fused_merge")
"""Keys `paged_attention`'s `launch` may override."""


@dataclass(frozen=True)
class AttentionLaunch:
    """How `paged_attention` launches a step (`plan_launch`)."""

    block_m: int
    """Rows of a program's tile: BLOCK_Q tokens x the padded GQA group."""
    block_q: int
    """Query tokens a program owns (a q-block)."""
    tile: int
    """Keys per loop step."""
    num_warps: int
    num_stages: int
    num_q_blocks: int
    """The grid's first dimension: an upper bound on the step's q-blocks."""
    num_splits: int
    """Split-KV pieces of each q-block's key range (1 = no split)."""
    fused_merge: bool
    """Whether the split pieces merge in the launch (False without a split)."""
    options: dict[str, int] = field(default_factory=dict)
    """Further compiler options of the launch (maxnreg)."""


def plan_launch(
    dtype: torch.dtype,
    num_tokens: int,
    num_reqs: int,
    num_kv_heads: int,
    group_pad: int,
    head_pad: int,
    max_query_len: int,
    max_seq_len: int,
    target_programs: int,
    num_splits: int | None = None,
    launch: dict[str, int] | None = None,
) -> AttentionLaunch:
    """The launch of one `paged_attention` step: `launch_config`'s defaults and 2 stages, with
    `launch`'s overrides (LAUNCH_KEYS; block_m is at least the padded group; maxnreg is dropped
    under the interpreter); the split-KV factor `num_splits`, or where None the heuristic's for
    `target_programs` (with a decode step's narrower key tile unless `launch` sets the tile).
    ValueError for an unknown launch key or num_splits < 1."""
    block_m, tile, num_warps = launch_config(dtype, head_pad, group_pad, max_query_len)
    num_stages = 2
    options = {}
    if launch:
        unknown = set(launch) - set(LAUNCH_KEYS)
        if unknown:
            raise ValueError(f"launch keys must be among {LAUNCH_KEYS}; got {sorted(unknown)}")
        block_m = max(launch.get("block_m", block_m), group_pad)
        tile = launch.get("tile", tile)
        num_warps = launch.get("num_warps", num_warps)
        num_stages = launch.get("num_stages", num_stages)
        if launch.get("maxnreg") is not None and not interpreting():
            options["maxnreg"] = launch["maxnreg"]
    block_q = block_m // group_pad
    num_q_blocks = num_tokens // block_q + num_reqs
    if num_splits is None:
        useful_programs = min(num_q_blocks, num_reqs * -(-max_query_len // block_q)) * num_kv_heads
        if not (launch and "tile" in launch):
            tile = split_decode_tile(tile, max_query_len, useful_programs, target_programs)
        num_splits = choose_num_splits(
            useful_programs, max_query_len, max_seq_len, tile, target_programs
        )
    if num_splits < 1:
        raise ValueError(f"num_splits must be >= 1, got {num_splits}")
    fused_merge = num_splits > 1 and fused_merge_for(num_splits, launch)
    return AttentionLaunch(
        block_m=block_m,
        block_q=block_q,
        tile=tile,
        num_warps=num_warps,
        num_stages=num_stages,
        num_q_blocks=num_q_blocks,
        num_splits=num_splits,
        fused_merge=fused_merge,
        options=options,
    )


def check_args(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    output: torch.Tensor,
) -> None:
    """Raises ValueError naming the argument whose shape, dtype or device does not fit."""
    if query.dim() != 3:
        raise ValueError(f"query must be [num_tokens, num_heads, head_size], got {query.shape}")
    if kv_cache.dim() != 5 or kv_cache.shape[0] != 2 or kv_cache.stride(4) != 1:
        raise ValueError(
            "kv_cache must be a [2, num_blocks, block_size, num_kv_heads, head_size] tensor "
            f"with a unit last stride, got shape {tuple(kv_cache.shape)} strides "
            f"{kv_cache.stride()}"
        )
    num_heads, head_size = query.shape[1], query.shape[2]
    num_kv_heads = kv_cache.shape[3]
    if kv_cache.shape[4] != head_size or num_heads % num_kv_heads != 0:
        raise ValueError(
            f"query heads/size ({num_heads}, {head_size}) do not fit kv_cache's "
            f"({num_kv_heads}, {kv_cache.shape[4]}): heads must be a multiple of kv heads"
        )
    if query.dtype not in SUPPORTED_DTYPES or kv_cache.dtype not in (query.dtype, FP8_CACHE_DTYPE):
        raise ValueError(
            f"query dtype must be one of {SUPPORTED_DTYPES} and kv_cache's the same or "
            f"{FP8_CACHE_DTYPE}, got {query.dtype} and {kv_cache.dtype}"
        )
    if output.shape != query.shape or output.dtype != query.dtype or output.stride(2) != 1:
        raise ValueError(
            f"output must be {tuple(query.shape)} {query.dtype} with a unit last stride, got "
            f"{tuple(output.shape)} {output.dtype}"
        )
    check_paged_metadata(block_table, seq_lens, query_start_loc, query.device, "query")
    if kv_cache.device != query.device:
        raise ValueError(f"kv_cache is on {kv_cache.device}, query on {query.device}")


def check_paged_metadata(
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    device: torch.device,
    anchor: str,
) -> None:
    """Raises ValueError unless the step's paging metadata is int32 on `device` (where the
    argument named `anchor` lives), with a block table of contiguous rows and num_reqs + 1 query
    starts: what every paged kernel here reads."""
    for name, tensor in (
        ("block_table", block_table),
        ("seq_lens", seq_lens),
        ("query_start_loc", query_start_loc),
    ):
        if tensor.dtype != torch.int32:
            raise ValueError(f"{name} must be int32, got {tensor.dtype}")
        if tensor.device != device:
            raise ValueError(f"{name} is on {tensor.device}, {anchor} on {device}")
    if block_table.dim() != 2 or block_table.stride(1) != 1:
        raise ValueError("block_table must be a 2-D tensor with contiguous rows")
    if query_start_loc.shape[0] != seq_lens.shape[0] + 1:
        raise ValueError(
            f"query_start_loc must have num_reqs + 1 = {seq_lens.shape[0] + 1} entries, got "
            f"{query_start_loc.shape[0]}"
        )


def attention_flops(query_lens: list[int], seq_lens: list[int], num_heads: int, head: int) -> int:
    """Multiply-add FLOPs of causal attention (QK^T and PV) for the given request shapes."""
    total = 0
    for q_len, s_len in zip(query_lens, seq_lens):
        context = s_len - q_len
        visible = q_len * context + q_len * (q_len + 1) // 2
        total += 4 * visible * num_heads * head
    return total
