"""The linear-method interface: how a Linear layer holds its weights and computes x W^T.

A Linear layer owns its sizes and bias; its method creates the weight parameters (and scales),
turns the loaded checkpoint tensors into the form `apply` wants, and runs the matmul. Each
parameter carries a `shard_layout` telling the layer's weight loader where one shard of a fused
layer lands in it:

- "rows": output rows (the weight, a bias, per-output-channel scales);
- "blocks": rows of a 128x128 block grid (block scales; shard offsets must be block-aligned);
- "per_shard": one value per shard (per-tensor scales of fused checkpoints).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

ShardLayout = Literal["rows", "blocks", "per_shard"]


def new_parameter(
    layer: nn.Module,
    name: str,
    shape: tuple[int, ...],
    dtype: torch.dtype | None,
    layout: ShardLayout,
    *,
    is_scale: bool = False,
) -> nn.Parameter:
    """Register an uninitialized parameter on `layer` (default device/dtype unless `dtype` is
    given), routed through the layer's shard-aware weight loader."""
    param = nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False)
    param.shard_layout = layout
    param.is_quant_scale = is_scale
    param.weight_loader = layer.weight_loader
    layer.register_parameter(name, param)
    return param


def replace_parameter(layer: nn.Module, name: str, data: torch.Tensor) -> None:
    """Swap a parameter's tensor for a new one (a new dtype or shape) so the old storage is
    freed once nothing else references it."""
    layer.register_parameter(name, nn.Parameter(data, requires_grad=False))


class LinearMethod(ABC):
    """How a Linear layer stores and applies its weight (see the module docstring)."""

    @abstractmethod
    def create_weights(self, layer: nn.Module) -> None:
        """Register the parameters the checkpoint fills; `layer` has input_size, output_sizes."""

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        """Turn the loaded tensors into the form `apply` reads; runs once after loading."""

    @abstractmethod
    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x [..., input_size] → [..., output_size] in x's dtype."""

    @abstractmethod
    def dequantized_weight(self, layer: nn.Module) -> torch.Tensor:
        """The weight [output_size, input_size] in float32 (before or after processing), for
        code that consumes a weight directly instead of calling the layer."""


class UnquantizedLinearMethod(LinearMethod):
    """The weight as stored, in the model dtype: y = x W^T + b."""

    def create_weights(self, layer: nn.Module) -> None:
        new_parameter(layer, "weight", (layer.output_size, layer.input_size), None, "rows")

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if x.is_cuda and layer.weight.dtype in (torch.bfloat16, torch.float16):
            # Imported here so CPU-only installs never need triton. The op picks the skinny
            # Triton GEMM for decode-sized batches and F.linear otherwise.
            from v1_engine.kernels import skinny_launch, skinny_linear_op

            if skinny_launch.SKINNY_GEMM_ENABLED:
                return skinny_linear_op.skinny_linear(x, layer.weight, bias)
        return F.linear(x, layer.weight, bias)

    def dequantized_weight(self, layer: nn.Module) -> torch.Tensor:
        return layer.weight.float()


class QuantizationConfig(ABC):
    """Which linear method each layer gets, built from the engine's `quantization` and the
    checkpoint's `quantization_config`."""

    name: str
    ignored_modules: tuple[str, ...] = ()
    """Checkpoint module names (or dotted runs of name parts, e.g. "lm_head" or
    "layers.0.mlp.down_proj") kept unquantized."""

    @abstractmethod
    def get_linear_method(self) -> LinearMethod:
        """The method of every linear layer that is not ignored."""

    def is_ignored(self, checkpoint_name: str) -> bool:
        """Whether a checkpoint module name (e.g. "model.layers.0.self_attn.q_proj") is listed
        in ignored_modules: matched on whole dotted parts, so "layers.1" never matches
        "layers.10"."""
        parts = checkpoint_name.split(".")
        for entry in self.ignored_modules:
            run = entry.split(".")
            if any(parts[i : i + len(run)] == run for i in range(len(parts) - len(run) + 1)):
                return True
        return False
