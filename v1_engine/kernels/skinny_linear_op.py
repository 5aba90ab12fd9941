"""`v1_engine::skinny_linear`: the custom op the unquantized linear layers (and the LM head) call
on CUDA. For decode-sized M it runs the CUTLASS GEMM (kernels/gemm_cutlass.py) or the skinny
Triton kernel (kernels/triton_gemv.py) where their tables say they measured faster, else
F.linear. It is one opaque node under torch.compile (the token count stays symbolic: every
branch on M runs inside the op on real tensors) and CUDA graphs capture it (no host sync; the
output is its only allocation). The fusion passes (compile/passes/fusion.py) match it."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from v1_engine.kernels import gemm_cutlass
from v1_engine.kernels.skinny_launch import prefers_skinny
from v1_engine.kernels.triton_gemv import SKINNY_DTYPES, skinny_gemm, skinny_operands


def fits_skinny(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Whether the op runs the skinny kernel: bf16/fp16 operands of one dtype laid out as
    `skinny_operands` needs, and a contiguous bias of that dtype."""
    if x.dtype not in SKINNY_DTYPES or weight.dtype != x.dtype:
        return False
    if not skinny_operands(x, weight):
        return False
    return bias is None or (
        bias.dtype == x.dtype and bias.shape == (weight.shape[0],) and bias.is_contiguous()
    )


@torch.library.custom_op("v1_engine::skinny_linear", mutates_args=())
def _skinny_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    return F.linear(x, weight, bias)


@_skinny_linear.register_kernel("cuda")
def skinny_linear_cuda(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """The op's CUDA body (real tensors, so branching on M is free here): the CUTLASS stream-K
    GEMM or the skinny kernel where measured faster (their tables), F.linear otherwise."""
    if gemm_cutlass.prefers(x.shape[0], *weight.shape) and gemm_cutlass.fits(x, weight, bias):
        return gemm_cutlass.gemm(x, weight)
    if fits_skinny(x, weight, bias) and prefers_skinny(x.shape[0], *weight.shape):
        return skinny_gemm(x, weight, bias)
    return F.linear(x, weight, bias)


@_skinny_linear.register_fake
def _skinny_linear_fake(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    return x.new_empty((x.shape[0], weight.shape[0]))


def skinny_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """F.linear(x, weight, bias) for x [..., K] through `v1_engine::skinny_linear`: the skinny
    kernel on CUDA for up to SKINNY_MAX_M rows, F.linear otherwise."""
    if x.dim() == 2:
        return torch.ops.v1_engine.skinny_linear(x, weight, bias)
    out = torch.ops.v1_engine.skinny_linear(x.reshape(-1, x.shape[-1]), weight, bias)
    return out.reshape(*x.shape[:-1], weight.shape[0])
