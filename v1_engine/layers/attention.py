"""The attention layer and the one opaque custom op every model calls.

`Attention.forward` calls `torch.ops.v1_engine.unified_attention`, which torch.compile treats as a
black box (the graph is split there). At run time the op looks up the step's metadata, the
backend and this layer's KV cache (bound by the model runner) in the forward context.

The cache's dtype is the model runner's choice (kv_cache_dtype): the model dtype, or
float8_e4m3fn, which stores K / k_scale and V / v_scale. The scales are per-layer float32 [1]
buffers on the layer (1.0 unless a checkpoint or a calibration sets them); they live on the
device so that backends read them in their kernels and CUDA graphs see later updates.
"""

from __future__ import annotations

import torch
from torch import nn

from v1_engine.forward_context import get_forward_context
from v1_engine.layers.rotary import apply_rotary


@torch.library.custom_op("v1_engine::unified_attention", mutates_args=("output",))
def unified_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    output: torch.Tensor,
    layer_name: str,
    positions: torch.Tensor | None = None,
    cos_cache: torch.Tensor | None = None,
    sin_cache: torch.Tensor | None = None,
    is_neox_style: bool = True,
) -> None:
    """Attention of layer `layer_name` for the current step; writes `output` [T, Hq, D].

    With `positions` (and the rotary tables of layers/rotary.py), query and key arrive before
    their rotary embedding, which is applied here: by the backend together with its K/V cache
    write where it can (`forward_rope`: one kernel on the Triton backend), else by the rotary op
    and then the plain path. The `rope_kv_cache` fusion pass moves the rotation in here."""
    context = get_forward_context()
    layer = context.attention_layers[layer_name]
    metadata = context.attn_metadata
    if metadata is None:
        # A run without KV cache (memory profiling): shapes matter, values do not.
        output.zero_()
        return
    backend = context.attn_backend
    scales = {"k_scale": layer.k_scale, "v_scale": layer.v_scale}
    if positions is not None:
        assert cos_cache is not None and sin_cache is not None, "rotary tables are required"
        rope = (positions, cos_cache, sin_cache, is_neox_style)
        fused = getattr(backend, "forward_rope", None)
        if fused is not None and fused(
            query, key, value, rope, layer.kv_cache, metadata, layer.scale, output, **scales
        ):
            return
        query, key = apply_rotary(positions, query, key, cos_cache, sin_cache, is_neox_style)
    backend.forward(query, key, value, layer.kv_cache, metadata, layer.scale, output, **scales)


@unified_attention.register_fake
def _unified_attention_fake(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    output: torch.Tensor,
    layer_name: str,
    positions: torch.Tensor | None = None,
    cos_cache: torch.Tensor | None = None,
    sin_cache: torch.Tensor | None = None,
    is_neox_style: bool = True,
) -> None:
    return None


class Attention(nn.Module):
    """Causal attention over the paged KV cache of one layer.

    `kv_cache` [2, num_blocks, block_size, num_kv_heads, head_size] is bound by the model runner
    after it sizes the cache; until then it is an empty tensor. `k_scale` / `v_scale` (float32
    [1], default 1.0) dequantize an fp8 cache; a 16- or 32-bit cache ignores them.
    """

    def __init__(
        self, num_heads: int, head_size: int, scale: float, num_kv_heads: int, layer_name: str
    ) -> None:
        super().__init__()
        assert num_heads % num_kv_heads == 0, "query heads must be a multiple of kv heads"
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_size = head_size
        self.scale = scale
        self.layer_name = layer_name
        self.kv_cache = torch.empty(0)
        # Not persistent: checkpoints without scales load unchanged; with the model's device.
        self.register_buffer("k_scale", torch.ones(1, dtype=torch.float32), persistent=False)
        self.register_buffer("v_scale", torch.ones(1, dtype=torch.float32), persistent=False)

    def kv_cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        """The paged cache this layer needs (an MLA layer stores one latent per token instead)."""
        return (2, num_blocks, block_size, self.num_kv_heads, self.head_size)

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        """query [T, Hq*D] or [T, Hq, D], key/value [T, Hkv*D] or [T, Hkv, D] → [T, Hq*D]."""
        num_tokens = query.shape[0]
        query = query.reshape(num_tokens, self.num_heads, self.head_size)
        key = key.reshape(num_tokens, self.num_kv_heads, self.head_size)
        value = value.reshape(num_tokens, self.num_kv_heads, self.head_size)
        output = torch.empty_like(query)
        torch.ops.v1_engine.unified_attention(query, key, value, output, self.layer_name)
        return output.view(num_tokens, self.num_heads * self.head_size)

    def extra_repr(self) -> str:
        return (
            f"heads={self.num_heads}, kv_heads={self.num_kv_heads}, head_size={self.head_size}, "
            f"name={self.layer_name}"
        )
