"""The attention backend interface: per-step metadata and the backend contract.

KV-cache layout, per layer: `[2, num_blocks, block_size, num_kv_heads, head_size]` (index 0 = K,
1 = V). A token at position p of a request lives in slot
`block_table[p // block_size] * block_size + p % block_size`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch


@dataclass
class AttentionMetadata:
    """Everything attention needs for one step, for a batch of requests packed token by token.

    Request i owns query tokens `query_start_loc[i]:query_start_loc[i+1]`, which are the last
    `query_len_i` positions of its `seq_lens[i]` tokens (the earlier ones are cached context).
    """

    num_actual_tokens: int
    query_start_loc: torch.Tensor
    """int32 [num_reqs + 1], on the model's device."""
    seq_lens: torch.Tensor
    """int32 [num_reqs]: context + new tokens, on the model's device."""
    block_table: torch.Tensor
    """int32 [num_reqs, max_num_blocks_per_req], on the model's device."""
    slot_mapping: torch.Tensor
    """int64 [num_tokens]: the cache slot each new token's K/V is written to."""
    max_query_len: int
    max_seq_len: int
    query_start_loc_cpu: torch.Tensor
    """The same as query_start_loc, on the CPU (no device sync to read it)."""
    seq_lens_cpu: torch.Tensor

    @property
    def num_reqs(self) -> int:
        return self.seq_lens_cpu.shape[0]


class AttentionBackend(Protocol):
    """Computes causal attention of the step's queries over each request's paged KV.

    A backend may also offer `forward_rope(query, key, value, rope, kv_cache, metadata, scale,
    output, k_scale=None, v_scale=None) -> bool` for a query and key not yet rotated (rope =
    positions, cos and sin tables, neox style; the `rope_kv_cache` fusion pass sends those): it
    returns False, having done nothing, where it cannot fuse, and the attention op then rotates
    and calls `forward` (layers/attention.py). The Triton backend has it."""

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
        """query [T, Hq, D], key/value [T, Hkv, D]: write K/V into kv_cache at slot_mapping, then
        fill output [T, Hq, D] with attention over the cached context plus the new tokens.
        k_scale / v_scale (float32 [1] device tensors) dequantize an fp8 cache; None otherwise."""
        ...
