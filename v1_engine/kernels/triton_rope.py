"""Rotary position embedding of query and key in one Triton kernel: the CUDA body of the
`v1_engine::rotary_embedding` op (layers/rotary.py).

Inductor lowers the PyTorch rotary to four kernels per layer (a cos gather, a sin gather, then
one rotation each for query and key); at decode sizes their launches and gaps cost more than
the data they move. Here one launch covers both: the grid is (token, head block), the head
blocks of the query first and then those of the key, and each program gathers its token's cos
and sin rows from the float32 tables itself.

Layouts: query [T, Hq, D] and key [T, Hkv, D] may be any strided views (slices of the fused QKV
GEMM output); the outputs are new contiguous tensors of the same shapes and dtype. Both styles
store the rotated first elements of the pairs in [0, D/2) and the rotated second elements in
[D/2, D): for the neox style the pairs are (i, i + D/2), so the layout is unchanged; for the
interleaved style the pairs are (2i, 2i + 1), so the output is the evens followed by the odds
(the permutation the reference applies to query and key alike).

Numerics: the rotation is computed in float32 and rounded once to the output dtype. In the neox
style cos and sin are first rounded to the query dtype, as the reference (and the models it
follows) does, so in float32 and after the final rounding the result matches the compiled
reference up to fused multiply-adds (one fp32 ulp before rounding); eager bf16/fp16 rounds each
product and the sum separately, so it differs from this by about one ulp of the model dtype. The
interleaved style uses the float32 tables as they are, like its reference.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from v1_engine.kernels.pdl import launch_options, pdl_enter

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

PAIRS_PER_PROGRAM = 256
"""Target rotation pairs per program: 4 heads of 128 per program, so a Llama-3-8B decode token
(32 query + 8 key heads) spreads over 10 programs instead of one SM."""


@triton.jit
def _rotate_head_block(
    src_ptr,
    dst_ptr,
    head0,
    num_heads,
    stride_h,
    stride_d,
    cos,
    sin,
    pairs,
    pair_ok,
    HALF: tl.constexpr,
    HEAD_BLOCK: tl.constexpr,
    IS_NEOX: tl.constexpr,
):
    """Rotate heads [head0, head0 + HEAD_BLOCK) of one token: src is the token's first element
    (strided), dst its contiguous output row of num_heads * 2 * HALF elements."""
    heads = head0 + tl.arange(0, HEAD_BLOCK)
    mask = (heads < num_heads)[:, None] & pair_ok[None, :]
    if IS_NEOX:
        first = pairs
        second = pairs + HALF
    else:
        first = 2 * pairs
        second = 2 * pairs + 1
    rows = src_ptr + heads[:, None].to(tl.int64) * stride_h
    x1 = tl.load(rows + first[None, :] * stride_d, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(rows + second[None, :] * stride_d, mask=mask, other=0.0).to(tl.float32)
    out1 = x1 * cos[None, :] - x2 * sin[None, :]
    out2 = x2 * cos[None, :] + x1 * sin[None, :]
    out_rows = dst_ptr + heads[:, None].to(tl.int64) * (2 * HALF)
    out_ty = dst_ptr.dtype.element_ty
    tl.store(out_rows + pairs[None, :], out1.to(out_ty), mask=mask)
    tl.store(out_rows + HALF + pairs[None, :], out2.to(out_ty), mask=mask)


@triton.jit
def rope_dims(dims, HALF: tl.constexpr, IS_NEOX: tl.constexpr):
    """For each output index d of a rotated head (this module's layout: rotated first elements
    of the pairs in [0, HALF), second elements in [HALF, 2 HALF)): the index of the input
    element it starts from, the index of its pair partner, its pair, and whether it is a first
    element. Consumers that rotate a whole head row at once (the decode attention kernel)
    gather the row twice with these and call `rotate_rows`."""
    first = dims < HALF
    pair = tl.where(first, dims, dims - HALF)
    if IS_NEOX:
        src = dims
        partner = tl.where(first, dims + HALF, dims - HALF)
    else:
        src = 2 * pair + tl.where(first, 0, 1)
        partner = 2 * pair + tl.where(first, 1, 0)
    return src, partner, pair, first


@triton.jit
def rope_tables(cos_ptr, sin_ptr, position, pair, valid, DTYPE: tl.constexpr,
                HALF: tl.constexpr, IS_NEOX: tl.constexpr):  # fmt: skip
    """The cos and sin of `position` for each pair index, in float32 (the neox style rounds
    them to the model dtype first, as `_rope_kernel` does)."""
    cos = tl.load(cos_ptr + position * HALF + pair, mask=valid, other=0.0)
    sin = tl.load(sin_ptr + position * HALF + pair, mask=valid, other=0.0)
    if IS_NEOX:
        cos = cos.to(DTYPE).to(tl.float32)
        sin = sin.to(DTYPE).to(tl.float32)
    return cos, sin


@triton.jit
def rotate_rows(x_src, x_partner, cos, sin, first):
    """The rotated values, in float32, with `_rotate_head_block`'s expressions: for a first
    element x1 cos - x2 sin, for a second x2 cos + x1 sin."""
    x_src = x_src.to(tl.float32)
    x_partner = x_partner.to(tl.float32)
    return tl.where(first, x_src * cos - x_partner * sin, x_src * cos + x_partner * sin)


@triton.jit
def _copy_head_block(
    src_ptr,
    dst_ptr,
    head0,
    num_heads,
    stride_h,
    stride_d,
    HEAD: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    HEAD_BLOCK: tl.constexpr,
):
    """Copy heads [head0, head0 + HEAD_BLOCK) of one token from src (strided) to dst's
    contiguous row of num_heads * HEAD elements."""
    heads = head0 + tl.arange(0, HEAD_BLOCK)
    dims = tl.arange(0, HEAD_PAD)
    mask = (heads < num_heads)[:, None] & (dims < HEAD)[None, :]
    rows = src_ptr + heads[:, None].to(tl.int64) * stride_h
    values = tl.load(rows + dims[None, :] * stride_d, mask=mask, other=0.0)
    out_rows = dst_ptr + heads[:, None].to(tl.int64) * HEAD
    tl.store(out_rows + dims[None, :], values.to(dst_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rope_kernel(
    positions_ptr,
    q_ptr,
    k_ptr,
    q_out_ptr,
    k_out_ptr,
    cos_ptr,
    sin_ptr,
    num_q_heads,
    num_k_heads,
    q_stride_t,
    q_stride_h,
    q_stride_d,
    k_stride_t,
    k_stride_h,
    k_stride_d,
    v_ptr,
    v_cache_ptr,
    slot_mapping_ptr,
    v_stride_t,
    v_stride_h,
    v_stride_d,
    HALF: tl.constexpr,
    HALF_PAD: tl.constexpr,
    HEAD_BLOCK: tl.constexpr,
    IS_NEOX: tl.constexpr,
    CACHE: tl.constexpr,
    PDL: tl.constexpr,
):
    """Program (token, block): block < cdiv(Hq, HEAD_BLOCK) rotates query heads, the next
    cdiv(Hkv, HEAD_BLOCK) key heads; both use the token's cos/sin row, gathered here by its
    position. CACHE: the rotated key heads go to the token's slot of the paged key cache
    (k_out_ptr is the key cache, a slot's row of Hkv * D values contiguous), and the blocks after
    the key's copy the value heads to the value cache; a negative slot (padding) writes nothing."""
    pdl_enter(PDL)
    token = tl.program_id(0).to(tl.int64)
    block = tl.program_id(1)
    num_q_blocks = tl.cdiv(num_q_heads, HEAD_BLOCK)
    num_k_blocks = tl.cdiv(num_k_heads, HEAD_BLOCK)
    k_row_ptr = k_out_ptr + token * num_k_heads * (2 * HALF)
    write = True
    if CACHE:
        slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
        write = slot >= 0
        k_row_ptr = k_out_ptr + slot * num_k_heads * (2 * HALF)
        if block >= num_q_blocks + num_k_blocks:
            if write:
                _copy_head_block(
                    v_ptr + token * v_stride_t,
                    v_cache_ptr + slot * num_k_heads * (2 * HALF),
                    (block - num_q_blocks - num_k_blocks) * HEAD_BLOCK,
                    num_k_heads,
                    v_stride_h,
                    v_stride_d,
                    2 * HALF,
                    2 * HALF_PAD,
                    HEAD_BLOCK,
                )
            return
    position = tl.load(positions_ptr + token).to(tl.int64)
    pairs = tl.arange(0, HALF_PAD)
    pair_ok = pairs < HALF
    cos = tl.load(cos_ptr + position * HALF + pairs, mask=pair_ok, other=0.0)
    sin = tl.load(sin_ptr + position * HALF + pairs, mask=pair_ok, other=0.0)
    if IS_NEOX:
        # The reference casts the gathered table to the model dtype before rotating.
        cos = cos.to(q_out_ptr.dtype.element_ty).to(tl.float32)
        sin = sin.to(q_out_ptr.dtype.element_ty).to(tl.float32)
    if block < num_q_blocks:
        _rotate_head_block(
            q_ptr + token * q_stride_t,
            q_out_ptr + token * num_q_heads * (2 * HALF),
            block * HEAD_BLOCK,
            num_q_heads,
            q_stride_h,
            q_stride_d,
            cos,
            sin,
            pairs,
            pair_ok,
            HALF,
            HEAD_BLOCK,
            IS_NEOX,
        )
    elif write:
        _rotate_head_block(
            k_ptr + token * k_stride_t,
            k_row_ptr,
            (block - num_q_blocks) * HEAD_BLOCK,
            num_k_heads,
            k_stride_h,
            k_stride_d,
            cos,
            sin,
            pairs,
            pair_ok,
            HALF,
            HEAD_BLOCK,
            IS_NEOX,
        )


def _check_inputs(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    cos_cache: torch.Tensor,
    sin_cache: torch.Tensor,
) -> None:
    if query.dim() != 3 or key.dim() != 3:
        raise ValueError(
            f"query and key must be [T, H, D], got {tuple(query.shape)} and {tuple(key.shape)}"
        )
    if query.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"query dtype must be one of {SUPPORTED_DTYPES}, got {query.dtype}")
    if key.dtype != query.dtype:
        raise ValueError(f"key dtype must equal query dtype {query.dtype}, got {key.dtype}")
    head_size = query.shape[2]
    if head_size % 2 or key.shape[2] != head_size:
        raise ValueError(
            f"query and key head sizes must be equal and even, got {head_size} and {key.shape[2]}"
        )
    if positions.dim() != 1 or len({positions.shape[0], query.shape[0], key.shape[0]}) != 1:
        raise ValueError(
            f"positions [T], query [T, Hq, D] and key [T, Hkv, D] disagree on T: "
            f"{tuple(positions.shape)}, {tuple(query.shape)}, {tuple(key.shape)}"
        )
    if positions.dtype not in (torch.int32, torch.int64):
        raise ValueError(
            f"positions dtype must be torch.int32 or torch.int64, got {positions.dtype}"
        )
    for name, tensor in (("key", key), ("positions", positions), ("cos_cache", cos_cache)):
        if tensor.device != query.device:
            raise ValueError(f"{name} is on {tensor.device}, query on {query.device}")
    for name, table in (("cos_cache", cos_cache), ("sin_cache", sin_cache)):
        if table.dtype != torch.float32 or table.dim() != 2 or table.shape[1] != head_size // 2:
            raise ValueError(
                f"{name} must be float32 [max_position, {head_size // 2}], "
                f"got {table.dtype} {tuple(table.shape)}"
            )
        if table.device != query.device or not table.is_contiguous():
            raise ValueError(f"{name} must be contiguous and on {query.device}")


def rope_launch_config(num_heads: int, head_size: int) -> tuple[int, int]:
    """(heads per program, warps) for `num_heads` (the larger of Hq, Hkv) of `head_size`."""
    half_pad = triton.next_power_of_2(head_size // 2)
    head_block = max(1, min(triton.next_power_of_2(num_heads), PAIRS_PER_PROGRAM // half_pad))
    num_warps = 4 if head_block * half_pad >= 256 else 2
    return head_block, num_warps


def rotary_embedding(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    cos_cache: torch.Tensor,
    sin_cache: torch.Tensor,
    is_neox_style: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotated (query, key) as new contiguous tensors, in one kernel launch. Positions must lie
    in [0, max_position) (not checked: that would need a device-to-host sync)."""
    _check_inputs(positions, query, key, cos_cache, sin_cache)
    num_tokens, num_q_heads = query.shape[:2]
    num_k_heads = key.shape[1]
    q_out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    k_out = torch.empty(key.shape, dtype=key.dtype, device=key.device)
    if num_tokens == 0 or (num_q_heads == 0 and num_k_heads == 0):
        return q_out, k_out
    _launch(positions, query, key, q_out, k_out, cos_cache, sin_cache, is_neox_style, None)
    return q_out, k_out


def _launch(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    q_out: torch.Tensor,
    k_out: torch.Tensor,
    cos_cache: torch.Tensor,
    sin_cache: torch.Tensor,
    is_neox_style: bool,
    cache: tuple | None,
) -> None:
    """One `_rope_kernel` launch over every token; `cache` = (value, value cache, slot_mapping,
    value strides) turns CACHE on (k_out is then the key cache), else the dummies to pass."""
    num_tokens, num_q_heads, head_size = query.shape
    num_k_heads = key.shape[1]
    head_block, num_warps = rope_launch_config(max(num_q_heads, num_k_heads), head_size)
    k_blocks = triton.cdiv(num_k_heads, head_block)
    write = cache is not None
    if not write:  # the value, cache and slot arguments are never read: dummies
        cache = (key, k_out, positions, 0, 0, 0)
    num_blocks = triton.cdiv(num_q_heads, head_block) + (2 if write else 1) * k_blocks
    half = head_size // 2
    _rope_kernel[(num_tokens, num_blocks)](
        positions,
        query,
        key,
        q_out,
        k_out,
        cos_cache,
        sin_cache,
        num_q_heads,
        num_k_heads,
        *query.stride(),
        *key.stride(),
        *cache,
        HALF=half,
        HALF_PAD=triton.next_power_of_2(half),
        HEAD_BLOCK=head_block,
        IS_NEOX=is_neox_style,
        CACHE=write,
        num_warps=num_warps,
        **launch_options(query.device),
    )


def _check_cache_write(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cos_cache: torch.Tensor,
    sin_cache: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    allow_fp8: bool = False,
) -> None:
    """Raises ValueError naming the argument of a rotation fused with the K/V cache write that
    does not fit (the rotation's own inputs, then value, kv_cache and slot_mapping). The cache
    holds the query's dtype, or e4m3 with `allow_fp8`."""
    _check_inputs(positions, query, key, cos_cache, sin_cache)
    num_tokens, _, head_size = query.shape
    num_k_heads = key.shape[1]
    cache_dtypes = (query.dtype, torch.float8_e4m3fn) if allow_fp8 else (query.dtype,)
    if value.shape != key.shape or value.dtype != query.dtype or value.device != query.device:
        raise ValueError(
            f"value must be {tuple(key.shape)} {query.dtype} on {query.device}, got "
            f"{tuple(value.shape)} {value.dtype} on {value.device}"
        )
    if (
        kv_cache.dim() != 5
        or kv_cache.shape[0] != 2
        or tuple(kv_cache.shape[3:]) != (num_k_heads, head_size)
        or kv_cache.dtype not in cache_dtypes
        or not kv_cache.is_contiguous()
    ):
        allowed = " or ".join(str(dtype) for dtype in cache_dtypes)
        raise ValueError(
            f"kv_cache must be a contiguous [2, num_blocks, block_size, {num_k_heads}, "
            f"{head_size}] {allowed} tensor, got {tuple(kv_cache.shape)} {kv_cache.dtype}"
        )
    if slot_mapping.shape != (num_tokens,) or slot_mapping.dtype != torch.int64:
        raise ValueError(
            f"slot_mapping must be int64 [{num_tokens}], got {slot_mapping.dtype} "
            f"{tuple(slot_mapping.shape)}"
        )


def check_rope_decode_args(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cos_cache: torch.Tensor,
    sin_cache: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    max_query_len: int,
) -> None:
    """Raises ValueError unless paged attention may rotate the query and key itself and write
    the new K/V (kernels/triton_attention.py, `rope=`): a decode step (one query token per
    request), arguments as `rotary_embedding_and_cache` takes them (the cache may also be e4m3:
    the kernel quantizes the new K/V as kernels/triton_cache.py does), key and value rows with a
    unit last stride."""
    if max_query_len != 1:
        raise ValueError(
            f"the rotary embedding fuses into paged attention for decode steps only "
            f"(max_query_len 1), got max_query_len {max_query_len}"
        )
    _check_cache_write(
        positions, query, key, value, cos_cache, sin_cache, kv_cache, slot_mapping, allow_fp8=True
    )
    if key.stride(2) != 1 or value.stride(2) != 1:
        raise ValueError("key and value must have a unit last stride for the fused decode RoPE")


def rotary_embedding_and_cache(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cos_cache: torch.Tensor,
    sin_cache: torch.Tensor,
    is_neox_style: bool,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> torch.Tensor:
    """The rotated query as a new contiguous tensor, and the rotated key and the value written
    to kv_cache [2, num_blocks, block_size, Hkv, D] (of the query's dtype) at slot_mapping [T]
    (negative: not written), all in one launch: `rotary_embedding` followed by the cache write
    (kernels/cache_ops.py), the rotated key never stored elsewhere."""
    _check_cache_write(positions, query, key, value, cos_cache, sin_cache, kv_cache, slot_mapping)
    num_tokens = query.shape[0]
    q_out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    if num_tokens == 0:
        return q_out
    cache = (value, kv_cache[1], slot_mapping, *value.stride())
    _launch(positions, query, key, q_out, kv_cache[0], cos_cache, sin_cache, is_neox_style, cache)
    return q_out
