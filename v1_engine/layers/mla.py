"""Multi-head Latent Attention: the layer, its paged latent cache and its opaque custom op.

The cache holds ONE entry per token, shared by every head: the normalized KV latent (kv_lora_rank
values) followed by the rotated rope key (qk_rope_head_dim values). kv_b_proj, which expands a
latent into per-head keys and values, is split at load time into W_UK and W_UV (`absorb`): decode
moves the query into the latent space through W_UK and applies W_UV after attention, so the full
K and V are never materialised; prefill expands the latents of the chunk and its cached context.

`MLAAttention.forward` calls `torch.ops.v1_engine.mla_attention`, which torch.compile treats as a
black box (the graph splits there), exactly like `unified_attention`: at run time the op finds its
layer (and the cache the model runner bound to it) and the step's metadata in the forward context.
"""

from __future__ import annotations

import torch
from torch import nn

from v1_engine.attention.selector import get_mla_backend
from v1_engine.forward_context import get_forward_context


@torch.library.custom_op("v1_engine::mla_attention", mutates_args=("output",))
def mla_attention(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    kv_c: torch.Tensor,
    k_pe: torch.Tensor,
    output: torch.Tensor,
    layer_name: str,
) -> None:
    """MLA of layer `layer_name` for the current step; writes `output` [T, H, v_head_dim]."""
    context = get_forward_context()
    layer = context.attention_layers[layer_name]
    metadata = context.attn_metadata
    if metadata is None:
        # A run without KV cache (memory profiling): shapes matter, values do not.
        output.zero_()
        return
    get_mla_backend(output.device).forward(
        q_nope,
        q_pe,
        kv_c,
        k_pe,
        layer.kv_cache,
        metadata,
        layer.w_uk,
        layer.w_uv,
        layer.scale,
        output,
    )


@mla_attention.register_fake
def _mla_attention_fake(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    kv_c: torch.Tensor,
    k_pe: torch.Tensor,
    output: torch.Tensor,
    layer_name: str,
) -> None:
    return None


class MLAAttention(nn.Module):
    """Causal latent attention over the paged latent cache of one layer.

    `kv_cache` [num_blocks, block_size, kv_lora_rank + qk_rope_head_dim] is bound by the model
    runner after it sizes the cache; until then it is an empty tensor. `w_uk`
    [H, qk_nope_head_dim, kv_lora_rank] and `w_uv` [H, kv_lora_rank, v_head_dim] are set by
    `absorb` once the weights are loaded.
    """

    def __init__(
        self,
        num_heads: int,
        qk_nope_head_dim: int,
        qk_rope_head_dim: int,
        v_head_dim: int,
        kv_lora_rank: int,
        scale: float,
        layer_name: str,
    ) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.qk_nope_head_dim = qk_nope_head_dim
        self.qk_rope_head_dim = qk_rope_head_dim
        self.v_head_dim = v_head_dim
        self.kv_lora_rank = kv_lora_rank
        self.scale = scale
        self.layer_name = layer_name
        self.kv_cache = torch.empty(0)
        self.register_buffer("w_uk", torch.empty(0), persistent=False)
        self.register_buffer("w_uv", torch.empty(0), persistent=False)

    @property
    def latent_size(self) -> int:
        """Values cached per token: the latent and the rope key."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    def kv_cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        """One latent per token, shared by all heads."""
        return (num_blocks, block_size, self.latent_size)

    @property
    def is_absorbed(self) -> bool:
        return self.w_uk.numel() > 0

    @torch.no_grad()
    def absorb(self, kv_b_weight: torch.Tensor) -> None:
        """Split kv_b_proj's weight [H * (nope + v), kv_lora_rank] into W_UK and W_UV.

        Both are strided VIEWS of the tensor given, not copies: decode (absorbed) and prefill
        (expanded) only ever use W_UK and W_UV, so the model holds kv_b_proj's values once. The
        caller passes kv_b_proj's own weight when it is in the model dtype, or a dequantized
        copy of an FP8 one (the views then keep that copy alive, nothing else does). The
        batched matmuls take the strides as they are (W_UV is column-major per head)."""
        per_head = kv_b_weight.view(
            self.num_heads, self.qk_nope_head_dim + self.v_head_dim, self.kv_lora_rank
        )
        w_uk, w_uv = per_head.split([self.qk_nope_head_dim, self.v_head_dim], dim=1)
        self.w_uk = w_uk
        self.w_uv = w_uv.transpose(1, 2)

    def forward(
        self, q_nope: torch.Tensor, q_pe: torch.Tensor, kv_c: torch.Tensor, k_pe: torch.Tensor
    ) -> torch.Tensor:
        """q_nope [T, H, nope], q_pe [T, H, rope], kv_c [T, kv_lora_rank] (normalized), k_pe
        [T, rope] (rotated) → [T, H * v_head_dim]."""
        assert self.is_absorbed, f"{self.layer_name}: absorb() must run after loading weights"
        num_tokens = q_nope.shape[0]
        output = q_nope.new_empty(num_tokens, self.num_heads, self.v_head_dim)
        torch.ops.v1_engine.mla_attention(
            q_nope.contiguous(),
            q_pe.contiguous(),
            kv_c.contiguous(),
            k_pe.contiguous(),
            output,
            self.layer_name,
        )
        return output.view(num_tokens, self.num_heads * self.v_head_dim)

    def extra_repr(self) -> str:
        return (
            f"heads={self.num_heads}, kv_lora_rank={self.kv_lora_rank}, "
            f"rope={self.qk_rope_head_dim}, nope={self.qk_nope_head_dim}, v={self.v_head_dim}, "
            f"name={self.layer_name}"
        )


def latent_kv_bytes_per_token(
    num_layers: int, kv_lora_rank: int, qk_rope_head_dim: int, dtype: torch.dtype
) -> int:
    """KV-cache bytes one token costs with the latent cache (all layers)."""
    elem = torch.empty((), dtype=dtype).element_size()
    return num_layers * (kv_lora_rank + qk_rope_head_dim) * elem


def per_head_kv_bytes_per_token(
    num_layers: int,
    num_heads: int,
    qk_nope_head_dim: int,
    qk_rope_head_dim: int,
    v_head_dim: int,
    dtype: torch.dtype,
) -> int:
    """What the same model would cost per token caching expanded per-head K and V instead."""
    elem = torch.empty((), dtype=dtype).element_size()
    key_size = qk_nope_head_dim + qk_rope_head_dim
    return num_layers * num_heads * (key_size + v_head_dim) * elem
