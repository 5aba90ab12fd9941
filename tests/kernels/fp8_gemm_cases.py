"""Operands, tolerances and small launches shared by the FP8 skinny GEMM tests
(test_triton_gemv_fp8.py: the kernels; test_fp8_skinny_dispatch.py: the ops' dispatch and the
launch rules; test_fp8_decode_gemm.py: the decode kinds)."""

from __future__ import annotations

import torch

from v1_engine.kernels import fp8
from v1_engine.kernels.fp8 import FP8_DTYPE
from v1_engine.layers.quantization.fp8_moe import quantize_matrix_block_fp8

ULP = {torch.bfloat16: 2.0**-7, torch.float16: 2.0**-10}
"""Relative spacing of the output dtypes; the interpreter truncates float32 -> 16 bits (the
device rounds to nearest), so a result may sit one spacing from the reference."""


def randn(shape: tuple[int, ...], seed: int, scale: float = 1.0) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * scale


def quantize(x: torch.Tensor, per_row: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """e4m3 x with a per-row [rows, 1] or per-tensor [1] scale (the module's quantizers)."""
    return fp8.per_token_fp8_quant_ref(x) if per_row else fp8.scaled_fp8_quant_ref(x)


def block_quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """e4m3 w [N, K] with one scale per 128x128 block (partial blocks at the N and K ends)."""
    q, scale = quantize_matrix_block_fp8(w)
    return q.contiguous(), scale


def strided_rows(q: torch.Tensor) -> torch.Tensor:
    """q [M, K] copied into a buffer whose rows sit K + 32 bytes apart (a slice of a wider one)."""
    m, k = q.shape
    wide = torch.zeros((m, k + 32), dtype=torch.uint8, device=q.device)
    wide[:, 16 : 16 + k] = q.view(torch.uint8)
    out = wide.view(FP8_DTYPE)[:, 16 : 16 + k]
    assert out.stride(0) == k + 32 and torch.equal(out.view(torch.uint8), q.view(torch.uint8))
    return out


def channel_operands(m: int, n: int, k: int, granularity: str, seed: int, device: str = "cpu"):
    """(a, b, scale_a, scale_b): random activations and weight quantized at `granularity`."""
    a, scale_a = quantize(randn((m, k), seed), per_row=granularity == "token")
    b, scale_b = quantize(randn((n, k), seed + 1, 0.05), per_row=granularity != "tensor")
    return tuple(t.to(device) for t in (a, b, scale_a, scale_b))


def block_operands(m: int, n: int, k: int, seed: int, device: str = "cpu"):
    """(a, b, scale_a [M, K/128], scale_b [N/128, K/128]) quantized per group and per block."""
    a, scale_a = fp8.per_token_group_fp8_quant_ref(randn((m, k), seed))
    b, scale_b = block_quantize(randn((n, k), seed + 1, 0.05))
    return tuple(t.to(device) for t in (a, b, scale_a, scale_b))


WGMMA_ACCUMULATION = 2.0**-11
"""The "wgmma" body's absolute error bound, relative to the output's largest magnitude. The FP8
warpgroup MMA sums each 128-deep step's products in the tensor core's own accumulator, which
keeps fewer mantissa bits than float32, before the kernel adds the step in float32 (as
DeepSeek-V3's FP8 GEMMs promote every 128 of K). On an H100 that came to about 2^-13 of the
output's scale at K = 14336, 7x the fp16 bound below (benchmarks/RESULTS.md, "wgmma body
tolerance"); this bound is four times that. A wrong tile, mask or scale is off by the output's
own magnitude."""


def assert_matches(out: torch.Tensor, ref: torch.Tensor, mode: str = "") -> None:
    """Equal up to one rounding to the 16-bit output (and the float32 sums' few-ulp spread); the
    "wgmma" body's outputs within WGMMA_ACCUMULATION of the output's scale."""
    assert out.dtype == ref.dtype and out.shape == ref.shape
    ulp = ULP[out.dtype]
    scale = ref.float().abs().amax().item()
    atol = ulp * scale / 64
    if mode == "wgmma":
        atol = max(atol, WGMMA_ACCUMULATION * scale)
    torch.testing.assert_close(out.float(), ref.float(), rtol=ulp, atol=atol)


def launch_for(mode: str, kind: str) -> dict:
    """Small tiles so the tiny shapes span several programs and K steps (the wgmma body's
    smallest: 64 columns, 128-deep steps)."""
    block_n = 64 if mode == "wgmma" else 16
    block_k = 128 if kind == "block" or mode == "wgmma" else 32
    return {"mode": mode, "block_n": block_n, "block_k": block_k, "num_warps": 4, "num_stages": 2}


class Recorder:
    """Stands in for a CUTLASS entry point on CPU: records the call, returns the reference."""

    def __init__(self, reference):
        self.calls = 0
        self.reference = reference

    def __call__(self, *args):
        self.calls += 1
        return self.reference(*args)
