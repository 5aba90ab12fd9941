"""Linear layers whose fused weights are loaded shard by shard from separate checkpoint tensors.

Each parameter carries a `weight_loader(param, loaded_weight, shard_id)` attribute, so the model's
`load_weights` only maps checkpoint names to (parameter, shard) and never knows the layouts.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn


def copy_checked(target: torch.Tensor, loaded_weight: torch.Tensor, what: str) -> None:
    """Copy a checkpoint tensor into (a slice of) a parameter, refusing a shape mismatch."""
    if target.shape != loaded_weight.shape:
        raise ValueError(
            f"checkpoint tensor for {what} has shape {tuple(loaded_weight.shape)}, "
            f"expected {tuple(target.shape)}"
        )
    target.copy_(loaded_weight)


class Linear(nn.Module):
    """y = x W^T (+ b) with W [output_size, input_size], loaded from one checkpoint tensor."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False) -> None:
        super().__init__()
        self.input_size = input_size
        self.output_size = output_size
        self.weight = nn.Parameter(torch.empty(output_size, input_size), requires_grad=False)
        self.weight.weight_loader = self.weight_loader
        if bias:
            self.bias = nn.Parameter(torch.empty(output_size), requires_grad=False)
            self.bias.weight_loader = self.weight_loader
        else:
            self.register_parameter("bias", None)

    def weight_loader(
        self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: int | str | None = None
    ) -> None:
        assert shard_id is None, f"{type(self).__name__} has no shards"
        copy_checked(param.data, loaded_weight, type(self).__name__)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        return f"in={self.input_size}, out={self.output_size}, bias={self.bias is not None}"


class MergedColumnLinear(Linear):
    """Several linears over the same input, concatenated along the output (e.g. gate and up)."""

    def __init__(self, input_size: int, output_sizes: Sequence[int], bias: bool = False) -> None:
        super().__init__(input_size, sum(output_sizes), bias)
        self.output_sizes = list(output_sizes)

    def shard_index(self, shard_id: int | str) -> int:
        assert isinstance(shard_id, int), f"shard id {shard_id!r} must be an int"
        return shard_id

    def weight_loader(
        self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: int | str | None = None
    ) -> None:
        assert shard_id is not None, f"{type(self).__name__} loads one shard at a time"
        index = self.shard_index(shard_id)
        offset = sum(self.output_sizes[:index])
        target = param.data.narrow(0, offset, self.output_sizes[index])
        copy_checked(target, loaded_weight, f"{type(self).__name__} shard {shard_id!r}")


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

    def shard_index(self, shard_id: int | str) -> int:
        assert shard_id in self._SHARDS, f"QKV shard id must be one of {self._SHARDS}"
        return self._SHARDS.index(shard_id)
