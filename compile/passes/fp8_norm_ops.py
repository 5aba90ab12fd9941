"""FP8 linears with the residual add and RMSNorm before them folded in at decode sizes: the ops
of the `fp8_norm_linear` pass (compile/passes/fp8_fusion.py).

After the quant fusions a Llama layer's two norms are each one kernel,
`add_rms_norm_per_token_fp8_quant(x, residual, w, eps)`, whose (q, scales) feed one FP8 GEMM
(qkv_proj) or the FP8 MLP (gate_up, then down). At a decode step of a few rows that kernel moves
almost no data, yet it is a launch and a drain between two GEMMs. The norm is a per-row scale, so
it factors out of the GEMM: rmsnorm(h) * w @ W^T = rsqrt(mean(h^2) + eps) * ((h * w) @ W^T) for
h = x + residual. The "norm" kinds of kernels/triton_gemv_fp8_decode.py compute exactly that:
every program forms h and h * w from the K it walks anyway, sums h^2 on the way, and scales its
rows at the end; program 0 writes h (the next residual). At the M buckets FP8_TUNED_LAUNCH
holds for "norm" / "norm_gated" (kernels/fp8_launch.py's dispatch rule):

- `fp8_add_norm_linear(x, residual, w_norm, eps, weight, weight_scale, out_dtype, bias)` ->
  (out, x + residual): one "norm" kernel instead of the norm-quant kernel and the GEMM;
- `fp8_add_norm_gated_mlp(x, residual, w_norm, eps, w_gate_up, s_gate_up, w_down, s_down,
  out_dtype, act_dtype)` -> (out, x + residual): the "norm_gated" kernel (gate_up with the norm
  in front and SiLU-and-mul behind), then the "weight_only" down GEMM, instead of three kernels.

Elsewhere both run the quantized chain. As with compile/passes/fp8_linear_ops.py, the fma body
does not quantize the activation and does not round the normed value to bf16, so it is *more*
accurate than the chain and differs from it by those roundings. The "wgmma" body (a table entry
in that mode) instead norms and quantizes the activation in every program exactly as the
norm-quant kernel would and multiplies e4m3 by e4m3 in warpgroup MMAs: the chain's arithmetic,
one kernel. The PyTorch bodies are the chain, so on the CPU a graph with the ops equals one
without.
"""

from __future__ import annotations

import torch

from compile.passes.fp8_linear_ops import (
    _decode,
    _launch,
    _skinny,
    fp8_gated_mlp_cuda,
    fp8_gated_mlp_ref,
)
from compile.passes.fused_quant_ops import add_rms_norm_quant_ref
from v1_engine.kernels.fp8 import scaled_mm_ref

NormOut = tuple[torch.Tensor, torch.Tensor]


def fp8_add_norm_linear_ref(
    x: torch.Tensor,
    residual: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    out_dtype: torch.dtype,
    bias: torch.Tensor | None = None,
) -> NormOut:
    q, scale, summed = add_rms_norm_quant_ref(x, residual, norm_weight, eps)
    return scaled_mm_ref(q, weight, scale, weight_scale, out_dtype, bias), summed


def fp8_add_norm_gated_mlp_ref(
    x: torch.Tensor,
    residual: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    w_gate_up: torch.Tensor,
    s_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    s_down: torch.Tensor,
    out_dtype: torch.dtype,
    act_dtype: torch.dtype,
) -> NormOut:
    q, scale, summed = add_rms_norm_quant_ref(x, residual, norm_weight, eps)
    out = fp8_gated_mlp_ref(q, scale, w_gate_up, s_gate_up, w_down, s_down, out_dtype, act_dtype)
    return out, summed


def norm_kernel_fits(
    kind: str,
    x: torch.Tensor,
    residual: torch.Tensor,
    norm_weight: torch.Tensor,
    weight: torch.Tensor,
    out_dtype: torch.dtype,
) -> bool:
    """Whether the `kind` ("norm" / "norm_gated") kernel takes this call: x and residual 2-D in
    the output dtype with unit last strides, a contiguous norm weight of K values, the skinny
    kernels' operand layout, and an entry in the kind's table for x's M bucket."""
    skinny = _skinny()
    return (
        x.dim() == 2
        and x.dtype == out_dtype
        and residual.dtype == out_dtype
        and residual.shape == x.shape
        and residual.stride(1) == 1
        and out_dtype in skinny.OUT_DTYPES
        and weight.dtype == skinny.FP8_DTYPE
        and norm_weight.shape == (x.shape[1],)
        and norm_weight.is_contiguous()
        and skinny.triton_gemv.skinny_operands(x, weight)
        and _launch().prefers_fp8_skinny(kind, x.shape[0], weight.shape[0], x.shape[1])
    )


def _norm_quant_cuda(x, residual, norm_weight, eps):
    from compile.passes.fused_quant_ops import _triton

    return _triton().rms_norm_quant(x, residual, norm_weight, eps, None)


def fp8_add_norm_linear_cuda(
    x: torch.Tensor,
    residual: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    out_dtype: torch.dtype,
    bias: torch.Tensor | None = None,
) -> NormOut:
    """The CUDA body of `v1_engine::fp8_add_norm_linear`."""
    from v1_engine.kernels import fp8

    fits = norm_kernel_fits("norm", x, residual, norm_weight, weight, out_dtype)
    if fits and (bias is None or bias.dtype == out_dtype):
        return _decode().fp8_add_norm_gemm(
            x, residual, norm_weight, eps, weight, weight_scale, bias
        )
    q, scale, summed = _norm_quant_cuda(x, residual, norm_weight, eps)
    return fp8._scaled_mm_cuda(q, weight, scale, weight_scale, out_dtype, bias), summed


def fp8_add_norm_gated_mlp_cuda(
    x: torch.Tensor,
    residual: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    w_gate_up: torch.Tensor,
    s_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    s_down: torch.Tensor,
    out_dtype: torch.dtype,
    act_dtype: torch.dtype,
) -> NormOut:
    """The CUDA body of `v1_engine::fp8_add_norm_gated_mlp`: the "norm_gated" and "weight_only"
    kernels where both tables hold the shapes, else the norm-quant kernel and fp8_gated_mlp's
    body."""
    rows, inner = w_gate_up.shape[0], w_down.shape[1]
    if (
        act_dtype == out_dtype
        and rows == 2 * inner
        and w_down.is_contiguous()
        and norm_kernel_fits("norm_gated", x, residual, norm_weight, w_gate_up, out_dtype)
        and _launch().prefers_fp8_skinny("weight_only", x.shape[0], w_down.shape[0], inner)
    ):
        decode = _decode()
        h, summed = decode.fp8_add_norm_gemm(
            x, residual, norm_weight, eps, w_gate_up, s_gate_up, gated=True
        )
        return decode.fp8_weight_only_gemm(h, w_down, s_down), summed
    q, scale, summed = _norm_quant_cuda(x, residual, norm_weight, eps)
    args = (w_gate_up, s_gate_up, w_down, s_down, out_dtype, act_dtype)
    return fp8_gated_mlp_cuda(q, scale, *args), summed


@torch.library.custom_op("v1_engine::fp8_add_norm_linear", mutates_args=())
def fp8_add_norm_linear(
    x: torch.Tensor,
    residual: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    out_dtype: torch.dtype,
    bias: torch.Tensor | None = None,
) -> NormOut:
    """(scaled_mm(q, weight, scale, weight_scale, out_dtype, bias), x + residual) for (q, scale,
    .) = add_rms_norm_per_token_fp8_quant(x, residual, norm_weight, eps), x [M, K]; on CUDA at
    measured decode sizes one kernel, the activation not quantized (the module docstring)."""
    return fp8_add_norm_linear_ref(
        x, residual, norm_weight, eps, weight, weight_scale, out_dtype, bias
    )


fp8_add_norm_linear.register_kernel("cuda")(fp8_add_norm_linear_cuda)


@fp8_add_norm_linear.register_fake
def _(
    x: torch.Tensor,
    residual: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    out_dtype: torch.dtype,
    bias: torch.Tensor | None = None,
) -> NormOut:
    return x.new_empty((x.shape[0], weight.shape[0]), dtype=out_dtype), torch.empty_like(x)


@torch.library.custom_op("v1_engine::fp8_add_norm_gated_mlp", mutates_args=())
def fp8_add_norm_gated_mlp(
    x: torch.Tensor,
    residual: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    w_gate_up: torch.Tensor,
    s_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    s_down: torch.Tensor,
    out_dtype: torch.dtype,
    act_dtype: torch.dtype,
) -> NormOut:
    """(fp8_gated_mlp(q, scale, w_gate_up, s_gate_up, w_down, s_down, out_dtype, act_dtype),
    x + residual) for (q, scale, .) = add_rms_norm_per_token_fp8_quant(x, residual, norm_weight,
    eps); on CUDA at measured decode sizes two kernels, no activation quantized (the module
    docstring)."""
    return fp8_add_norm_gated_mlp_ref(
        x, residual, norm_weight, eps, w_gate_up, s_gate_up, w_down, s_down, out_dtype, act_dtype
    )


fp8_add_norm_gated_mlp.register_kernel("cuda")(fp8_add_norm_gated_mlp_cuda)


@fp8_add_norm_gated_mlp.register_fake
def _(
    x: torch.Tensor,
    residual: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    w_gate_up: torch.Tensor,
    s_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    s_down: torch.Tensor,
    out_dtype: torch.dtype,
    act_dtype: torch.dtype,
) -> NormOut:
    out = x.new_empty((x.shape[0], w_down.shape[0]), dtype=out_dtype)
    return out, torch.empty_like(x)
