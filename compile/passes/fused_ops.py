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


# ---- skinny GEMM epilogues (kernels/skinny_epilogues.py) ------------------------------------
# The unquantized linear layers call `v1_engine::skinny_linear` on CUDA (skinny_linear_op.py,
# F.linear elsewhere). These ops are that GEMM followed by the op the passes above produce, in
# one op: on CUDA one kernel for decode-sized batches, the two kernels otherwise.


@torch.library.custom_op("v1_engine::skinny_linear_silu_mul", mutates_args=())
def skinny_linear_silu_mul(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """silu_and_mul(x @ weight^T) for weight = [gate; up] [2I, K]: a gate_up_proj and its SiLU."""
    return silu_and_mul_ref(F.linear(x, weight))


@skinny_linear_silu_mul.register_fake
def _skinny_linear_silu_mul_fake(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return x.new_empty((x.shape[0], weight.shape[0] // 2))


@skinny_linear_silu_mul.register_kernel("cuda")
def _(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    from v1_engine.kernels.skinny_epilogues import silu_mul_linear_cuda

    return silu_mul_linear_cuda(x, weight)


@torch.library.custom_op("v1_engine::skinny_linear_add_rms_norm", mutates_args=())
def skinny_linear_add_rms_norm(
    x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """fused_add_rms_norm(x @ weight^T, residual, norm_weight, eps): an o_proj / down_proj and
    the residual add + RMSNorm after it."""
    return fused_add_rms_norm_ref(F.linear(x, weight), residual, norm_weight, eps)


@skinny_linear_add_rms_norm.register_fake
def _skinny_linear_add_rms_norm_fake(
    x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    y = x.new_empty((x.shape[0], weight.shape[0]))
    return _fused_add_rms_norm_fake(y, residual, norm_weight, eps)


@skinny_linear_add_rms_norm.register_kernel("cuda")
def _(
    x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    from v1_engine.kernels.skinny_epilogues import linear_add_rms_norm_cuda

    return linear_add_rms_norm_cuda(x, weight, residual, norm_weight, eps)


@torch.library.custom_op("v1_engine::skinny_add_norm_linear", mutates_args=())
def skinny_add_norm_linear(
    x: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor, eps: float,
    weight: torch.Tensor, gated: bool,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """(y, x + residual) for y = F.linear(normed, weight) with (normed, .) =
    fused_add_rms_norm(x, residual, norm_weight, eps), silu_and_mul(y) where `gated`: a norm and
    the qkv_proj or gate_up_proj after it; on CUDA at measured decode sizes one kernel with the
    norm folded into the GEMM (kernels/skinny_epilogues.py)."""
    normed, summed = fused_add_rms_norm_ref(x, residual, norm_weight, eps)
    y = F.linear(normed, weight)
    return (silu_and_mul_ref(y) if gated else y), summed


@skinny_add_norm_linear.register_fake
def _skinny_add_norm_linear_fake(
    x: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor, eps: float,
    weight: torch.Tensor, gated: bool,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    _, summed = _fused_add_rms_norm_fake(x, residual, norm_weight, eps)
    width = weight.shape[0] // 2 if gated else weight.shape[0]
    dtype = torch.promote_types(norm_weight.dtype, x.dtype)
    return x.new_empty((x.shape[0], width), dtype=dtype), summed


@skinny_add_norm_linear.register_kernel("cuda")
def _(
    x: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor, eps: float,
    weight: torch.Tensor, gated: bool,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    from v1_engine.kernels.skinny_epilogues import add_norm_linear_cuda

    return add_norm_linear_cuda(x, residual, norm_weight, eps, weight, gated)


# ---- the MLP and the norm after it in one op (kernels/triton_mlp.py) -------------------------


@torch.library.custom_op("v1_engine::fused_mlp_add_rms_norm", mutates_args=())
def fused_mlp_add_rms_norm(
    x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor, residual: torch.Tensor,
    norm_weight: torch.Tensor, eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """fused_add_rms_norm(silu_and_mul(x @ w_gate_up^T) @ w_down^T, residual, norm_weight, eps):
    a decoder layer's MLP and the residual add + RMSNorm after it."""
    y = F.linear(silu_and_mul_ref(F.linear(x, w_gate_up)), w_down)
    return fused_add_rms_norm_ref(y, residual, norm_weight, eps)


@fused_mlp_add_rms_norm.register_fake
def _fused_mlp_add_rms_norm_fake(
    x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor, residual: torch.Tensor,
    norm_weight: torch.Tensor, eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    y = x.new_empty((x.shape[0], w_down.shape[0]))
    return _fused_add_rms_norm_fake(y, residual, norm_weight, eps)


@fused_mlp_add_rms_norm.register_kernel("cuda")
def _(
    x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor, residual: torch.Tensor,
    norm_weight: torch.Tensor, eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    from v1_engine.kernels.triton_mlp import fused_mlp_cuda

    return fused_mlp_cuda(x, w_gate_up, w_down, residual, norm_weight, eps)
