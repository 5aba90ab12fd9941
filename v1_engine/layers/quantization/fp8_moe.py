"""Routed experts in block FP8: which form a MoE layer's stacked expert weights take, and the
128x128 block quantizer that online quantization uses for them.

The fused MoE op runs FP8 experts in one layout only, the DeepSeek-V3 one: e4m3 weights with a
float32 scale per 128x128 block of each expert's matrix (`weight_scale_inv`, which multiplies).
So a block-FP8 checkpoint loads as stored, and `quantization="fp8"` quantizes high-precision
experts into the same layout after loading (the linear layers get per-channel scales instead;
the experts have no per-channel kernel). Per-tensor FP8 checkpoints of MoE models are refused.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import torch

from v1_engine.kernels.fp8 import BLOCK_SIZE, FP8_DTYPE, FP8_MAX, FP8_MIN_SCALE
from v1_engine.layers.quantization.base import QuantizationConfig
from v1_engine.layers.quantization.fp8 import Fp8Config

ExpertFormat = Literal["unquantized", "checkpoint_block_fp8", "online_block_fp8"]


def expert_weight_format(
    config: QuantizationConfig | None, checkpoint_names: Sequence[str]
) -> ExpertFormat:
    """How one MoE layer's experts are stored, given the quantization config in force and the
    checkpoint module names of its experts (e.g. "model.layers.3.mlp.experts.0.gate_proj").

    The experts are stacked into one tensor per projection, so `modules_to_not_convert` must
    list all of them or none; ValueError otherwise, and for FP8 checkpoints without 128x128
    blocks."""
    if config is None:
        return "unquantized"
    ignored = [config.is_ignored(name) for name in checkpoint_names]
    if all(ignored):
        return "unquantized"
    if any(ignored):
        listed = [name for name, flag in zip(checkpoint_names, ignored, strict=True) if flag]
        raise ValueError(
            f"quantization_config.modules_to_not_convert lists {listed[:4]} but not every routed "
            f"expert of the same layer: a layer's experts are stacked and quantized as a whole"
        )
    assert isinstance(config, Fp8Config), f"unknown quantization config {config!r}"
    if not config.serialized:
        return "online_block_fp8"
    if config.weight_block_size is None:
        raise ValueError(
            "quantization_config.weight_block_size must be one of ([128, 128],) for a model with "
            "routed experts (the fused MoE kernel takes block-scaled FP8 experts only), got None"
        )
    return "checkpoint_block_fp8"


def block_grid(rows: int, cols: int) -> tuple[int, int]:
    """The 128x128 block grid of a [rows, cols] matrix (the last row/column may be short)."""
    return -(-rows // BLOCK_SIZE), -(-cols // BLOCK_SIZE)


def quantize_matrix_block_fp8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A [rows, cols] matrix -> (e4m3 [rows, cols], a view of the padded block grid; float32
    scales [ceil(rows/128), ceil(cols/128)]), each 128x128 block's largest magnitude mapped to
    e4m3's max."""
    rows, cols = weight.shape
    grid_rows, grid_cols = block_grid(rows, cols)
    padded = torch.nn.functional.pad(
        weight.float(), (0, grid_cols * BLOCK_SIZE - cols, 0, grid_rows * BLOCK_SIZE - rows)
    )
    blocks = padded.view(grid_rows, BLOCK_SIZE, grid_cols, BLOCK_SIZE)
    scale = (blocks.abs().amax(dim=(1, 3)) / FP8_MAX).clamp(min=FP8_MIN_SCALE)
    q = (blocks / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q.view(grid_rows * BLOCK_SIZE, grid_cols * BLOCK_SIZE)[:rows, :cols], scale


@torch.no_grad()
def quantize_experts_block_fp8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Stacked experts [E, N, K] → (e4m3 [E, N, K], float32 scales [E, ceil(N/128),
    ceil(K/128)]), each block scaled so its largest magnitude maps to e4m3's max. One expert at
    a time, so the float32 working copy stays one expert's size."""
    num_experts, rows, cols = weight.shape
    q = torch.empty(weight.shape, dtype=FP8_DTYPE, device=weight.device)
    scale = torch.empty(
        (num_experts, *block_grid(rows, cols)), dtype=torch.float32, device=weight.device
    )
    for expert in range(num_experts):
        q[expert], scale[expert] = quantize_matrix_block_fp8(weight[expert])
    return q, scale
