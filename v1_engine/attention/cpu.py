"""The reference attention backend: plain PyTorch over the paged KV cache (decode tokens batched,
prefill chunks one request at a time).

It is the correctness yardstick for the fast backends and the real path on CPU. Scores are
computed in float32 whatever the model dtype. An fp8 cache is dequantized (x * scale, float32)
as it is gathered.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from v1_engine.attention.backend import AttentionMetadata
from v1_engine.kernels.cache_ops import (
    FP8_DTYPE,
    check_fp8_scales,
    dequantize_fp8,
    write_to_kv_cache,
)


def gather_paged_kv(
    kv_cache: torch.Tensor,
    block_ids: torch.Tensor,
    seq_len: int,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The first `seq_len` tokens' K and V [seq_len, Hkv, D] of one request, in position order.

    An fp8 cache comes back dequantized to float32 with k_scale / v_scale; others as stored.
    """
    block_size = kv_cache.shape[2]
    num_blocks = (seq_len + block_size - 1) // block_size
    blocks = kv_cache[:, block_ids[:num_blocks].long()]  # [2, nb, block_size, Hkv, D]
    flat = blocks.reshape(2, num_blocks * block_size, *kv_cache.shape[3:])
    return _dequantized(flat[0, :seq_len], flat[1, :seq_len], k_scale, v_scale)


def _dequantized(
    key: torch.Tensor,
    value: torch.Tensor,
    k_scale: torch.Tensor | None,
    v_scale: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V read from the cache, in float32 when the cache is fp8 (as stored otherwise)."""
    if key.dtype != FP8_DTYPE:
        return key, value
    check_fp8_scales(k_scale, v_scale, key.device)
    return dequantize_fp8(key, k_scale), dequantize_fp8(value, v_scale)


def causal_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float
) -> torch.Tensor:
    """query [Lq, Hq, D] holds the last Lq of the Lk positions in key/value [Lk, Hkv, D].

    Query i sits at position Lk - Lq + i and sees keys 0..that position. Query heads share
    their group's kv head (GQA) inside SDPA, without copying K/V per query head.
    """
    q_len, k_len = query.shape[0], key.shape[0]
    q = query.float().transpose(0, 1)[None]  # [1, Hq, Lq, D]
    k = key.float().transpose(0, 1)[None]
    v = value.float().transpose(0, 1)[None]
    if q_len == k_len:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
    else:
        q_pos = torch.arange(k_len - q_len, k_len, device=query.device)[:, None]
        mask = torch.arange(k_len, device=query.device)[None, :] <= q_pos
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
    return out[0].transpose(0, 1).to(query.dtype)


def batched_decode_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """One query token per request (decode), all requests in one padded batch.

    query [R, Hq, D]; each request attends to its first seq_lens[r] cached tokens. Padding
    positions gather the request's own first token (already written, so never garbage from
    another request) and are masked out, so padding never changes a result.

    The rows are gathered with one index_select over the cache's token rows (several times
    faster on CPU than advanced indexing with a 2-D index), and the query heads of a kv head
    are the query rows of one SDPA head ([R, Hkv, group, D] against [R, Hkv, L, D]), so K and
    V are read in place of the gathered copy, never expanded per query head.
    """
    block_size, num_kv_heads, head_size = kv_cache.shape[2:]
    num_rows, num_heads = query.shape[:2]
    seq_lens = seq_lens.to(query.device).long()
    max_len = int(seq_lens.max())
    positions = torch.arange(max_len, device=query.device)
    valid = positions[None, :] < seq_lens[:, None]  # [R, L]
    positions = torch.where(valid, positions[None, :], 0)
    table = block_table.long().to(query.device)
    slots = table.gather(1, positions // block_size) * block_size + positions % block_size
    slots = slots.view(-1)

    def read(part: int) -> torch.Tensor:  # [R, Hkv, L, D], a transposed view of the copy
        rows = kv_cache[part].view(-1, num_kv_heads * head_size).index_select(0, slots)
        return rows.view(num_rows, max_len, num_kv_heads, head_size).transpose(1, 2)

    k, v = _dequantized(read(0), read(1), k_scale, v_scale)
    q = query.float().view(num_rows, num_kv_heads, num_heads // num_kv_heads, head_size)
    out = F.scaled_dot_product_attention(
        q, k.float(), v.float(), attn_mask=valid[:, None, None, :], scale=scale
    )
    return out.reshape(num_rows, num_heads, head_size).to(query.dtype)


class CPUAttentionBackend:
    """AttentionBackend in plain PyTorch; works on any device, fast on none."""

    name = "cpu"

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
        scale: float,
        output: torch.Tensor,
        k_scale: torch.Tensor | None = None,
        v_scale: torch.Tensor | None = None,
    ) -> None:
        """See AttentionBackend.forward; k_scale / v_scale (float32 [1]) serve an fp8 cache."""
        num_actual = metadata.num_actual_tokens
        write_to_kv_cache(
            key[:num_actual],
            value[:num_actual],
            kv_cache,
            metadata.slot_mapping[:num_actual],
            k_scale,
            v_scale,
        )
        query_starts = metadata.query_start_loc_cpu.tolist()
        seq_lens = metadata.seq_lens_cpu.tolist()
        decode_rows = [
            i for i in range(len(seq_lens)) if query_starts[i + 1] - query_starts[i] == 1
        ]
        if len(decode_rows) > 1:
            rows = torch.tensor(decode_rows)
            tokens = metadata.query_start_loc_cpu[rows].long()
            output[tokens] = batched_decode_attention(
                query[tokens],
                kv_cache,
                metadata.block_table[rows],
                metadata.seq_lens_cpu[rows],
                scale,
                k_scale,
                v_scale,
            )
            decode_set = set(decode_rows)
        else:
            decode_set = set()
        for i, seq_len in enumerate(seq_lens):
            start, end = query_starts[i], query_starts[i + 1]
            if end == start or i in decode_set:
                continue
            cached_k, cached_v = gather_paged_kv(
                kv_cache, metadata.block_table[i], seq_len, k_scale, v_scale
            )
            output[start:end] = causal_attention(query[start:end], cached_k, cached_v, scale)
        # Padding rows (a batch padded for a captured graph) get zeros, never stale values.
        output[num_actual:].zero_()
