"""The Triton attention backend: the compiled K/V write, then one paged-attention launch.

Everything `forward` touches on the device comes from the step's metadata (built once per step
into device tensors); the host reads only python ints (token and request counts, the longest
query and sequence), so a step can be captured in a CUDA graph. It runs on CUDA, and on the CPU
under the Triton interpreter (TRITON_INTERPRET=1), which is how CI checks the kernels' logic.
"""

from __future__ import annotations

import torch

from v1_engine.attention.backend import AttentionMetadata
from v1_engine.kernels.cache_ops import write_to_kv_cache


class TritonAttentionBackend:
    """AttentionBackend on the varlen paged Triton kernel (prefill chunks and decode together)."""

    name = "triton"
    supports_cudagraph = True
    """Launch shapes depend only on python ints fixed at capture: a decode step can be captured."""
    supports_varlen_cudagraph = True
    """A launch captured for T tokens, R requests and a longest query Q serves any step packing at
    most T tokens over at most R requests, none longer than Q (the grid bounds q-blocks by tokens
    and requests), the cache written by a kernel before it: verify steps can be captured."""

    def __init__(self, num_splits: int | None = None) -> None:
        """`num_splits` pins the split-KV factor (tests, graph capture); None picks per step."""
        if num_splits is not None and num_splits < 1:
            raise ValueError(f"num_splits must be >= 1 or None, got {num_splits}")
        self.num_splits = num_splits
        # Imported here so that importing this module does not require triton.
        from v1_engine.kernels.triton_attention import paged_attention

        self._paged_attention = paged_attention

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
        num_actual = metadata.num_actual_tokens
        write_to_kv_cache(
            key[:num_actual],
            value[:num_actual],
            kv_cache,
            metadata.slot_mapping[:num_actual],
            k_scale,
            v_scale,
        )
        self._attend(query, kv_cache, metadata, scale, output, k_scale, v_scale)

    def forward_rope(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor, torch.Tensor, bool],
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
        scale: float,
        output: torch.Tensor,
        k_scale: torch.Tensor | None = None,
        v_scale: torch.Tensor | None = None,
    ) -> bool:
        """`forward` for a query and key not yet rotated (rope = positions, cos and sin tables,
        neox style). A decode step (one query token per request) runs one kernel: paged
        attention rotates the query and key itself, writes the new K/V (quantized for an fp8
        cache) and attends (`paged_attention(rope=...)`). Other steps rotate and write the cache
        in one kernel (kernels/triton_rope.py), then launch the attention. Returns False, having
        done nothing, where neither applies (not CUDA; an fp8 cache outside decode steps): the
        caller then rotates and calls `forward`."""
        if not query.is_cuda:
            return False
        positions, cos_cache, sin_cache, is_neox_style = rope
        n = metadata.num_actual_tokens
        if metadata.max_query_len == 1:  # a cache of the model dtype or e4m3
            fused = (key[:n], value[:n], positions[:n], cos_cache, sin_cache, is_neox_style,
                     metadata.slot_mapping[:n])  # fmt: skip
            self._attend(query, kv_cache, metadata, scale, output, k_scale, v_scale, fused)
            return True
        if kv_cache.dtype != query.dtype:
            return False
        from v1_engine.kernels.triton_rope import rotary_embedding_and_cache

        query = rotary_embedding_and_cache(
            positions[:n], query[:n], key[:n], value[:n], cos_cache, sin_cache, is_neox_style,
            kv_cache, metadata.slot_mapping[:n],
        )  # fmt: skip
        self._attend(query, kv_cache, metadata, scale, output, k_scale, v_scale)
        return True

    def _attend(
        self,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
        scale: float,
        output: torch.Tensor,
        k_scale: torch.Tensor | None,
        v_scale: torch.Tensor | None,
        rope: tuple | None = None,
    ) -> None:
        """The paged-attention launch over the step's first num_actual_tokens query rows (the
        cache already holds their K/V, or `rope` has the kernel write them: see
        `forward_rope`); padding rows of `output` get zeros."""
        num_actual = metadata.num_actual_tokens
        self._paged_attention(
            query[:num_actual],
            kv_cache,
            metadata.block_table,
            metadata.seq_lens,
            metadata.query_start_loc,
            metadata.max_query_len,
            metadata.max_seq_len,
            scale,
            output[:num_actual],
            num_splits=self.num_splits,
            k_scale=k_scale,
            v_scale=v_scale,
            rope=rope,
        )
        # Padding rows (a batch padded for a captured graph) get zeros, never stale values.
        if output.shape[0] > num_actual:
            output[num_actual:].zero_()
