"""Mixture of experts: DeepSeek routers, the routed experts' weights and a reference forward.

Routers (scores and selection in float32, like the reference models):
- V2: softmax scores; `greedy` top-k, or `group_limited_greedy`: experts are split into n_group
  groups, each group scored by its best expert, only the topk_group best groups stay eligible.
- V3 (`noaux_tc`): sigmoid scores; a learned e_score_correction_bias is added for the CHOICE only
  (the weights come from the unbiased scores); each group is scored by the sum of its two best
  biased scores; weights optionally renormalized (norm_topk_prob).
Both multiply the weights by routed_scaling_factor.

The reference forward sorts the (token, expert) pairs by expert and runs one GEMM pair per expert
over its contiguous rows, the same structure as a fused grouped-GEMM kernel. Models call it through
the custom op `torch.ops.v1_engine.fused_moe`: its data-dependent shapes stay opaque to
torch.compile (a fake impl gives the output shape). On CUDA the op runs the fused Triton kernels
of kernels/triton_moe.py (align by expert, grouped GEMMs with SiLU-and-mul fused, no host sync);
every other device runs the reference.

`RoutedExperts` holds the experts in the model dtype or, under an FP8 quantization config, in
block FP8 (e4m3 plus a float32 scale per 128x128 block, passed to the op as w13_scale / w2_scale):
see layers/quantization/fp8_moe.py for which form a layer takes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from v1_engine.kernels.fp8 import FP8_DTYPE
from v1_engine.layers.linear import copy_checked
from v1_engine.layers.quantization.base import replace_parameter
from v1_engine.layers.quantization.context import current_quant_config
from v1_engine.layers.quantization.fp8_moe import (
    block_grid,
    expert_weight_format,
    quantize_experts_block_fp8,
)

TOPK_METHODS = ("greedy", "group_limited_greedy", "noaux_tc")
FP8_BLOCK = 128
"""Block-FP8 experts carry one float32 scale per FP8_BLOCK x FP8_BLOCK block of each weight."""
PROJECTIONS = ("gate", "up", "down")
"""The checkpoint projections of one expert (`experts.{e}.{projection}_proj`)."""


@dataclass(frozen=True)
class RouterConfig:
    num_experts: int
    top_k: int
    topk_method: str
    """One of TOPK_METHODS: greedy / group_limited_greedy use softmax, noaux_tc sigmoid."""
    num_groups: int = 1
    topk_group: int = 1
    renormalize: bool = False
    """Divide the chosen weights by their sum (before routed_scaling_factor)."""
    routed_scaling_factor: float = 1.0

    def __post_init__(self) -> None:
        if self.topk_method not in TOPK_METHODS:
            raise ValueError(f"topk_method must be one of {TOPK_METHODS}, got {self.topk_method!r}")
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(
                f"num_experts_per_tok must be in [1, {self.num_experts}], got {self.top_k}"
            )
        if self.topk_method != "greedy":
            if self.num_groups < 1 or self.num_experts % self.num_groups:
                raise ValueError(
                    f"n_group must divide n_routed_experts ({self.num_experts}), "
                    f"got {self.num_groups}"
                )
            if not 1 <= self.topk_group <= self.num_groups:
                raise ValueError(
                    f"topk_group must be in [1, n_group={self.num_groups}], got {self.topk_group}"
                )


def _group_mask(
    group_scores: torch.Tensor, topk_group: int, experts_per_group: int
) -> torch.Tensor:
    """[T, E] True for the experts of each token's topk_group best groups."""
    best_groups = group_scores.topk(topk_group, dim=-1, sorted=False).indices
    mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best_groups, True)
    return mask.repeat_interleave(experts_per_group, dim=1)


def select_experts(
    router_logits: torch.Tensor, config: RouterConfig, correction_bias: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits [T, E] (float32) → (weights [T, top_k] float32, expert ids [T, top_k])."""
    num_tokens, num_experts = router_logits.shape
    per_group = num_experts // max(config.num_groups, 1)
    if config.topk_method == "noaux_tc":
        scores = router_logits.sigmoid()
        choice = scores if correction_bias is None else scores + correction_bias.float()
        grouped = choice.view(num_tokens, config.num_groups, per_group)
        group_scores = grouped.topk(min(2, per_group), dim=-1).values.sum(dim=-1)
        mask = _group_mask(group_scores, config.topk_group, per_group)
        choice = choice.masked_fill(~mask, float("-inf"))
        ids = choice.topk(config.top_k, dim=-1, sorted=False).indices
        weights = scores.gather(1, ids)
    else:
        scores = router_logits.softmax(dim=-1, dtype=torch.float32)
        if config.topk_method == "group_limited_greedy":
            group_scores = scores.view(num_tokens, config.num_groups, per_group).amax(dim=-1)
            mask = _group_mask(group_scores, config.topk_group, per_group)
            scores = scores.masked_fill(~mask, 0.0)
        weights, ids = scores.topk(config.top_k, dim=-1, sorted=False)
    if config.renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * config.routed_scaling_factor, ids


class MoEGate(nn.Module):
    """The router's linear layer (float32, as in the reference) and, for V3, the score bias."""

    def __init__(self, hidden_size: int, config: RouterConfig, with_correction_bias: bool) -> None:
        super().__init__()
        self.config = config
        weight = torch.empty(config.num_experts, hidden_size, dtype=torch.float32)
        self.weight = nn.Parameter(weight, requires_grad=False)
        if with_correction_bias:
            bias = torch.empty(config.num_experts, dtype=torch.float32)
            self.e_score_correction_bias = nn.Parameter(bias, requires_grad=False)
        else:
            self.register_parameter("e_score_correction_bias", None)

    def forward(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden [T, H] → (weights [T, top_k] float32, expert ids [T, top_k])."""
        logits = F.linear(hidden_states.float(), self.weight.float())
        return select_experts(logits, self.config, self.e_score_correction_bias)


def fused_experts_reference(
    hidden_states: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
) -> torch.Tensor:
    """Σ_k weight_k · down_e(silu(gate_e(x)) · up_e(x)) over each token's chosen experts.

    hidden [T, H]; w13 [E, 2I, H] (gate rows then up rows); w2 [E, H, I]. Pairs are sorted by
    expert so each expert runs two GEMMs on its contiguous rows; results are scattered back with
    index_add in float32.
    """
    num_tokens, top_k = topk_ids.shape
    flat_ids = topk_ids.reshape(-1)
    order = torch.argsort(flat_ids, stable=True)
    token_of_row = order // top_k
    rows = hidden_states.index_select(0, token_of_row)
    counts = torch.bincount(flat_ids, minlength=w13.shape[0]).tolist()
    outputs = []
    for expert, row_block in enumerate(rows.split(counts)):
        if row_block.shape[0] == 0:
            continue
        gate, up = F.linear(row_block, w13[expert]).chunk(2, dim=-1)
        outputs.append(F.linear(F.silu(gate) * up, w2[expert]))
    expert_out = torch.cat(outputs).float() * topk_weights.reshape(-1)[order, None].float()
    out = torch.zeros(
        num_tokens, hidden_states.shape[1], dtype=torch.float32, device=hidden_states.device
    )
    out.index_add_(0, token_of_row, expert_out)
    return out.to(hidden_states.dtype)


def dequantize_block_fp8(weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """float32 experts from e4m3 weight [E, N, K] and float32 scale [E, ceil(N/128),
    ceil(K/128)] (one scale per 128x128 block)."""
    _, n, k = weight.shape
    expanded = scale.float().repeat_interleave(FP8_BLOCK, dim=1)[:, :n]
    return weight.float() * expanded.repeat_interleave(FP8_BLOCK, dim=2)[:, :, :k]


def _fused_moe_reference(
    hidden_states: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    w13_scale: torch.Tensor | None,
    w2_scale: torch.Tensor | None,
) -> torch.Tensor:
    if w13_scale is None:
        return fused_experts_reference(hidden_states, w13, w2, topk_weights, topk_ids)
    assert w2_scale is not None, "block-FP8 experts need both scales"
    out = fused_experts_reference(
        hidden_states.float(),
        dequantize_block_fp8(w13, w13_scale),
        dequantize_block_fp8(w2, w2_scale),
        topk_weights,
        topk_ids,
    )
    return out.to(hidden_states.dtype)


@torch.library.custom_op("v1_engine::fused_moe", mutates_args=())
def fused_moe(
    hidden_states: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    w13_scale: torch.Tensor | None = None,
    w2_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """The routed experts' output [T, H] (see fused_experts_reference). Block-FP8 experts
    (e4m3 w13 / w2) come with float32 scales per 128x128 block; the reference dequantizes them."""
    return _fused_moe_reference(hidden_states, w13, w2, topk_weights, topk_ids, w13_scale, w2_scale)


@fused_moe.register_kernel("cuda")
def _fused_moe_cuda(
    hidden_states: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    w13_scale: torch.Tensor | None = None,
    w2_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """On CUDA: the fused Triton kernels (kernels/triton_moe.py), without a host sync."""
    from v1_engine.kernels.triton_moe import fused_moe_triton

    return fused_moe_triton(hidden_states, w13, w2, topk_weights, topk_ids, w13_scale, w2_scale)


@fused_moe.register_fake
def _fused_moe_fake(
    hidden_states: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    w13_scale: torch.Tensor | None = None,
    w2_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    return torch.empty_like(hidden_states)


class RoutedExperts(nn.Module):
    """The routed experts' weights as two 3D tensors: w13 [E, 2I, H] and w2 [E, H, I].

    Checkpoints store them per expert (gate_proj / up_proj / down_proj of expert e) or already
    stacked (gate_up_proj [E, 2I, H], down_proj [E, H, I]); `weight_loader` takes either, with
    shard ids ("gate", e), ("up", e), ("down", e), or "gate_up" / "down" for a stacked tensor.

    Under an FP8 quantization config (layers/quantization/fp8_moe.py) the weights are e4m3 with
    float32 block scales `w13_weight_scale_inv` [E, 2I/128, ceil(H/128)] and
    `w2_weight_scale_inv` [E, ceil(H/128), ceil(I/128)]: loaded per expert from a block-FP8
    checkpoint's `weight_scale_inv` tensors (gate's block rows, then up's), or computed after
    loading for `quantization="fp8"`. `prefix` is the checkpoint name of the experts module
    ("model.layers.3.mlp.experts"), matched against modules_to_not_convert.
    """

    def __init__(
        self, num_experts: int, hidden_size: int, intermediate_size: int, prefix: str = ""
    ) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.intermediate_size = intermediate_size
        names = [f"{prefix}.{e}.{p}_proj" for e in range(num_experts) for p in PROJECTIONS]
        self.weight_format = expert_weight_format(current_quant_config(), names)
        from_checkpoint = self.weight_format == "checkpoint_block_fp8"
        if from_checkpoint and intermediate_size % FP8_BLOCK:
            raise ValueError(
                f"moe_intermediate_size must be a multiple of {FP8_BLOCK} for block-FP8 experts "
                f"(gate and up are stacked on a block boundary), got {intermediate_size}"
            )
        weight_dtype = FP8_DTYPE if from_checkpoint else None
        shapes = {
            "w13": (num_experts, 2 * intermediate_size, hidden_size),
            "w2": (num_experts, hidden_size, intermediate_size),
        }
        for name, shape in shapes.items():
            self._new_parameter(f"{name}_weight", torch.empty(shape, dtype=weight_dtype))
            if from_checkpoint:
                grid = (num_experts, *block_grid(shape[1], shape[2]))
                scale = torch.empty(grid, dtype=torch.float32)
                self._new_parameter(f"{name}_weight_scale_inv", scale).is_quant_scale = True
            else:
                self.register_parameter(f"{name}_weight_scale_inv", None)

    def _new_parameter(self, name: str, data: torch.Tensor) -> nn.Parameter:
        param = nn.Parameter(data, requires_grad=False)
        param.weight_loader = self.weight_loader
        self.register_parameter(name, param)
        return param

    @property
    def is_fp8(self) -> bool:
        return self.w13_weight.dtype == FP8_DTYPE

    def required_shards(self, param_name: str) -> set[object]:
        """Every shard id that, loaded, fills the parameter (either form counts)."""
        parts = ("gate", "up") if param_name.startswith("w13") else ("down",)
        return {(part, e) for part in parts for e in range(self.num_experts)}

    def weight_loader(
        self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: object
    ) -> set[object]:
        """Copy one checkpoint tensor (a weight or its block scales); returns the shard ids it
        covered."""
        if getattr(param, "is_quant_scale", False):
            what = "block scales"
        else:
            what = "weight"
            _check_fp8_agreement(param, loaded_weight, shard_id)
        if shard_id in ("gate_up", "down"):
            copy_checked(param.data, loaded_weight, f"experts {shard_id} {what}")
            return self.required_shards("w13" if shard_id == "gate_up" else "w2")
        assert isinstance(shard_id, tuple), f"expert shard id {shard_id!r}"
        part, expert = shard_id
        target = param.data[expert]
        half = target.shape[0] // 2  # gate rows then up rows (scales: block rows)
        if part == "gate":
            target = target[:half]
        elif part == "up":
            target = target[half:]
        copy_checked(target, loaded_weight, f"expert {expert} {part}_proj {what}")
        return {shard_id}

    def process_weights_after_loading(self) -> None:
        """quantization="fp8": quantize the loaded experts per 128x128 block (once)."""
        if self.weight_format != "online_block_fp8" or self.is_fp8:
            return
        for name in ("w13", "w2"):
            q, scale = quantize_experts_block_fp8(getattr(self, f"{name}_weight").data)
            replace_parameter(self, f"{name}_weight", q)
            replace_parameter(self, f"{name}_weight_scale_inv", scale)

    def dequantized_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(w13, w2) in float32 whatever the storage, for code and tests that need the values."""
        if not self.is_fp8:
            return self.w13_weight.float(), self.w2_weight.float()
        return (
            dequantize_block_fp8(self.w13_weight, self.w13_weight_scale_inv),
            dequantize_block_fp8(self.w2_weight, self.w2_weight_scale_inv),
        )

    def forward(
        self, hidden_states: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
    ) -> torch.Tensor:
        return torch.ops.v1_engine.fused_moe(
            hidden_states,
            self.w13_weight,
            self.w2_weight,
            topk_weights,
            topk_ids,
            self.w13_weight_scale_inv,
            self.w2_weight_scale_inv,
        )

    def extra_repr(self) -> str:
        return (
            f"experts={self.num_experts}, intermediate={self.intermediate_size}, "
            f"format={self.weight_format}"
        )


def _check_fp8_agreement(
    param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: object
) -> None:
    """An e4m3 expert copied into high-precision storage (or the reverse) would silently lose
    its scale: refuse it, naming the config that decides the storage."""
    if (param.dtype == FP8_DTYPE) != (loaded_weight.dtype == FP8_DTYPE):
        raise ValueError(
            f"checkpoint tensor for experts shard {shard_id!r} has dtype {loaded_weight.dtype} "
            f"but the layer holds {param.dtype}: the checkpoint's quantization_config "
            f"(quant_method, weight_block_size, modules_to_not_convert) does not describe it"
        )
