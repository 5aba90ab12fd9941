"""FP8 test values shared by the quant-fusion tests (tests/compile/test_fp8_fusion.py) and the
fused quant kernels' tests (tests/kernels/test_triton_fused_quant.py): activations with outlier
columns, norm weights, and the bound within which a fused quant kernel agrees with its
reference."""

from __future__ import annotations

import torch

E4M3_STEP = 2.0**-3
"""Spacing of e4m3 values relative to their magnitude, at most (3 mantissa bits)."""
E4M3_SUBNORMAL_STEP = 2.0**-9


def as_bytes(q: torch.Tensor) -> torch.Tensor:
    return q.view(torch.uint8)


def dequantize(q: torch.Tensor, scales: torch.Tensor, group_size: int | None) -> torch.Tensor:
    if group_size is None:
        return q.float() * scales
    return q.float() * scales.repeat_interleave(group_size, -1)[..., : q.shape[-1]]


def assert_quant_close(
    q, scales, q_ref, scales_ref, group_size, value_dtype: torch.dtype, min_exact: float
):
    """The bound of kernels/triton_fused_quant.py: a normed value one ulp of its dtype off moves
    a scale by at most that (2 ulps allowed for the reduction's fp32 error) and a quantized value
    by at most one e4m3 step; and at least `min_exact` of the bytes are identical."""
    ulp = torch.finfo(value_dtype).eps
    torch.testing.assert_close(scales, scales_ref, rtol=2 * ulp, atol=0)
    deq_ref = dequantize(q_ref, scales_ref, group_size)
    element_scales = dequantize(torch.ones_like(q_ref), scales_ref, group_size)
    bound = deq_ref.abs() * (E4M3_STEP + 4 * ulp) + element_scales * E4M3_SUBNORMAL_STEP
    assert bool(((dequantize(q, scales, group_size) - deq_ref).abs() <= bound).all())
    exact = (as_bytes(q) == as_bytes(q_ref)).float().mean().item()
    assert exact >= min_exact, exact


def activations(shape: tuple[int, ...], dtype: torch.dtype, seed: int, device="cpu"):
    """Normal values with a few outlier columns, like real activations."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=gen)
    x[..., :: max(1, shape[-1] // 4)] *= 20.0
    return x.to(dtype).to(device)


def norm_weight(size: int, dtype: torch.dtype, seed: int, device="cpu") -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (1.0 + 0.2 * torch.randn(size, generator=gen)).to(dtype).to(device)
