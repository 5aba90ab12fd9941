"""FP8 linears whose activation quant is skipped at decode sizes: the ops of the
`fp8_dynamic_linear` and `fp8_gated_mlp` passes.

A per-token FP8 linear quantizes its bf16 input in a kernel of its own wherever no norm or
SiLU-and-mul before it can do it (o_proj's input, the attention output), and the down
projection's input is quantized by the SiLU-and-mul kernel after the gate_up GEMM. At a decode
step of a few rows those kernels move almost no data, yet each adds a launch and a drain to the
step (about 2 us each on the H200, benchmarks/RESULTS.md "L2 prefetch of the next GEMM's
weight"). At the M buckets FP8_TUNED_LAUNCH holds for the "weight_only" / "gated" kinds
(kernels/fp8_launch.py's dispatch rule), these ops drop them:

- `fp8_dynamic_linear(x, w, w_scale, out_dtype, bias)`: the bf16 x times the e4m3 weight in one
  kernel ("weight_only"), x not quantized; elsewhere per_token_fp8_quant then scaled_mm.
- `fp8_gated_mlp(q, scale, w_gate_up, s_gate_up, w_down, s_down, out_dtype, act_dtype)`: the
  gate_up GEMM with SiLU-and-mul in its epilogue ("gated"), then the down GEMM on the bf16
  product ("weight_only"); elsewhere scaled_mm, silu_and_mul_per_token_fp8_quant, scaled_mm.

Not quantizing an activation makes the result *more* accurate (the e4m3 rounding of x, 2^-4
relative, is gone), so the fast path differs from the quantized chain by that rounding: within
the FP8 expectations every FP8 test already allows. Each op's PyTorch body is the quantized
chain (kernels/fp8.py's references), so on the CPU a graph with the ops equals the one without.
"""

from __future__ import annotations

import torch

from compile.passes.fused_quant_ops import silu_and_mul_quant_ref
from v1_engine.kernels.fp8 import per_token_fp8_quant_ref, scaled_mm_ref


def fp8_dynamic_linear_ref(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    out_dtype: torch.dtype,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    q, scale = per_token_fp8_quant_ref(x)
    return scaled_mm_ref(q, weight, scale, weight_scale, out_dtype, bias)


def fp8_gated_mlp_ref(
    q: torch.Tensor,
    scale: torch.Tensor,
    w_gate_up: torch.Tensor,
    s_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    s_down: torch.Tensor,
    out_dtype: torch.dtype,
    act_dtype: torch.dtype,
) -> torch.Tensor:
    gate_up = scaled_mm_ref(q, w_gate_up, scale, s_gate_up, out_dtype).to(act_dtype)
    q_h, scale_h = silu_and_mul_quant_ref(gate_up)
    return scaled_mm_ref(q_h, w_down, scale_h, s_down, out_dtype)


def _skinny():
    """kernels/triton_gemv_fp8.py, imported on first CUDA use so CPU imports never need triton."""
    from v1_engine.kernels import triton_gemv_fp8

    return triton_gemv_fp8


def _decode():
    """kernels/triton_gemv_fp8_decode.py (the "weight_only" / "gated" kernels), likewise."""
    from v1_engine.kernels import triton_gemv_fp8_decode

    return triton_gemv_fp8_decode


def _launch():
    """kernels/fp8_launch.py (the kernels' launch table and dispatch rule), likewise."""
    from v1_engine.kernels import fp8_launch

    return fp8_launch


def _weight_only_fits(x: torch.Tensor, weight: torch.Tensor, out_dtype: torch.dtype) -> bool:
    """Whether the "weight_only" kernel takes x times weight on this shape: an entry in its table
    for x's M bucket, x already in the output dtype, the skinny kernels' operand layout."""
    skinny = _skinny()
    return (
        x.dtype == out_dtype
        and out_dtype in skinny.OUT_DTYPES
        and weight.dtype == skinny.FP8_DTYPE
        and skinny.triton_gemv.skinny_operands(x, weight)
        and _launch().prefers_fp8_skinny("weight_only", x.shape[0], weight.shape[0], x.shape[1])
    )


def fp8_dynamic_linear_cuda(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    out_dtype: torch.dtype,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """The CUDA body of `v1_engine::fp8_dynamic_linear`."""
    from v1_engine.kernels import fp8

    if _weight_only_fits(x, weight, out_dtype) and (bias is None or bias.dtype == out_dtype):
        return _decode().fp8_weight_only_gemm(x, weight, weight_scale, bias)
    q, scale = fp8._per_token_fp8_quant_cuda(x)
    return fp8._scaled_mm_cuda(q, weight, scale, weight_scale, out_dtype, bias)


def fp8_gated_mlp_cuda(
    q: torch.Tensor,
    scale: torch.Tensor,
    w_gate_up: torch.Tensor,
    s_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    s_down: torch.Tensor,
    out_dtype: torch.dtype,
    act_dtype: torch.dtype,
) -> torch.Tensor:
    """The CUDA body of `v1_engine::fp8_gated_mlp`: the two decode kernels where both tables
    hold the shapes (and the activation stays in the GEMM's dtype), else the quantized chain."""
    from compile.passes.fused_quant_ops import _triton
    from v1_engine.kernels import fp8

    skinny, launch = _skinny(), _launch()
    m, k = q.shape
    rows, inner = w_gate_up.shape[0], w_down.shape[1]
    if (
        act_dtype == out_dtype
        and out_dtype in skinny.OUT_DTYPES
        and rows == 2 * inner
        and skinny.fits_fp8_skinny(q, w_gate_up)
        and w_down.is_contiguous()
        and launch.prefers_fp8_skinny("gated", m, rows, k)
        and launch.prefers_fp8_skinny("weight_only", m, w_down.shape[0], inner)
    ):
        decode = _decode()
        h = decode.fp8_gated_gemm(q, w_gate_up, scale, s_gate_up, out_dtype)
        return decode.fp8_weight_only_gemm(h, w_down, s_down)
    gate_up = fp8._scaled_mm_cuda(q, w_gate_up, scale, s_gate_up, out_dtype).to(act_dtype)
    q_h, scale_h = _triton().silu_and_mul_quant(gate_up, None)
    return fp8._scaled_mm_cuda(q_h, w_down, scale_h, s_down, out_dtype)


@torch.library.custom_op("v1_engine::fp8_dynamic_linear", mutates_args=())
def fp8_dynamic_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    out_dtype: torch.dtype,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """scaled_mm(*per_token_fp8_quant(x), weight, weight_scale, out_dtype, bias) for x [M, K];
    on CUDA at measured decode sizes x is not quantized (the module docstring)."""
    return fp8_dynamic_linear_ref(x, weight, weight_scale, out_dtype, bias)


@fp8_dynamic_linear.register_kernel("cuda")
def _(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    out_dtype: torch.dtype,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    return fp8_dynamic_linear_cuda(x, weight, weight_scale, out_dtype, bias)


@fp8_dynamic_linear.register_fake
def _(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    out_dtype: torch.dtype,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    return x.new_empty((x.shape[0], weight.shape[0]), dtype=out_dtype)


@torch.library.custom_op("v1_engine::fp8_gated_mlp", mutates_args=())
def fp8_gated_mlp(
    q: torch.Tensor,
    scale: torch.Tensor,
    w_gate_up: torch.Tensor,
    s_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    s_down: torch.Tensor,
    out_dtype: torch.dtype,
    act_dtype: torch.dtype,
) -> torch.Tensor:
    """scaled_mm(*silu_and_mul_per_token_fp8_quant(scaled_mm(q, w_gate_up, scale, s_gate_up,
    out_dtype).to(act_dtype)), w_down, ., s_down, out_dtype): an FP8 MLP from its quantized
    input to the down projection's output; on CUDA at measured decode sizes the product is not
    quantized (the module docstring)."""
    return fp8_gated_mlp_ref(q, scale, w_gate_up, s_gate_up, w_down, s_down, out_dtype, act_dtype)


@fp8_gated_mlp.register_kernel("cuda")
def _(
    q: torch.Tensor,
    scale: torch.Tensor,
    w_gate_up: torch.Tensor,
    s_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    s_down: torch.Tensor,
    out_dtype: torch.dtype,
    act_dtype: torch.dtype,
) -> torch.Tensor:
    return fp8_gated_mlp_cuda(q, scale, w_gate_up, s_gate_up, w_down, s_down, out_dtype, act_dtype)


@fp8_gated_mlp.register_fake
def _(
    q: torch.Tensor,
    scale: torch.Tensor,
    w_gate_up: torch.Tensor,
    s_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    s_down: torch.Tensor,
    out_dtype: torch.dtype,
    act_dtype: torch.dtype,
) -> torch.Tensor:
    return q.new_empty((q.shape[0], w_down.shape[0]), dtype=out_dtype)
