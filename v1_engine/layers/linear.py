"""Linear layers whose fused weights are loaded shard by shard from separate checkpoint tensors.

Each parameter carries a `weight_loader(param, loaded_weight, shard_id)` attribute, so the model's
`load_weights` only maps checkpoint names to (parameter, shard) and never knows the layouts. How
the weight is stored and multiplied (as is, or FP8 with scales) is the layer's linear method,
picked from the quantization config in force while the model is built (layers/quantization/);
the method's scale tensors load shard by shard like the weight.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from v1_engine.kernels.fp8 import BLOCK_SIZE, FP8_DTYPE
from v1_engine.layers.quantization.base import LinearMethod, UnquantizedLinearMethod, new_parameter
from v1_engine.layers.quantization.context import current_linear_method


def copy_checked(target: torch.Tensor, loaded_weight: torch.Tensor, what: str) -> None:
    """Copy a checkpoint tensor into (a slice of) a parameter, refusing a shape mismatch."""
    if target.shape != loaded_weight.shape:
        raise ValueError(
            f"checkpoint tensor for {what} has shape {tuple(loaded_weight.shape)}, "
            f"expected {tuple(target.shape)}"
        )
    target.copy_(loaded_weight)


def _check_fp8_agreement(target: torch.Tensor, loaded_weight: torch.Tensor, what: str) -> None:
    """An FP8 tensor copied into a high-precision parameter (or the reverse) would silently
    lose its scale: refuse it, naming the config that decides which layers are quantized."""
    if (target.dtype == FP8_DTYPE) != (loaded_weight.dtype == FP8_DTYPE):
        raise ValueError(
            f"checkpoint tensor for {what} has dtype {loaded_weight.dtype} but the layer holds "
            f"{target.dtype}: the checkpoint's quantization_config (quant_method, "
            f"modules_to_not_convert / ignored_layers) does not describe this tensor"
        )


class Linear(nn.Module):
    """y = x W^T (+ b) with W [output_size, input_size], loaded from one checkpoint tensor."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool = False,
        *,
        output_sizes: Sequence[int] | None = None,
    ) -> None:
        super().__init__()
        self.input_size = input_size
        self.output_sizes = list(output_sizes) if output_sizes is not None else [output_size]
        assert sum(self.output_sizes) == output_size, "output_sizes must sum to output_size"
        self.output_size = output_size
        if bias:
            new_parameter(self, "bias", (output_size,), None, "rows")
        else:
            self.register_parameter("bias", None)
        self.set_quant_method(current_linear_method())

    def set_quant_method(self, method: LinearMethod) -> None:
        """(Re)create the weight parameters for `method`; the bias stays in the model dtype."""
        for name in [n for n in self._parameters if n != "bias"]:
            del self._parameters[name]
        self.quant_method = method
        method.create_weights(self)

    def shard_index(self, shard_id: int | str | None) -> int:
        assert shard_id is None, f"{type(self).__name__} has no shards"
        return 0

    def weight_loader(
        self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: int | str | None = None
    ) -> None:
        """Copy one checkpoint tensor (the whole layer, or one shard of a fused one) into the
        part of `param` its `shard_layout` says it covers."""
        index = self.shard_index(shard_id)
        what = type(self).__name__
        if shard_id is not None:
            what = f"{what} shard {shard_id!r}"
        target = self._shard_of(param, index)
        if param.shard_layout == "per_shard":
            if loaded_weight.numel() != 1:
                raise ValueError(
                    f"checkpoint tensor for {what} has shape {tuple(loaded_weight.shape)}, "
                    f"expected one value (a per-tensor scale)"
                )
            loaded_weight = loaded_weight.reshape(1)
        _check_fp8_agreement(target, loaded_weight, what)
        copy_checked(target, loaded_weight, what)

    def _shard_of(self, param: nn.Parameter, index: int) -> torch.Tensor:
        offset, size = sum(self.output_sizes[:index]), self.output_sizes[index]
        if param.shard_layout == "per_shard":
            return param.data.narrow(0, index, 1)
        if param.shard_layout == "blocks":
            assert offset % BLOCK_SIZE == 0, "block-scaled shards start on a block boundary"
            return param.data.narrow(0, offset // BLOCK_SIZE, -(-size // BLOCK_SIZE))
        return param.data.narrow(0, offset, size)

    def process_weights_after_loading(self) -> None:
        """Give the linear method the loaded tensors (e.g. quantize them); once, after load."""
        self.quant_method.process_weights_after_loading(self)

    def dequantized_weight(self) -> torch.Tensor:
        """W [output_size, input_size] in float32 whatever the storage, for code that uses the
        weight directly (e.g. MLA's weight absorption)."""
        return self.quant_method.dequantized_weight(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.quant_method.apply(self, x, self.bias)

    def extra_repr(self) -> str:
        text = f"in={self.input_size}, out={self.output_size}, bias={self.bias is not None}"
        if not isinstance(self.quant_method, UnquantizedLinearMethod):
            text += f", method={type(self.quant_method).__name__}"
        return text


class MergedColumnLinear(Linear):
    """Several linears over the same input, concatenated along the output (e.g. gate and up)."""

    def __init__(self, input_size: int, output_sizes: Sequence[int], bias: bool = False) -> None:
        super().__init__(input_size, sum(output_sizes), bias, output_sizes=output_sizes)

    def shard_index(self, shard_id: int | str | None) -> int:
        assert shard_id is not None, f"{type(self).__name__} loads one shard at a time"
        assert isinstance(shard_id, int), f"shard id {shard_id!r} must be an int"
        return shard_id


class QKVLinear(MergedColumnLinear):
    """The q, k and v projections fused in one matmul; shards are named "q", "k", "v"."""

    _SHARDS = ("q", "k", "v")

    def __init__(
        self, hidden_size: int, head_size: int, num_heads: int, num_kv_heads: int, bias: bool
    ) -> None:
        q_size, kv_size = num_heads * head_size, num_kv_heads * head_size
        super().__init__(hidden_size, [q_size, kv_size, kv_size], bias)
        self.q_size = q_size
        self.kv_size = kv_size

    def shard_index(self, shard_id: int | str | None) -> int:
        assert shard_id in self._SHARDS, f"QKV shard id must be one of {self._SHARDS}"
        return self._SHARDS.index(shard_id)
