"""The reference attention backend: plain PyTorch over the paged KV cache (decode tokens batched,
prefill chunks one request at a time).

It is the correctness yardstick for the fast backends and the real path on CPU. Scores are
computed in float32 whatever the model dtype.
"""

from __future__ import annotations

import torch

from v1_engine.attention.backend import AttentionMetadata
from v1_engine.kernels.cache_ops import write_to_kv_cache


def gather_paged_kv(
    kv_cache: torch.Tensor, block_ids: torch.Tensor, seq_len: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The first `seq_len` tokens' K and V [seq_len, Hkv, D] of one request, in position order."""
    block_size = kv_cache.shape[2]
    num_blocks = (seq_len + block_size - 1) // block_size
    blocks = kv_cache[:, block_ids[:num_blocks].long()]  # [2, nb, block_size, Hkv, D]
    flat = blocks.reshape(2, num_blocks * block_size, *kv_cache.shape[3:])
    return flat[0, :seq_len], flat[1, :seq_len]


def causal_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float
) -> torch.Tensor:
    """query [Lq, Hq, D] holds the last Lq of the Lk positions in key/value [Lk, Hkv, D].

    Query i sits at position Lk - Lq + i and sees keys 0..that position. Query heads are grouped
    over kv heads (GQA) by a reshape, without copying K/V per query head.
    """
    q_len, num_heads, head_size = query.shape
    k_len, num_kv_heads, _ = key.shape
    group = num_heads // num_kv_heads
    q = query.float().view(q_len, num_kv_heads, group, head_size).permute(1, 2, 0, 3)
    k = key.float().permute(1, 0, 2)[:, None]  # [Hkv, 1, Lk, D]
    v = value.float().permute(1, 0, 2)[:, None]
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale  # [Hkv, G, Lq, Lk]
    q_pos = torch.arange(k_len - q_len, k_len, device=query.device)[:, None]
    k_pos = torch.arange(k_len, device=query.device)[None, :]
    scores = scores.masked_fill(k_pos > q_pos, float("-inf"))
    out = torch.matmul(torch.softmax(scores, dim=-1), v)  # [Hkv, G, Lq, D]
    return out.permute(2, 0, 1, 3).reshape(q_len, num_heads, head_size).to(query.dtype)


def batched_decode_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """One query token per request (decode), all requests in one padded batch.

    query [R, Hq, D]; each request attends to its first seq_lens[r] cached tokens. Keys past a
    request's length are masked, so padding never changes a result.
    """
    num_reqs, num_heads, head_size = query.shape
    block_size, num_kv_heads = kv_cache.shape[2], kv_cache.shape[3]
    max_len = int(seq_lens.max())
    num_blocks = -(-max_len // block_size)
    table = block_table[:, :num_blocks].long().to(kv_cache.device)
    k = kv_cache[0][table].reshape(num_reqs, num_blocks * block_size, num_kv_heads, head_size)
    v = kv_cache[1][table].reshape(num_reqs, num_blocks * block_size, num_kv_heads, head_size)
    group = num_heads // num_kv_heads
    q = query.float().view(num_reqs, num_kv_heads, group, head_size)
    positions = torch.arange(max_len, device=query.device)
    valid = positions[None, :] < seq_lens.to(query.device)[:, None]  # [R, L]
    k = k[:, :max_len].float().masked_fill(~valid[:, :, None, None], 0.0)
    scores = torch.einsum("rhgd,rlhd->rhgl", q, k) * scale
    scores = scores.masked_fill(~valid[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    # Unwritten slots past a request's length may hold anything (NaN included): 0 * NaN = NaN.
    v = v[:, :max_len].float().masked_fill(~valid[:, :, None, None], 0.0)
    out = torch.einsum("rhgl,rlhd->rhgd", probs, v)
    return out.reshape(num_reqs, num_heads, head_size).to(query.dtype)


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
    ) -> None:
        num_actual = metadata.num_actual_tokens
        write_to_kv_cache(
            key[:num_actual], value[:num_actual], kv_cache, metadata.slot_mapping[:num_actual]
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
            )
            decode_set = set(decode_rows)
        else:
            decode_set = set()
        for i, seq_len in enumerate(seq_lens):
            start, end = query_starts[i], query_starts[i + 1]
            if end == start or i in decode_set:
                continue
            cached_k, cached_v = gather_paged_kv(kv_cache, metadata.block_table[i], seq_len)
            output[start:end] = causal_attention(query[start:end], cached_k, cached_v, scale)
        # Padding rows (a batch padded for a captured graph) get zeros, never stale values.
        output[num_actual:].zero_()
