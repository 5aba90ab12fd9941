"""The fused ops the fusion passes rewrite patterns into.

Each is an opaque custom op with a PyTorch reference body that computes exactly what the
unfused pattern computes (same operations, same order, so results are bit-identical). On CUDA
the Triton kernels of kernels/triton_fused.py run instead (one kernel each), as fused_quant_ops.py
does for the FP8 quant fusions built on the references here.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * rmsnorm(x), the norm computed in float32: layers/norm.py's RMSNorm, op for op."""
    x32 = x.to(torch.float32)
    variance = x32.pow(2).mean(-1, keepdim=True)
    return weight * (x32 * torch.rsqrt(variance + eps)).to(x.dtype)


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    """x = [gate | up] along the last dim → silu(gate) * up: layers/activation.py's SiluAndMul."""
    half = x.shape[-1] // 2
    return F.silu(x[..., :half]) * x[..., half:]


@torch.library.custom_op("v1_engine::fused_add_rms_norm", mutates_args=())
def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weight * rmsnorm(x + residual), x + residual), the norm computed in float32."""
    return fused_add_rms_norm_ref(x, residual, weight, eps)


def fused_add_rms_norm_ref(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    summed = x + residual
    return rms_norm_ref(summed, weight, eps), summed


@fused_add_rms_norm.register_fake
def _fused_add_rms_norm_fake(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    summed = torch.empty_like(x + residual)
    normed = torch.empty_like(weight * summed)
    return normed, summed


@torch.library.custom_op("v1_engine::silu_and_mul", mutates_args=())
def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x = [gate | up] along the last dim → silu(gate) * up."""
    return silu_and_mul_ref(x)


@silu_and_mul.register_fake
def _silu_and_mul_fake(x: torch.Tensor) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], x.shape[-1] // 2))


def _triton():
    """The Triton kernels, imported on first CUDA use so CPU imports never need triton."""
    from v1_engine.kernels import triton_fused

    return triton_fused


@fused_add_rms_norm.register_kernel("cuda")
def _(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    if residual.dtype != x.dtype:  # the kernel reads both in one dtype
        return fused_add_rms_norm_ref(x, residual, weight, eps)
    return _triton().add_rms_norm(x, residual, weight, eps)


@silu_and_mul.register_kernel("cuda")
def _(x: torch.Tensor) -> torch.Tensor:
    return _triton().silu_and_mul(x)
