"""The skinny GEMM with the op after it as its epilogue: the CUDA bodies of the ops the
`skinny_silu_mul` and `skinny_add_rms_norm` fusion passes rewrite into
(compile/passes/fused_ops.py).

At decode sizes every kernel boundary costs a launch, a ramp-up and a drain that the work itself
does not need, and a Llama layer has two of them right after skinny GEMMs:

- gate_up_proj, then SiLU-and-mul: the gated kernel (`GATED` in kernels/triton_gemv.py) gives
  each program a tile of gate rows and the matching tile of up rows, so it holds both halves of
  its outputs and stores silu(gate) * up; the [M, 2I] gate_up output is never written;
- o_proj / down_proj, then the residual add + RMSNorm of the next norm: each program stores its
  output tile and counts itself in; the last of them runs the add and the norm over the M rows
  (`ADD_NORM`). That program walks every row alone, so this form is for a few rows
  (NORM_EPILOGUE_MAX_M); more rows take the norm kernel.

Measured on the H200 (benchmarks/RESULTS.md, "Skinny GEMM epilogues"): the gated kernel wins
at batch 1 only (GATED_M_BUCKETS); the norm in the last tile loses (every tile's program pays an
acq_rel arrival, and one program then walks the rows alone), so its pass is opt-in
(config.OPT_IN_FUSION_PASSES).

Both keep the roundings of the unfused ops (GEMM output, SiLU, product; sum, normalised value,
weight product), so they agree with them as the unfused kernels do with the references. Shapes
the skinny kernel does not take fall back to the unfused kernels, inside the op.
"""

from __future__ import annotations

import torch

from v1_engine.kernels.skinny_launch import (
    _DOT_ROWS,
    launch_config,
    m_bucket,
    prefers_skinny,
    resolve_launch,
)
from v1_engine.kernels.skinny_linear_op import fits_skinny, skinny_linear_cuda
from v1_engine.kernels.triton_gemv import _launch

GATED_M_BUCKETS = (1,)
"""M buckets (kernels/skinny_launch.py's m_bucket) the gated kernel runs for; the others take the
GEMM and the SiLU-and-mul kernel. Measured on the H200 (benchmarks/RESULTS.md, "Skinny GEMM
epilogues"), Llama-3-8B shape, decode ms a step, unfused vs gated: batch 1 (the fma body)
4.33 vs 4.28; batches 2-16 (dot_swap, half the gate_up block_n) 4.44-4.68 vs 4.90-5.19;
batch 64 5.41 vs 5.41."""

NORM_IN_M_BUCKETS: tuple[int, ...] = ()
"""M buckets the folded-norm kernel (`skinny_gemm_add_norm`, the `skinny_norm_linear` pass's op)
runs for; the others take the add + RMSNorm kernel and the GEMM op. Empty: at the plain GEMM's
table launches the fold measured slower (H100, bf16 batch 1 5.50 -> 5.99 ms a step, batch 64 x 1k
9.26 -> 14.0; benchmarks/RESULTS.md, "The bf16 norm fold measured")."""

NORM_EPILOGUE_MAX_M = 4
"""Most rows the ADD_NORM epilogue takes (its last program walks them all); beyond, the GEMM is
followed by the add + RMSNorm kernel, whose programs split the rows."""


def gated_launch(m: int, n2: int, k: int, launch: dict[str, int | str]) -> dict[str, int | str]:
    """The launch of the gated GEMM over a [n2, k] gate_up weight: the gate_up shape's config
    with half its block_n (each program reads a gate and an up tile, so as many weight bytes as
    before), K unsplit; `launch` overrides it. Raises ValueError as `resolve_launch` does, and
    for a split."""
    config = launch_config(m, n2, k)
    floor = 1 if config["mode"] == "fma" else _DOT_ROWS
    config = config | {"block_n": max(floor, int(config["block_n"]) // 2), "split_k": 1}
    config = resolve_launch(m, n2 // 2, k, config | launch)
    if config["split_k"] != 1:
        raise ValueError(f"launch split_k must be 1 for the gated GEMM, got {config['split_k']}")
    return config


def skinny_gemm_silu_mul(
    x: torch.Tensor, weight: torch.Tensor, **launch: int | str
) -> torch.Tensor:
    """silu(x @ gate^T) * (x @ up^T) [M, I] for weight = [gate; up] [2I, K] (a gate_up_proj), in
    one kernel: the SiLU-and-mul is the GEMM's epilogue, with the roundings of the unfused GEMM
    output, SiLU and product (layers/activation.py), so the [M, 2I] output is never written."""
    m, k = x.shape
    n2 = weight.shape[0]
    assert n2 % 2 == 0 and weight.shape[1] == k and x.stride(1) == 1 and weight.stride(1) == 1
    config = gated_launch(m, n2, k, launch)
    out = torch.empty((m, n2 // 2), dtype=x.dtype, device=x.device)
    _launch(x, weight, None, out, config, gated=True)
    return out


def skinny_gemm_add_rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    residual: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    **launch: int | str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(norm_weight * rmsnorm(y + residual), y + residual) for y = x @ weight^T, in one kernel:
    the last column tile to finish runs the add + RMSNorm over the rows (kernels/triton_fused.py's
    roundings), so the norm costs no launch of its own. Meant for a few rows (that program walks
    all of them); residual [M, N] with unit last stride, norm_weight [N], both in x's dtype."""
    m, k = x.shape
    n = weight.shape[0]
    assert weight.shape[1] == k and x.stride(1) == 1 and weight.stride(1) == 1
    assert residual.shape == (m, n) and residual.stride(1) == 1 and norm_weight.shape == (n,)
    assert residual.dtype == x.dtype and norm_weight.dtype == x.dtype
    config = resolve_launch(m, n, k, launch)
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    normed = torch.empty((m, n), dtype=x.dtype, device=x.device)
    residual_out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    norm = (residual, norm_weight.contiguous(), float(eps), normed, residual_out)
    _launch(x, weight, None, out, config, norm=norm)
    return normed, residual_out


def skinny_gemm_add_norm(
    x: torch.Tensor,
    residual: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    weight: torch.Tensor,
    gated: bool = False,
    **launch: int | str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(y, h) for h = x + residual (rounded to x's dtype) and y = (rmsnorm(h) * norm_weight) @
    weight^T, or silu_and_mul of it when `gated` (weight = [gate; up]), in one kernel: the norm
    folded into the GEMM (NORM_IN; each program sums h^2 over the K it walks and scales its rows
    at the end), so the add + RMSNorm costs no kernel of its own. x and residual [M, K] in one
    dtype with unit last strides, norm_weight [K]; never split."""
    m, k = x.shape
    n = weight.shape[0]
    assert weight.shape[1] == k and x.stride(1) == 1 and weight.stride(1) == 1
    assert residual.shape == (m, k) and residual.stride(1) == 1 and norm_weight.shape == (k,)
    assert residual.dtype == x.dtype
    config = gated_launch(m, n, k, launch) if gated else resolve_launch(m, n, k, launch)
    if config["split_k"] != 1:
        raise ValueError(f"launch split_k must be 1 for the folded norm, got {config['split_k']}")
    out = torch.empty((m, n // 2 if gated else n), dtype=x.dtype, device=x.device)
    h = torch.empty((m, k), dtype=x.dtype, device=x.device)
    norm_in = (residual, norm_weight.contiguous(), float(eps), h)
    _launch(x, weight, None, out, config, gated=gated, norm_in=norm_in)
    return out, h


def silu_mul_linear_cuda(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """silu_and_mul(x @ weight^T) on CUDA: the gated kernel for GATED_M_BUCKETS where the
    gate_up shape has a measured skinny launch, else the GEMM op's body and the SiLU-and-mul
    kernel."""
    m, n2 = x.shape[0], weight.shape[0]
    if (
        m_bucket(m) in GATED_M_BUCKETS
        and n2 % 2 == 0
        and fits_skinny(x, weight, None)
        and prefers_skinny(m, n2, x.shape[1])
    ):
        return skinny_gemm_silu_mul(x, weight)
    return _silu_and_mul_cuda(skinny_linear_cuda(x, weight))


def linear_add_rms_norm_cuda(
    x: torch.Tensor,
    weight: torch.Tensor,
    residual: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """add_rms_norm(x @ weight^T, residual, norm_weight, eps) on CUDA: one kernel for up to
    NORM_EPILOGUE_MAX_M rows of a measured skinny shape with operands of one dtype, else the
    GEMM op's body and the add + RMSNorm kernel."""
    m, n = x.shape[0], weight.shape[0]
    if (
        m <= NORM_EPILOGUE_MAX_M
        and fits_skinny(x, weight, None)
        and prefers_skinny(m, n, x.shape[1])
        and residual.shape == (m, n)
        and residual.stride(1) == 1
        and residual.dtype == x.dtype
        and norm_weight.shape == (n,)
        and norm_weight.dtype == x.dtype
    ):
        return skinny_gemm_add_rms_norm(x, weight, residual, norm_weight, eps)
    from v1_engine.kernels.triton_fused import add_rms_norm

    y = skinny_linear_cuda(x, weight)
    if residual.dtype != y.dtype:  # the norm kernel reads both in one dtype
        from compile.passes.fused_ops import fused_add_rms_norm_ref

        return fused_add_rms_norm_ref(y, residual, norm_weight, eps)
    return add_rms_norm(y, residual, norm_weight, eps)


def _silu_and_mul_cuda(x: torch.Tensor) -> torch.Tensor:
    from v1_engine.kernels import triton_fused

    return triton_fused.silu_and_mul(x)


def add_norm_linear_cuda(
    x: torch.Tensor,
    residual: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    weight: torch.Tensor,
    gated: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(linear(rmsnorm(x + residual) * norm_weight, weight) [then silu_and_mul where `gated`],
    x + residual) on CUDA: one kernel (the norm folded in) for NORM_IN_M_BUCKETS where the GEMM
    shape has a measured unsplit skinny launch and every operand is in x's dtype, else the add +
    RMSNorm kernel and the GEMM op's body (the gated one where `gated`)."""
    m, k = x.shape
    n = weight.shape[0]
    if (
        m_bucket(m) in NORM_IN_M_BUCKETS
        and fits_skinny(x, weight, None)
        and residual.dtype == x.dtype == norm_weight.dtype
        and residual.shape == x.shape
        and residual.stride(1) == 1
        and norm_weight.shape == (k,)
        and (not gated or n % 2 == 0)
        and prefers_skinny(m, n, k)
    ):
        # The gated epilogue where silu_mul_linear_cuda takes it; elsewhere the SiLU-and-mul
        # kernel after the folded GEMM (the gated dot body at M = 64 spills).
        in_kernel = gated and m_bucket(m) in GATED_M_BUCKETS
        config = gated_launch(m, n, k, {}) if in_kernel else launch_config(m, n, k)
        if config["split_k"] == 1:
            out, h = skinny_gemm_add_norm(x, residual, norm_weight, eps, weight, in_kernel)
            return (_silu_and_mul_cuda(out) if gated and not in_kernel else out), h
    from v1_engine.kernels.triton_fused import add_rms_norm

    normed, summed = add_rms_norm(x, residual, norm_weight, eps)
    if gated:
        return silu_mul_linear_cuda(normed, weight), summed
    return skinny_linear_cuda(normed, weight), summed
