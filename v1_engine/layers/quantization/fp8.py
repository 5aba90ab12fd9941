"""FP8 (e4m3) linear methods and the config that picks them.

Three ways a layer holds an FP8 weight:

- online (`quantization="fp8"` on a bf16/fp16/fp32 checkpoint): the weight loads in the model
  dtype and is quantized after loading, one scale per output channel; the high-precision tensor
  is then dropped, so the weight bytes really shrink.
- per-tensor (an FP8 checkpoint without `weight_block_size`): `weight_scale` per tensor and, for
  activation_scheme "static", `input_scale`. A fused layer (qkv, gate_up) loads one scale per
  shard; the shards' scales differ, so after loading they are expanded into per-output-channel
  scales (exact: no weight is requantized; the GEMM epilogue applies a scale per column anyway).
  Static input scales of the shards, which all quantize the same input, collapse to their max
  (the only choice that clips none of them).
- block (an FP8 checkpoint with `weight_block_size: [128, 128]`, the DeepSeek-V3 layout):
  `weight_scale_inv` per 128x128 block; activations are quantized per 1x128 group at run time.
  Fused shards must start on a block boundary (true of every released checkpoint).

Activations are quantized per token at run time unless the checkpoint fixes a static scale.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from v1_engine.kernels.fp8 import (
    BLOCK_SIZE,
    FP8_DTYPE,
    OUTPUT_DTYPES,
    block_scaled_mm,
    per_token_fp8_quant,
    per_token_group_fp8_quant,
    scaled_fp8_quant,
    scaled_mm,
)
from v1_engine.layers.quantization.base import (
    LinearMethod,
    QuantizationConfig,
    new_parameter,
    replace_parameter,
)

ACTIVATION_SCHEMES = ("static", "dynamic")
WEIGHT_BLOCK_SIZES = ([128, 128], None)
FP8_FORMATS = ("e4m3",)


def _gemm_out_dtype(dtype: torch.dtype) -> torch.dtype:
    """The GEMMs write bf16/fp16; a float32 model (the CPU default) gets bf16 and casts up: the
    bf16 rounding (2^-9) is far below FP8's own (2^-4)."""
    return dtype if dtype in OUTPUT_DTYPES else torch.bfloat16


def _flatten(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(-1, x.shape[-1])


def _finish(
    y: torch.Tensor, x: torch.Tensor, bias: torch.Tensor | None, bias_fused: bool
) -> torch.Tensor:
    y = y.to(x.dtype)
    if bias is not None and not bias_fused:
        y = y + bias
    return y.reshape(*x.shape[:-1], y.shape[-1])


def scaled_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: torch.Tensor | None,
    input_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """x quantized per token (or with a static per-tensor scale) times an FP8 weight with a
    per-tensor [1] or per-channel [N, 1] scale."""
    x2 = _flatten(x)
    if input_scale is None:
        q, scale = per_token_fp8_quant(x2)
    else:
        q, scale = scaled_fp8_quant(x2, input_scale)
    out_dtype = _gemm_out_dtype(x.dtype)
    bias_fused = bias is not None and bias.dtype == out_dtype
    y = scaled_mm(q, weight, scale, weight_scale, out_dtype, bias if bias_fused else None)
    return _finish(y, x, bias, bias_fused)


def _row_scales(layer: nn.Module, scale: torch.Tensor) -> torch.Tensor:
    """A per-tensor, per-shard or per-channel scale as [output_size, 1]."""
    flat = scale.float().reshape(-1)
    if flat.numel() == len(layer.output_sizes):
        sizes = torch.tensor(layer.output_sizes, device=flat.device)
        flat = flat.repeat_interleave(sizes)
    return flat.reshape(-1, 1)


def _block_scales_dense(scale: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """A [ceil(rows/128), ceil(cols/128)] block grid expanded to one scale per element."""
    dense = scale.float().repeat_interleave(BLOCK_SIZE, 0).repeat_interleave(BLOCK_SIZE, 1)
    return dense[:rows, :cols]


class Fp8OnlineLinearMethod(LinearMethod):
    """A high-precision checkpoint quantized at load: per-channel weight scales, dynamic
    per-token activation scales."""

    def create_weights(self, layer: nn.Module) -> None:
        new_parameter(layer, "weight", (layer.output_size, layer.input_size), None, "rows")

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        if layer.weight.dtype == FP8_DTYPE:
            return
        q, scale = per_token_fp8_quant(layer.weight.data)
        replace_parameter(layer, "weight", q)
        replace_parameter(layer, "weight_scale", scale)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return scaled_linear(x, layer.weight, layer.weight_scale, bias)

    def dequantized_weight(self, layer: nn.Module) -> torch.Tensor:
        if layer.weight.dtype != FP8_DTYPE:
            return layer.weight.float()
        return layer.weight.float() * layer.weight_scale


class Fp8PerTensorLinearMethod(LinearMethod):
    """An FP8 checkpoint with one weight scale per tensor (see the module docstring for fused
    layers), activations per token or with the checkpoint's static input scale."""

    def __init__(self, static_activations: bool) -> None:
        self.static_activations = static_activations

    def create_weights(self, layer: nn.Module) -> None:
        shape = (layer.output_size, layer.input_size)
        new_parameter(layer, "weight", shape, FP8_DTYPE, "rows")
        num_shards = len(layer.output_sizes)
        new_parameter(
            layer, "weight_scale", (num_shards,), torch.float32, "per_shard", is_scale=True
        )
        if self.static_activations:
            new_parameter(
                layer, "input_scale", (num_shards,), torch.float32, "per_shard", is_scale=True
            )

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        if len(layer.output_sizes) > 1:
            replace_parameter(layer, "weight_scale", _row_scales(layer, layer.weight_scale.data))
        if self.static_activations:
            replace_parameter(layer, "input_scale", layer.input_scale.data.max().reshape(1))

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        input_scale = layer.input_scale if self.static_activations else None
        return scaled_linear(x, layer.weight, layer.weight_scale, bias, input_scale)

    def dequantized_weight(self, layer: nn.Module) -> torch.Tensor:
        return layer.weight.float() * _row_scales(layer, layer.weight_scale.data)


class Fp8BlockLinearMethod(LinearMethod):
    """An FP8 checkpoint with one scale per 128x128 weight block (`weight_scale_inv`, which
    despite its name multiplies the weight) and dynamic 1x128 activation groups."""

    def create_weights(self, layer: nn.Module) -> None:
        misaligned = [s for s in layer.output_sizes[:-1] if s % BLOCK_SIZE]
        if misaligned:
            raise ValueError(
                f"quantization_config.weight_block_size [128, 128] needs every fused shard but "
                f"the last to be a multiple of 128 rows; got output_sizes {layer.output_sizes}"
            )
        shape = (layer.output_size, layer.input_size)
        new_parameter(layer, "weight", shape, FP8_DTYPE, "rows")
        grid = (-(-layer.output_size // BLOCK_SIZE), -(-layer.input_size // BLOCK_SIZE))
        new_parameter(layer, "weight_scale_inv", grid, torch.float32, "blocks", is_scale=True)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        q, scale = per_token_group_fp8_quant(_flatten(x), BLOCK_SIZE)
        out_dtype = _gemm_out_dtype(x.dtype)
        y = block_scaled_mm(q, layer.weight, scale, layer.weight_scale_inv, out_dtype)
        return _finish(y, x, bias, bias_fused=False)

    def dequantized_weight(self, layer: nn.Module) -> torch.Tensor:
        rows, cols = layer.weight.shape
        return layer.weight.float() * _block_scales_dense(layer.weight_scale_inv, rows, cols)


@dataclass(frozen=True)
class Fp8Config(QuantizationConfig):
    """FP8 e4m3 linear layers: quantized at load (`serialized=False`) or read from an FP8
    checkpoint with per-tensor or 128x128 block scales."""

    serialized: bool
    """The checkpoint already holds FP8 weights and their scales."""
    activation_scheme: str = "dynamic"
    """dynamic: per-token scales computed at run time; static: the checkpoint's input_scale."""
    weight_block_size: tuple[int, int] | None = None
    """(128, 128) for block-scaled checkpoints; None for per-tensor (or online) scales."""
    ignored_modules: tuple[str, ...] = ()

    name = "fp8"

    @classmethod
    def online(cls) -> Fp8Config:
        return cls(serialized=False)

    @classmethod
    def from_checkpoint(cls, quantization_config: dict[str, Any]) -> Fp8Config:
        """Parse a Hugging Face `quantization_config` (quant_method "fp8"); ValueError names the
        field and its allowed values when the checkpoint is in a form we cannot run."""
        qc = quantization_config
        method = qc.get("quant_method")
        if method != "fp8":
            raise ValueError(
                f"quantization_config.quant_method must be one of ('fp8',), got {method!r}"
            )
        fmt = qc.get("fmt", "e4m3")
        if fmt not in FP8_FORMATS:
            raise ValueError(f"quantization_config.fmt must be one of {FP8_FORMATS}, got {fmt!r}")
        scheme = qc.get("activation_scheme", "dynamic")
        if scheme not in ACTIVATION_SCHEMES:
            raise ValueError(
                f"quantization_config.activation_scheme must be one of {ACTIVATION_SCHEMES}, "
                f"got {scheme!r}"
            )
        block = qc.get("weight_block_size")
        block = list(block) if block is not None else None
        if block not in WEIGHT_BLOCK_SIZES:
            raise ValueError(
                f"quantization_config.weight_block_size must be one of {WEIGHT_BLOCK_SIZES}, "
                f"got {block!r}"
            )
        if block is not None and scheme != "dynamic":
            raise ValueError(
                "quantization_config.activation_scheme must be one of ('dynamic',) with "
                f"weight_block_size, got {scheme!r}"
            )
        ignored = [*(qc.get("modules_to_not_convert") or ()), *(qc.get("ignored_layers") or ())]
        return cls(
            serialized=True,
            activation_scheme=scheme,
            weight_block_size=tuple(block) if block else None,
            ignored_modules=tuple(ignored),
        )

    def get_linear_method(self) -> LinearMethod:
        if not self.serialized:
            return Fp8OnlineLinearMethod()
        if self.weight_block_size is not None:
            return Fp8BlockLinearMethod()
        return Fp8PerTensorLinearMethod(static_activations=self.activation_scheme == "static")
