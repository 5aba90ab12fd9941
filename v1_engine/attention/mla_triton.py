"""The Triton Multi-head Latent Attention backend: decode tokens through the paged latent kernel,
prefill chunks through the expanded form.

Decode (query length 1): the query's no-rope part moves into the latent space through W_UK (one
batched matmul over heads), `mla_decode` attends over the cached latents with every head of a
request sharing one latent stream, and W_UV maps the latent-space result to each head's values.
A decode-only step (max_query_len == 1) reads nothing on the host, so it can be captured in a
CUDA graph. In a mixed step the decode requests are gathered into a sub-batch first (their rows
come from the host-side metadata, as the prefill loop's do).

Prefill chunks run one request at a time: the chunk's and its cached context's latents are
expanded into per-head keys and values (W_UK, W_UV) and fed to scaled_dot_product_attention in
the model's dtype, with the causal mask aligned to the chunk's last rows. Its fused kernels
(flash, memory-efficient) take 4-D inputs whose q, k and v share one head size, so the values
(v_head_dim 128) are zero-padded to the query/key size (nope + rope = 192) and the pad dropped
after; 3-D inputs of unequal sizes went to the math path, which on CUDA computes in float32 (a
DeepSeek-V2-Lite profile showed its float32 GEMMs at 254 us a layer of a 1k-token prefill;
benchmarks/RESULTS.md).
"""

from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

from v1_engine.attention.backend import AttentionMetadata
from v1_engine.attention.mla_cpu import gather_paged_latent


def mla_prefill_expanded_sdpa(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    latent: torch.Tensor,
    w_uk: torch.Tensor,
    w_uv: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Causal attention of one request's chunk with K/V expanded from the latents, in the model
    dtype (fused attention kernels; float32 accumulation inside them).

    q_nope [Lq, H, N], q_pe [Lq, H, P] are the last Lq of the Lk positions in latent [Lk, R + P];
    returns [Lq, H, V].
    """
    rank = w_uk.shape[-1]
    q_len, k_len = q_nope.shape[0], latent.shape[0]
    c, k_pe = latent[:, :rank].to(q_nope.dtype), latent[:, rank:].to(q_nope.dtype)
    num_heads = w_uk.shape[0]
    k_nope = torch.matmul(c, w_uk.transpose(1, 2))  # [H, Lk, N]
    value = torch.matmul(c, w_uv)  # [H, Lk, V]
    key = torch.cat([k_nope, k_pe[None].expand(num_heads, -1, -1)], dim=-1)
    query = torch.cat([q_nope, q_pe], dim=-1).transpose(0, 1)  # [H, Lq, N + P]
    v_dim = value.shape[-1]
    if v_dim < query.shape[-1]:  # one head size for the fused kernels (module docstring)
        value = F.pad(value, (0, query.shape[-1] - v_dim))
    query, key, value = query[None], key[None], value[None]  # [1, H, L, D]
    if q_len == k_len:
        out = F.scaled_dot_product_attention(query, key, value, is_causal=True, scale=scale)
    else:  # the chunk's rows are the last q_len of k_len positions: causal, lower right
        mask = causal_lower_right(q_len, k_len)
        out = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scale)
    return out[0, :, :, :v_dim].transpose(0, 1)


class TritonMLABackend:
    """MLA over the paged latent cache: the Triton decode kernel and an expanded prefill."""

    name = "triton"
    supports_cudagraph = True
    """A decode-only step reads nothing on the host: it can be captured in a CUDA graph."""

    def __init__(self, num_splits: int | None = None) -> None:
        """`num_splits` pins the split-KV factor (tests, graph capture); None picks per step."""
        if num_splits is not None and num_splits < 1:
            raise ValueError(f"num_splits must be >= 1 or None, got {num_splits}")
        self.num_splits = num_splits
        # Imported here so that importing this module does not require triton.
        from v1_engine.kernels import triton_cache, triton_mla

        self._kernels = triton_mla
        self._write_latent_cache = triton_cache.write_latent_cache

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
        self._write_latent_cache(kv_c, k_pe, kv_cache, metadata.slot_mapping[:num_actual])
        if metadata.max_query_len <= 1:
            self._decode(
                q_nope[:num_actual],
                q_pe[:num_actual],
                kv_cache,
                metadata.block_table,
                metadata.seq_lens,
                metadata.query_start_loc,
                metadata.max_seq_len,
                w_uk,
                w_uv,
                scale,
                output[:num_actual],
            )
        else:
            self._mixed(q_nope, q_pe, kv_cache, metadata, w_uk, w_uv, scale, output)
        # Padding rows (a batch padded for a captured graph) get zeros, never stale values.
        if output.shape[0] > num_actual:
            output[num_actual:].zero_()

    def _decode(
        self,
        q_nope: torch.Tensor,
        q_pe: torch.Tensor,
        kv_cache: torch.Tensor,
        block_table: torch.Tensor,
        seq_lens: torch.Tensor,
        query_start_loc: torch.Tensor,
        max_seq_len: int,
        w_uk: torch.Tensor,
        w_uv: torch.Tensor,
        scale: float,
        output: torch.Tensor,
    ) -> None:
        """Absorbed attention of a batch whose requests all have one query row (or none)."""
        # [H, T, N] @ [H, N, R] -> [H, T, R]; the kernel takes the [T, H, R] view's strides.
        q_latent = torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)
        out_latent = torch.empty_like(q_latent, memory_format=torch.contiguous_format)
        self._kernels.mla_decode(
            q_latent,
            q_pe,
            kv_cache,
            block_table,
            seq_lens,
            query_start_loc,
            max_seq_len,
            scale,
            out_latent,
            num_splits=self.num_splits,
        )
        # [H, T, R] @ [H, R, V] -> [H, T, V]
        output.copy_(torch.bmm(out_latent.transpose(0, 1), w_uv).transpose(0, 1))

    def _mixed(
        self,
        q_nope: torch.Tensor,
        q_pe: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
        w_uk: torch.Tensor,
        w_uv: torch.Tensor,
        scale: float,
        output: torch.Tensor,
    ) -> None:
        """Decode requests as one gathered sub-batch, prefill chunks one by one."""
        query_starts = metadata.query_start_loc_cpu.tolist()
        seq_lens = metadata.seq_lens_cpu.tolist()
        query_lens = [end - start for start, end in itertools.pairwise(query_starts)]
        decode_rows = [i for i, n in enumerate(query_lens) if n == 1]
        device = q_nope.device
        if decode_rows:
            rows = torch.tensor(decode_rows, dtype=torch.int64).to(device, non_blocking=True)
            tokens_cpu = torch.tensor([query_starts[i] for i in decode_rows], dtype=torch.int64)
            tokens = tokens_cpu.to(device, non_blocking=True)
            num_decodes = len(decode_rows)
            sub_starts = torch.arange(num_decodes + 1, dtype=torch.int32, device=device)
            decode_out = output.new_empty(num_decodes, *output.shape[1:])
            self._decode(
                q_nope.index_select(0, tokens),
                q_pe.index_select(0, tokens),
                kv_cache,
                metadata.block_table.index_select(0, rows),
                metadata.seq_lens.index_select(0, rows),
                sub_starts,
                max(seq_lens[i] for i in decode_rows),
                w_uk,
                w_uv,
                scale,
                decode_out,
            )
            output.index_copy_(0, tokens, decode_out)
        for i, seq_len in enumerate(seq_lens):
            if query_lens[i] <= 1:
                continue
            start, end = query_starts[i], query_starts[i + 1]
            latent = gather_paged_latent(kv_cache, metadata.block_table[i], seq_len)
            output[start:end] = mla_prefill_expanded_sdpa(
                q_nope[start:end], q_pe[start:end], latent, w_uk, w_uv, scale
            )
