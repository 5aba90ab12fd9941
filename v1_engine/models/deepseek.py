"""DeepSeek-V2 / V2-Lite / V3: Multi-head Latent Attention and mixture-of-experts layers.

Each layer's attention compresses keys and values into one latent per token (kv_lora_rank values
plus a shared rope key of qk_rope_head_dim), cached once for all heads (layers/mla.py). The query
is projected directly (q_proj) or through a low-rank bottleneck (q_a_proj, norm, q_b_proj) when
q_lora_rank is set. The first `first_k_dense_replace` layers have a dense MLP, the others a MoE
of routed experts plus shared experts (layers/moe.py). V3 checkpoints may carry multi-token-
prediction layers after the last decoder layer: they are skipped when loading.

Block-FP8 checkpoints (DeepSeek-V3's own format, `weight_block_size: [128, 128]`) load as stored:
every Linear through the block linear method, the routed experts as stacked e4m3 tensors with
their per-expert `weight_scale_inv` block scales, which the fused MoE op consumes. The router
stays float32 and kv_b_proj is absorbed from its dequantized weight.

Like the Llama model, `forward` takes the step's tokens [T] and positions [T] packed without
padding.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from v1_engine.layers.activation import SiluAndMul
from v1_engine.layers.decoder import CausalLMBase, PreNormDecoderLayer, PreNormDecoderStack
from v1_engine.layers.embedding import VocabEmbedding
from v1_engine.layers.linear import Linear, MergedColumnLinear
from v1_engine.layers.mla import MLAAttention
from v1_engine.layers.moe import MoEGate, RoutedExperts, RouterConfig
from v1_engine.layers.norm import RMSNorm
from v1_engine.layers.rotary import (
    RotaryEmbedding,
    get_scaled_rope,
    rope_parameters_of,
    yarn_softmax_mscale,
)
from v1_engine.models.weights import default_weight_loader

logger = logging.getLogger(__name__)

# The reference builds the q_a / kv_a norms with the default epsilon, not rms_norm_eps.
LATENT_NORM_EPS = 1e-6
_LAYER_INDEX = re.compile(r"^model\.layers\.(\d+)\.")
_EXPERT_WEIGHT = re.compile(
    r"^(.*\.mlp\.experts)\.(\d+)\.(gate|up|down)_proj\.(weight|weight_scale_inv)$"
)
_STACKED_EXPERTS = re.compile(r"^(.*\.mlp\.experts)\.(gate_up|down)_proj$")
_DENSE_STACKED = ((".gate_proj.", ".gate_up_proj.", 0), (".up_proj.", ".gate_up_proj.", 1))


class DeepseekMLP(nn.Module):
    """A gated SiLU MLP: the dense layers' MLP and the shared experts."""

    def __init__(self, hidden_size: int, intermediate_size: int, hidden_act: str, bias: bool):
        super().__init__()
        if hidden_act != "silu":
            raise ValueError(f"hidden_act must be one of ('silu',), got {hidden_act!r}")
        sizes = [intermediate_size, intermediate_size]
        self.gate_up_proj = MergedColumnLinear(hidden_size, sizes, bias=bias)
        self.act_fn = SiluAndMul()
        self.down_proj = Linear(intermediate_size, hidden_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


def router_config_of(config: Any) -> RouterConfig:
    """V3 always routes with sigmoid + bias (noaux_tc); V2 with softmax and its topk_method.

    V2 ignores norm_topk_prob, as the reference implementation does (released V2 checkpoints set
    it to false)."""
    if config.num_experts_per_tok is None:
        raise ValueError("num_experts_per_tok must be set for a model with MoE layers")
    is_v3 = config.model_type == "deepseek_v3"
    method = "noaux_tc" if is_v3 else (getattr(config, "topk_method", None) or "greedy")
    return RouterConfig(
        num_experts=config.n_routed_experts,
        top_k=config.num_experts_per_tok,
        topk_method=method,
        num_groups=config.n_group or 1,
        topk_group=config.topk_group or 1,
        renormalize=bool(config.norm_topk_prob) if is_v3 else False,
        routed_scaling_factor=float(config.routed_scaling_factor),
    )


class DeepseekMoE(nn.Module):
    """Routed experts (top-k per token) plus shared experts every token goes through."""

    def __init__(self, config: Any, prefix: str) -> None:
        super().__init__()
        router = router_config_of(config)
        self.gate = MoEGate(
            config.hidden_size, router, with_correction_bias=router.topk_method == "noaux_tc"
        )
        self.experts = RoutedExperts(
            config.n_routed_experts,
            config.hidden_size,
            config.moe_intermediate_size,
            prefix=f"{prefix}.experts",
        )
        num_shared = config.n_shared_experts or 0
        self.shared_experts = None
        if num_shared:
            self.shared_experts = DeepseekMLP(
                config.hidden_size,
                config.moe_intermediate_size * num_shared,
                config.hidden_act,
                bias=bool(getattr(config, "mlp_bias", False)),
            )

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        topk_weights, topk_ids = self.gate(hidden_states)
        out = self.experts(hidden_states, topk_weights, topk_ids)
        if self.shared_experts is not None:
            out = out + self.shared_experts(hidden_states)
        return out


class DeepseekAttention(nn.Module):
    """The projections around MLA: queries (optionally low-rank), the KV latent and its rope key,
    and the output projection; kv_b_proj is absorbed into the MLA layer after loading."""

    def __init__(self, config: Any, rotary_emb: RotaryEmbedding, prefix: str) -> None:
        super().__init__()
        hidden = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.qk_nope_head_dim = config.qk_nope_head_dim
        self.qk_rope_head_dim = config.qk_rope_head_dim
        self.v_head_dim = config.v_head_dim
        self.kv_lora_rank = config.kv_lora_rank
        self.q_lora_rank = config.q_lora_rank
        qk_head_dim = self.qk_nope_head_dim + self.qk_rope_head_dim
        bias = bool(getattr(config, "attention_bias", False))
        if self.q_lora_rank is None:
            self.q_proj = Linear(hidden, self.num_heads * qk_head_dim)
        else:
            self.q_a_proj = Linear(hidden, self.q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(self.q_lora_rank, eps=LATENT_NORM_EPS)
            self.q_b_proj = Linear(self.q_lora_rank, self.num_heads * qk_head_dim)
        self.kv_a_proj_with_mqa = Linear(hidden, self.kv_lora_rank + self.qk_rope_head_dim, bias)
        self.kv_a_layernorm = RMSNorm(self.kv_lora_rank, eps=LATENT_NORM_EPS)
        self.kv_b_proj = Linear(
            self.kv_lora_rank, self.num_heads * (self.qk_nope_head_dim + self.v_head_dim)
        )
        self.o_proj = Linear(self.num_heads * self.v_head_dim, hidden, bias=bias)
        self.rotary_emb = rotary_emb
        mscale = yarn_softmax_mscale(rope_parameters_of(config))
        self.mla_attn = MLAAttention(
            self.num_heads,
            self.qk_nope_head_dim,
            self.qk_rope_head_dim,
            self.v_head_dim,
            self.kv_lora_rank,
            scale=qk_head_dim**-0.5 * mscale * mscale,
            layer_name=f"{prefix}.mla_attn",
        )

    def process_weights_after_loading(self) -> None:
        """Absorb kv_b_proj into the MLA layer. A weight held in the model dtype is split into
        views (one copy of its values); an FP8 one is dequantized once into the model dtype and
        W_UK / W_UV view that copy. No path calls kv_b_proj afterwards (decode and prefill both
        use W_UK / W_UV), so its e4m3 tensor is never multiplied."""
        weight = self.kv_b_proj.weight
        model_dtype = self.kv_a_layernorm.weight.dtype
        if weight.dtype != model_dtype:
            weight = self.kv_b_proj.dequantized_weight().to(model_dtype)
        self.mla_attn.absorb(weight)

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        num_tokens = hidden_states.shape[0]
        if self.q_lora_rank is None:
            q = self.q_proj(hidden_states)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(hidden_states)))
        q = q.view(num_tokens, self.num_heads, self.qk_nope_head_dim + self.qk_rope_head_dim)
        q_nope, q_pe = q.split([self.qk_nope_head_dim, self.qk_rope_head_dim], dim=-1)
        kv_c, k_pe = self.kv_a_proj_with_mqa(hidden_states).split(
            [self.kv_lora_rank, self.qk_rope_head_dim], dim=-1
        )
        kv_c = self.kv_a_layernorm(kv_c)
        q_pe, k_pe = self.rotary_emb(positions, q_pe, k_pe.unsqueeze(1))
        return self.o_proj(self.mla_attn(q_nope, q_pe, kv_c, k_pe.squeeze(1)))


class DeepseekDecoderLayer(PreNormDecoderLayer):
    def __init__(
        self, config: Any, layer_idx: int, rotary_emb: RotaryEmbedding, prefix: str
    ) -> None:
        super().__init__()
        self.self_attn = DeepseekAttention(config, rotary_emb, prefix=f"{prefix}.self_attn")
        if layer_idx >= (config.first_k_dense_replace or 0):
            self.mlp: nn.Module = DeepseekMoE(config, prefix=f"{prefix}.mlp")
        else:
            self.mlp = DeepseekMLP(
                config.hidden_size,
                config.intermediate_size,
                config.hidden_act,
                bias=bool(getattr(config, "mlp_bias", False)),
            )
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)


class DeepseekModel(PreNormDecoderStack):
    def __init__(self, config: Any, prefix: str = "model") -> None:
        super().__init__()
        self.embed_tokens = VocabEmbedding(config.vocab_size, config.hidden_size)
        # V2 always interleaves the rope dims; V3 does unless rope_interleave is false.
        interleaved = config.model_type != "deepseek_v3" or getattr(config, "rope_interleave", True)
        self.rotary_emb = get_scaled_rope(
            config.qk_rope_head_dim,
            config.max_position_embeddings,
            rope_parameters_of(config),
            is_neox_style=not interleaved,
        )
        self.layers = nn.ModuleList(
            DeepseekDecoderLayer(config, i, self.rotary_emb, prefix=f"{prefix}.layers.{i}")
            for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)


class DeepseekV2ForCausalLM(CausalLMBase):
    """DeepSeek-V2 / V2-Lite (and, through the subclass, V3) causal LMs."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        self.config = config
        self.model = DeepseekModel(config, prefix="model")
        self._init_lm_head(config)

    def attention_layers(self) -> list[MLAAttention]:
        return [layer.self_attn.mla_attn for layer in self.model.layers]

    @torch.no_grad()
    def process_weights_after_loading(self) -> None:
        """Split every kv_b_proj into W_UK / W_UV (weight absorption) and, for
        quantization="fp8", quantize the routed experts; run after any load."""
        for layer in self.model.layers:
            layer.self_attn.process_weights_after_loading()
            if isinstance(layer.mlp, DeepseekMoE):
                layer.mlp.experts.process_weights_after_loading()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load checkpoint tensors by their Hugging Face names (experts per expert or stacked);
        returns the parameter names loaded. Multi-token-prediction layers (indices past the
        last decoder layer) are skipped. Raises ValueError on an unknown name or a parameter
        left unloaded."""
        params = dict(self.named_parameters())
        loaded: dict[str, set[object]] = {}
        num_skipped = 0
        for name, tensor in weights:
            if self._skip(name):
                num_skipped += 1
                continue
            param_name, shard_id = _param_name_of(name)
            if param_name not in params:
                raise ValueError(f"checkpoint weight {name!r} has no matching model parameter")
            param = params[param_name]
            if shard_id is None:
                default_weight_loader(param, tensor)
                covered: set[object] = {None}
            else:
                covered = param.weight_loader(param, tensor, shard_id) or {shard_id}
            loaded.setdefault(param_name, set()).update(covered)
        if num_skipped:
            logger.info(
                "skipped %d checkpoint tensors of multi-token-prediction layers", num_skipped
            )
        self._check_all_loaded(params, loaded)
        return set(loaded)

    def _skip(self, name: str) -> bool:
        if name.endswith("rotary_emb.inv_freq"):
            return True  # a derived buffer some checkpoints carry
        if name == "lm_head.weight" and self.tie_word_embeddings:
            return True
        match = _LAYER_INDEX.match(name)
        return match is not None and int(match.group(1)) >= self.config.num_hidden_layers

    def _check_all_loaded(
        self, params: dict[str, nn.Parameter], loaded: dict[str, set[object]]
    ) -> None:
        required = _required_shards(self)
        missing = [
            name for name in params if not required.get(name, {None}) <= loaded.get(name, set())
        ]
        if missing:
            raise ValueError(f"checkpoint lacks weights for parameters: {', '.join(missing)}")


class DeepseekV3ForCausalLM(DeepseekV2ForCausalLM):
    """DeepSeek-V3: sigmoid routing with a score bias and group-limited choice (noaux_tc)."""


def _param_name_of(name: str) -> tuple[str, object]:
    """(our parameter name, shard id or None) for a checkpoint tensor name."""
    match = _EXPERT_WEIGHT.match(name)
    if match:
        prefix, expert, part, kind = match.groups()
        param = "w2" if part == "down" else "w13"
        return f"{prefix}.{param}_{kind}", (part, int(expert))
    match = _STACKED_EXPERTS.match(name)
    if match:
        prefix, part = match.groups()
        param = "w2_weight" if part == "down" else "w13_weight"
        return f"{prefix}.{param}", part
    for checkpoint_part, fused_part, shard_id in _DENSE_STACKED:
        if checkpoint_part in name:
            return name.replace(checkpoint_part, fused_part), shard_id
    return name, None


def _required_shards(model: nn.Module) -> dict[str, set[object]]:
    """For each parameter filled shard by shard, every shard id it must receive."""
    required: dict[str, set[object]] = {}
    for module_name, module in model.named_modules():
        if isinstance(module, RoutedExperts):
            for param_name, _ in module.named_parameters(recurse=False):
                required[f"{module_name}.{param_name}"] = module.required_shards(param_name)
        elif isinstance(module, MergedColumnLinear):
            for param_name, _ in module.named_parameters(recurse=False):
                required[f"{module_name}.{param_name}"] = set(range(len(module.output_sizes)))
    return required
