"""`v1_engine::skinny_linear`: the custom op the unquantized linear layers (and the LM head) call
on CUDA. For decode-sized M it runs the CUTLASS GEMM (kernels/gemm_cutlass.py) or the skinny
Triton kernel (kernels/triton_gemv.py) where their tables say they measured faster, else
F.linear. It is one opaque node under torch.compile (the token count stays symbolic: every
branch on M runs inside the op on real tensors) and CUDA graphs capture it (no host sync; the
output is its only allocation). The fusion passes (compile/passes/fusion.py) match it."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.nn.functional as F

from v1_engine.kernels import gemm_cutlass
from v1_engine.kernels.skinny_launch import m_bucket, prefers_skinny
from v1_engine.kernels.triton_gemv import SKINNY_DTYPES, skinny_gemm, skinny_operands

CUBLASLT_SHAPES: set[tuple[int, int, int]] = set()
"""(M rounded up to a power of two, N, K) of the F.linear calls that run on torch's cuBLASLt
back-end instead of its default cuBLAS, where `benchmarks/benchmark_blas_library.py` measured
cuBLASLt faster (its `--json` writes them for `latency.py --gemm-tables`). Empty: not yet
measured on the H200 (RESULTS.md "cuBLASLt for the F.linear calls")."""


def prefers_cublaslt(m: int, n: int, k: int) -> bool:
    return (m_bucket(m), n, k) in CUBLASLT_SHAPES


@contextlib.contextmanager
def on_cublaslt() -> Iterator[None]:
    """torch's CUDA matmuls inside the block run on cuBLASLt (the process-wide preference, put
    back after; one engine thread runs the forward). A call captured in a CUDA graph keeps the
    back-end it was captured with."""
    before = torch.backends.cuda.preferred_blas_library()
    torch.backends.cuda.preferred_blas_library("cublaslt")
    try:
        yield
    finally:
        torch.backends.cuda.preferred_blas_library(before)


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
    GEMM or the skinny kernel where measured faster (their tables), F.linear otherwise, on
    cuBLASLt for the CUBLASLT_SHAPES."""
    if gemm_cutlass.prefers(x.shape[0], *weight.shape) and gemm_cutlass.fits(x, weight, bias):
        return gemm_cutlass.gemm(x, weight)
    if fits_skinny(x, weight, bias) and prefers_skinny(x.shape[0], *weight.shape):
        return skinny_gemm(x, weight, bias)
    if prefers_cublaslt(x.shape[0], *weight.shape):
        with on_cublaslt():
            return F.linear(x, weight, bias)
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
