"""The Llama family in one model with config switches.

Covers Llama 2/3.x (rope scaling), Mistral, Qwen2/2.5 (bias on q/k/v), Qwen3 (RMSNorm on each
query/key head before rope) and tied embeddings. The batch is flattened: `forward` takes the
step's tokens [T] and positions [T] of all requests packed together, without padding.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from v1_engine.layers.activation import SiluAndMul
from v1_engine.layers.attention import Attention
from v1_engine.layers.decoder import CausalLMBase, PreNormDecoderLayer, PreNormDecoderStack
from v1_engine.layers.embedding import VocabEmbedding
from v1_engine.layers.linear import Linear, MergedColumnLinear, QKVLinear
from v1_engine.layers.norm import RMSNorm
from v1_engine.layers.rotary import RotaryEmbedding, get_rope, rope_parameters_of
from v1_engine.models.weights import default_weight_loader

logger = logging.getLogger(__name__)

# Checkpoint projection name → (fused parameter name, shard id).
_STACKED_PARAMS = (
    (".q_proj.", ".qkv_proj.", "q"),
    (".k_proj.", ".qkv_proj.", "k"),
    (".v_proj.", ".qkv_proj.", "v"),
    (".gate_proj.", ".gate_up_proj.", 0),
    (".up_proj.", ".gate_up_proj.", 1),
)


_KV_SCALE_SUFFIXES = (
    (".self_attn.k_scale", ("k_scale",)),
    (".self_attn.v_scale", ("v_scale",)),
    (".self_attn.k_proj.output_scale", ("k_scale",)),
    (".self_attn.v_proj.output_scale", ("v_scale",)),
    (".self_attn.kv_scale", ("k_scale", "v_scale")),
)
"""Checkpoint names of the per-layer FP8 KV-cache scales (quantizers that calibrate the cache
write them; the last is an older single scale for both) and the Attention buffers they set."""

_IGNORED_ATTENTION_SCALES = (".self_attn.q_scale", ".self_attn.prob_scale")
"""FP8 attention-math scales some checkpoints carry; attention here runs in 16/32-bit."""


def kv_scale_targets(name: str) -> list[str]:
    """The Attention buffer names a checkpoint's KV-cache scale `name` sets (empty: not one)."""
    for suffix, buffers in _KV_SCALE_SUFFIXES:
        if name.endswith(suffix):
            layer = name[: -len(suffix)]
            return [f"{layer}.self_attn.attn.{buffer}" for buffer in buffers]
    return []


def load_kv_scale(buffer: torch.Tensor, name: str, tensor: torch.Tensor) -> None:
    """Copy a per-layer KV-cache scale (one positive finite value) into its buffer."""
    if tensor.numel() != 1:
        raise ValueError(
            f"checkpoint weight {name!r} holds {tensor.numel()} KV-cache scales; only one "
            "scale per layer (a scalar) is supported"
        )
    value = float(tensor.float().reshape(()))
    if not value > 0 or value == float("inf"):
        raise ValueError(f"checkpoint weight {name!r} must be a positive finite scale, got {value}")
    buffer.fill_(value)


def head_dim_of(config: Any) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def attention_biases(config: Any) -> tuple[bool, bool]:
    """(bias on q/k/v, bias on o_proj): Qwen2 always biases q/k/v only; the others follow
    `attention_bias` for all four."""
    if config.model_type == "qwen2":
        return True, False
    bias = bool(getattr(config, "attention_bias", False))
    return bias, bias


def _warn_if_sliding_window(config: Any) -> None:
    layer_types = getattr(config, "layer_types", None) or ()
    window = getattr(config, "sliding_window", None)
    uses_window = "sliding_attention" in layer_types or config.model_type == "mistral"
    if uses_window and window is not None and window < config.max_position_embeddings:
        logger.warning(
            "sliding-window attention (window %d) is not implemented: sequences longer than the "
            "window attend to their full context, unlike the reference model",
            window,
        )


class LlamaMLP(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        if config.hidden_act != "silu":
            raise ValueError(f"hidden_act must be one of ('silu',), got {config.hidden_act!r}")
        bias = bool(getattr(config, "mlp_bias", False))
        size = config.intermediate_size
        self.gate_up_proj = MergedColumnLinear(config.hidden_size, [size, size], bias=bias)
        self.act_fn = SiluAndMul()
        self.down_proj = Linear(size, config.hidden_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class LlamaAttention(nn.Module):
    def __init__(self, config: Any, rotary_emb: RotaryEmbedding, prefix: str) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = getattr(config, "num_key_value_heads", None) or self.num_heads
        self.head_dim = head_dim_of(config)
        qkv_bias, o_bias = attention_biases(config)
        self.qkv_proj = QKVLinear(
            config.hidden_size, self.head_dim, self.num_heads, self.num_kv_heads, bias=qkv_bias
        )
        self.o_proj = Linear(self.num_heads * self.head_dim, config.hidden_size, bias=o_bias)
        self.use_qk_norm = config.model_type == "qwen3"
        if self.use_qk_norm:
            self.q_norm = RMSNorm(self.head_dim, eps=config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.rotary_emb = rotary_emb
        self.attn = Attention(
            self.num_heads,
            self.head_dim,
            self.head_dim**-0.5,
            self.num_kv_heads,
            layer_name=f"{prefix}.attn",
        )

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        num_tokens = hidden_states.shape[0]
        q_size, kv_size = self.qkv_proj.q_size, self.qkv_proj.kv_size
        q, k, v = self.qkv_proj(hidden_states).split([q_size, kv_size, kv_size], dim=-1)
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        if self.use_qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary_emb(positions, q, k)
        return self.o_proj(self.attn(q, k, v))


class LlamaDecoderLayer(PreNormDecoderLayer):
    def __init__(self, config: Any, rotary_emb: RotaryEmbedding, prefix: str) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(config, rotary_emb, prefix=f"{prefix}.self_attn")
        self.mlp = LlamaMLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)


class LlamaModel(PreNormDecoderStack):
    def __init__(self, config: Any, prefix: str = "model") -> None:
        super().__init__()
        self.embed_tokens = VocabEmbedding(config.vocab_size, config.hidden_size)
        self.rotary_emb = get_rope(
            head_dim_of(config), config.max_position_embeddings, rope_parameters_of(config)
        )
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, self.rotary_emb, prefix=f"{prefix}.layers.{i}")
            for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)


class LlamaForCausalLM(CausalLMBase):
    """Llama, Mistral, Qwen2 and Qwen3 causal LMs (see the module docstring for the switches)."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        _warn_if_sliding_window(config)
        self.config = config
        self.model = LlamaModel(config, prefix="model")
        self._init_lm_head(config)

    def attention_layers(self) -> list[Attention]:
        return [layer.self_attn.attn for layer in self.model.layers]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load checkpoint tensors by their Hugging Face names; returns the parameter names
        loaded. Raises ValueError on an unknown name or a parameter left unloaded."""
        params = dict(self.named_parameters())
        buffers = dict(self.named_buffers())
        loaded_shards: dict[str, set[int | str | None]] = {}
        for name, tensor in weights:
            if name.endswith("rotary_emb.inv_freq"):
                continue  # a derived buffer some old checkpoints carry
            if name.endswith(_IGNORED_ATTENTION_SCALES):
                continue
            targets = kv_scale_targets(name)
            if targets:
                # Read by an fp8 KV cache (kv_cache_dtype="fp8"); a 16-bit cache ignores them.
                for target in targets:
                    if target not in buffers:
                        raise ValueError(f"checkpoint weight {name!r} names no attention layer")
                    load_kv_scale(buffers[target], name, tensor)
                continue
            if name == "lm_head.weight" and self.tie_word_embeddings:
                continue
            param_name, shard_id = _fused_name(name)
            if param_name not in params:
                raise ValueError(f"checkpoint weight {name!r} has no matching model parameter")
            param = params[param_name]
            if shard_id is None:
                default_weight_loader(param, tensor)
            else:
                param.weight_loader(param, tensor, shard_id)
            loaded_shards.setdefault(param_name, set()).add(shard_id)
        self._check_all_loaded(params, loaded_shards)
        return set(loaded_shards)

    def _check_all_loaded(
        self, params: dict[str, nn.Parameter], loaded_shards: dict[str, set[int | str | None]]
    ) -> None:
        required = _required_shards(self)
        missing = [
            name
            for name in params
            if not required.get(name, {None}) <= loaded_shards.get(name, set())
        ]
        if missing:
            raise ValueError(f"checkpoint lacks weights for parameters: {', '.join(missing)}")


def _fused_name(name: str) -> tuple[str, int | str | None]:
    for checkpoint_part, fused_part, shard_id in _STACKED_PARAMS:
        if checkpoint_part in name:
            return name.replace(checkpoint_part, fused_part), shard_id
    return name, None


def _required_shards(model: nn.Module) -> dict[str, set[int | str | None]]:
    """For each fused parameter, every shard id it must receive."""
    required: dict[str, set[int | str | None]] = {}
    for module_name, module in model.named_modules():
        if isinstance(module, QKVLinear):
            shards: set[int | str | None] = set(QKVLinear._SHARDS)
        elif isinstance(module, MergedColumnLinear):
            shards = set(range(len(module.output_sizes)))
        else:
            continue
        for param_name, _ in module.named_parameters(recurse=False):
            required[f"{module_name}.{param_name}"] = shards
    return required
