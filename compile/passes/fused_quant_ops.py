"""RMSNorm / SiLU-and-mul fused with the dynamic FP8 activation quant of the next FP8 linear.

The fusion passes rewrite `norm -> per_token_fp8_quant` (and `silu_and_mul -> ...`, and the
per-token-group (block checkpoint) forms) into these ops, so the bf16 activation between the two
never reaches memory. Every op's PyTorch body is the unfused chain itself (fused_ops.py's
references, then kernels/fp8.py's quant references): on the CPU the fused graph is bit-identical
to the unfused one. On CUDA the Triton kernels of kernels/triton_fused_quant.py run; they repeat
every rounding of the chain, and differ only where the norm's reduction order and the hardware
rsqrt/exp move a value across a rounding boundary (that module's docstring gives the bound).

Outputs: q e4m3 with the activation's shape, fp32 scales [..., 1] (per token) or
[..., ceil(K / group_size)] (per group, row-major like per_token_group_fp8_quant), and for the
residual forms the new residual x + residual, which the next sublayer needs.
"""

from __future__ import annotations

import torch

from compile.passes.fused_ops import rms_norm_ref, silu_and_mul_ref
from v1_engine.kernels.fp8 import (
    FP8_DTYPE,
    per_token_fp8_quant_ref,
    per_token_group_fp8_quant_ref,
)

Quantized = tuple[torch.Tensor, torch.Tensor]
QuantizedWithResidual = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


def _quantize_ref(y: torch.Tensor, group_size: int | None) -> Quantized:
    if group_size is None:
        return per_token_fp8_quant_ref(y)
    return per_token_group_fp8_quant_ref(y, group_size)


def rms_norm_quant_ref(
    x: torch.Tensor, weight: torch.Tensor, eps: float, group_size: int | None = None
) -> Quantized:
    """The unfused chain: RMSNorm, then the per-token (group_size None) or per-group quant."""
    return _quantize_ref(rms_norm_ref(x, weight, eps), group_size)


def add_rms_norm_quant_ref(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    group_size: int | None = None,
) -> QuantizedWithResidual:
    """The unfused chain with the residual add first; returns (q, scales, x + residual)."""
    summed = x + residual
    q, scales = rms_norm_quant_ref(summed, weight, eps, group_size)
    return q, scales, summed


def silu_and_mul_quant_ref(x: torch.Tensor, group_size: int | None = None) -> Quantized:
    """The unfused chain: silu(gate) * up of x = [gate | up], then the quant."""
    return _quantize_ref(silu_and_mul_ref(x), group_size)


def _triton():
    """The Triton kernels, imported on first CUDA use so CPU imports never need triton."""
    from v1_engine.kernels import triton_fused_quant

    return triton_fused_quant


def _fake_quantized(shape: torch.Size | tuple, like: torch.Tensor, group_size: int | None):
    num_scales = 1 if group_size is None else -(-shape[-1] // group_size)
    q = like.new_empty(shape, dtype=FP8_DTYPE)
    return q, like.new_empty((*shape[:-1], num_scales), dtype=torch.float32)


def _fake_silu_quantized(x: torch.Tensor, group_size: int | None) -> Quantized:
    return _fake_quantized((*x.shape[:-1], x.shape[-1] // 2), x, group_size)


def _fake_with_residual(
    x: torch.Tensor, residual: torch.Tensor, group_size: int | None
) -> QuantizedWithResidual:
    summed = torch.empty_like(x + residual)
    return (*_fake_quantized(x.shape, x, group_size), summed)


# ---- per token --------------------------------------------------------------------------------


@torch.library.custom_op("v1_engine::rms_norm_per_token_fp8_quant", mutates_args=())
def rms_norm_per_token_fp8_quant(x: torch.Tensor, weight: torch.Tensor, eps: float) -> Quantized:
    """per_token_fp8_quant(weight * rmsnorm(x))."""
    return rms_norm_quant_ref(x, weight, eps)


@rms_norm_per_token_fp8_quant.register_kernel("cuda")
def _(x: torch.Tensor, weight: torch.Tensor, eps: float) -> Quantized:
    return _triton().rms_norm_quant(x, None, weight, eps, None)[:2]


@rms_norm_per_token_fp8_quant.register_fake
def _(x: torch.Tensor, weight: torch.Tensor, eps: float) -> Quantized:
    return _fake_quantized(x.shape, x, None)


@torch.library.custom_op("v1_engine::add_rms_norm_per_token_fp8_quant", mutates_args=())
def add_rms_norm_per_token_fp8_quant(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> QuantizedWithResidual:
    """(per_token_fp8_quant(weight * rmsnorm(x + residual)), x + residual)."""
    return add_rms_norm_quant_ref(x, residual, weight, eps)


@add_rms_norm_per_token_fp8_quant.register_kernel("cuda")
def _(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> QuantizedWithResidual:
    return _triton().rms_norm_quant(x, residual, weight, eps, None)


@add_rms_norm_per_token_fp8_quant.register_fake
def _(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> QuantizedWithResidual:
    return _fake_with_residual(x, residual, None)


@torch.library.custom_op("v1_engine::silu_and_mul_per_token_fp8_quant", mutates_args=())
def silu_and_mul_per_token_fp8_quant(x: torch.Tensor) -> Quantized:
    """per_token_fp8_quant(silu(gate) * up) for x = [gate | up]."""
    return silu_and_mul_quant_ref(x)


@silu_and_mul_per_token_fp8_quant.register_kernel("cuda")
def _(x: torch.Tensor) -> Quantized:
    return _triton().silu_and_mul_quant(x, None)


@silu_and_mul_per_token_fp8_quant.register_fake
def _(x: torch.Tensor) -> Quantized:
    return _fake_silu_quantized(x, None)


# ---- per token group (the activations of block-scaled checkpoints) -----------------------------


@torch.library.custom_op("v1_engine::rms_norm_per_token_group_fp8_quant", mutates_args=())
def rms_norm_per_token_group_fp8_quant(
    x: torch.Tensor, weight: torch.Tensor, eps: float, group_size: int
) -> Quantized:
    """per_token_group_fp8_quant(weight * rmsnorm(x), group_size)."""
    return rms_norm_quant_ref(x, weight, eps, group_size)


@rms_norm_per_token_group_fp8_quant.register_kernel("cuda")
def _(x: torch.Tensor, weight: torch.Tensor, eps: float, group_size: int) -> Quantized:
    return _triton().rms_norm_quant(x, None, weight, eps, group_size)[:2]


@rms_norm_per_token_group_fp8_quant.register_fake
def _(x: torch.Tensor, weight: torch.Tensor, eps: float, group_size: int) -> Quantized:
    return _fake_quantized(x.shape, x, group_size)


@torch.library.custom_op("v1_engine::add_rms_norm_per_token_group_fp8_quant", mutates_args=())
def add_rms_norm_per_token_group_fp8_quant(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, group_size: int
) -> QuantizedWithResidual:
    """(per_token_group_fp8_quant(weight * rmsnorm(x + residual), group_size), x + residual)."""
    return add_rms_norm_quant_ref(x, residual, weight, eps, group_size)


@add_rms_norm_per_token_group_fp8_quant.register_kernel("cuda")
def _(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, group_size: int
) -> QuantizedWithResidual:
    return _triton().rms_norm_quant(x, residual, weight, eps, group_size)


@add_rms_norm_per_token_group_fp8_quant.register_fake
def _(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, group_size: int
) -> QuantizedWithResidual:
    return _fake_with_residual(x, residual, group_size)


@torch.library.custom_op("v1_engine::silu_and_mul_per_token_group_fp8_quant", mutates_args=())
def silu_and_mul_per_token_group_fp8_quant(x: torch.Tensor, group_size: int) -> Quantized:
    """per_token_group_fp8_quant(silu(gate) * up, group_size) for x = [gate | up]."""
    return silu_and_mul_quant_ref(x, group_size)


@silu_and_mul_per_token_group_fp8_quant.register_kernel("cuda")
def _(x: torch.Tensor, group_size: int) -> Quantized:
    return _triton().silu_and_mul_quant(x, group_size)


@silu_and_mul_per_token_group_fp8_quant.register_fake
def _(x: torch.Tensor, group_size: int) -> Quantized:
    return _fake_silu_quantized(x, group_size)
