"""The reference Multi-head Latent Attention backend: plain PyTorch over the paged latent cache.

Latent cache layout, per layer: `[num_blocks, block_size, kv_lora_rank + qk_rope_head_dim]`: one
entry per token, shared by all heads: the normalized KV latent `c` followed by the rotated rope
key `k_pe`. Slots are numbered exactly as in the per-head cache (see attention/backend.py).

Two mathematically equal forms of the same attention, per head h:

- expanded (prefill chunks): k_nope = c W_UK[h], v = c W_UV[h] for every context token, then
  ordinary causal attention with keys [k_nope | k_pe] and queries [q_nope | q_pe];
- absorbed (decode tokens): q_latent = q_nope W_UK[h]^T moves the query into the latent space,
  scores are q_latent . c + q_pe . k_pe, the softmax-weighted sum of latents goes through W_UV[h]
  afterwards: the per-head K and V are never materialised, and every head reads the same latents.

`w_uk` is [H, qk_nope_head_dim, kv_lora_rank] and `w_uv` [H, kv_lora_rank, v_head_dim]: both
slices of kv_b_proj, laid out so that each form is one batched matmul per head. Scores are
computed in float32 whatever the model dtype.
"""

from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F

from v1_engine.attention.backend import AttentionMetadata
from v1_engine.attention.cpu import causal_attention


def write_latent_to_cache(
    kv_c: torch.Tensor, k_pe: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """kv_c [T, R] and k_pe [T, P] into kv_cache [num_blocks, block_size, R + P] at slot_mapping
    [T]; a negative slot marks a padding token and is skipped."""
    flat = kv_cache.view(-1, kv_cache.shape[-1])
    entries = torch.cat([kv_c, k_pe], dim=-1).to(kv_cache.dtype)
    valid = slot_mapping >= 0
    flat.index_copy_(0, slot_mapping[valid], entries[valid])


def gather_paged_latent(
    kv_cache: torch.Tensor, block_ids: torch.Tensor, seq_len: int
) -> torch.Tensor:
    """The first `seq_len` cache entries [seq_len, R + P] of one request, in position order."""
    block_size = kv_cache.shape[1]
    num_blocks = (seq_len + block_size - 1) // block_size
    blocks = kv_cache[block_ids[:num_blocks].long()]
    return blocks.reshape(num_blocks * block_size, kv_cache.shape[-1])[:seq_len]


def mla_prefill_expanded(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    latent: torch.Tensor,
    w_uk: torch.Tensor,
    w_uv: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Causal attention of one request's chunk, with K/V expanded from the latents.

    q_nope [Lq, H, N], q_pe [Lq, H, P] are the last Lq of the Lk positions in latent [Lk, R + P];
    returns [Lq, H, V] in the query's dtype.
    """
    rank = w_uk.shape[-1]
    c = latent[:, :rank].float()
    k_pe = latent[:, rank:].float()
    k_nope = torch.einsum("lr,hnr->lhn", c, w_uk.float())
    value = torch.einsum("lr,hrv->lhv", c, w_uv.float())
    num_heads = w_uk.shape[0]
    key = torch.cat([k_nope, k_pe[:, None, :].expand(-1, num_heads, -1)], dim=-1)
    query = torch.cat([q_nope.float(), q_pe.float()], dim=-1)
    return causal_attention(query, key, value, scale).to(q_nope.dtype)


def _padded_slots(
    block_table: torch.Tensor, seq_lens: torch.Tensor, block_size: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """(slots [R, L], valid [R, L]) of each request's cached tokens, padded to the longest;
    padding points at the request's own first slot and is masked out."""
    seq_lens = seq_lens.to(device).long()
    positions = torch.arange(int(seq_lens.max()), device=device)
    valid = positions[None, :] < seq_lens[:, None]
    positions = torch.where(valid, positions[None, :], 0)
    table = block_table.long().to(device)
    slots = table.gather(1, positions // block_size) * block_size + positions % block_size
    return slots, valid


def mla_decode_absorbed(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    w_uk: torch.Tensor,
    w_uv: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """One query token per request over its cached latents, all requests in one padded batch.

    q_nope [B, H, N], q_pe [B, H, P]; request b attends to its first seq_lens[b] cache entries.
    Returns [B, H, V] in the query's dtype.
    """
    rank = w_uk.shape[-1]
    # [H, B, N] @ [H, N, R] -> [H, B, R]: the query in the latent space, per head.
    q_latent = torch.bmm(q_nope.float().transpose(0, 1), w_uk.float()).transpose(0, 1)
    query = torch.cat([q_latent, q_pe.float()], dim=-1)[:, :, None, :]  # [B, H, 1, R + P]
    slots, valid = _padded_slots(block_table, seq_lens, kv_cache.shape[1], q_nope.device)
    entries = kv_cache.view(-1, kv_cache.shape[-1])[slots].float()  # [B, L, R + P]
    keys = entries[:, None]  # one latent stream shared by every head
    values = entries[:, None, :, :rank]
    out_latent = F.scaled_dot_product_attention(
        query, keys, values, attn_mask=valid[:, None, None, :], scale=scale, enable_gqa=True
    )[:, :, 0]  # [B, H, R]
    out = torch.bmm(out_latent.transpose(0, 1), w_uv.float()).transpose(0, 1)  # [B, H, V]
    return out.to(q_nope.dtype)


class CPUMLABackend:
    """MLA over the paged latent cache in plain PyTorch; works on any device, fast on none.

    Decode tokens (query length 1) of all requests run batched through the absorbed form;
    prefill chunks run one request at a time through the expanded form.
    """

    name = "cpu"

    def forward(
        self,
        q_nope: torch.Tensor,
        q_pe: torch.Tensor,
        kv_c: torch.Tensor,
        k_pe: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
        w_uk: torch.Tensor,
        w_uv: torch.Tensor,
        scale: float,
        output: torch.Tensor,
    ) -> None:
        """Write the step's latents into kv_cache at slot_mapping, then fill output [T, H, V]."""
        num_actual = metadata.num_actual_tokens
        write_latent_to_cache(
            kv_c[:num_actual], k_pe[:num_actual], kv_cache, metadata.slot_mapping[:num_actual]
        )
        query_starts = metadata.query_start_loc_cpu.tolist()
        seq_lens = metadata.seq_lens_cpu.tolist()
        query_lens = [end - start for start, end in itertools.pairwise(query_starts)]
        decode_rows = [i for i, n in enumerate(query_lens) if n == 1]
        if decode_rows:
            rows = torch.tensor(decode_rows)
            tokens = metadata.query_start_loc_cpu[rows].long().to(output.device)
            output[tokens] = mla_decode_absorbed(
                q_nope[tokens],
                q_pe[tokens],
                kv_cache,
                metadata.block_table[rows.to(metadata.block_table.device)],
                metadata.seq_lens_cpu[rows],
                w_uk,
                w_uv,
                scale,
            )
        for i, seq_len in enumerate(seq_lens):
            if query_lens[i] <= 1:
                continue
            start, end = query_starts[i], query_starts[i + 1]
            latent = gather_paged_latent(kv_cache, metadata.block_table[i], seq_len)
            output[start:end] = mla_prefill_expanded(
                q_nope[start:end], q_pe[start:end], latent, w_uk, w_uv, scale
            )
        # Padding rows (a batch padded for a captured graph) get zeros, never stale values.
        output[num_actual:].zero_()
