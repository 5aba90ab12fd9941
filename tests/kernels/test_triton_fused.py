"""The Triton residual-add + RMSNorm and SiLU-and-mul kernels (kernels/triton_fused.py) against
the fused ops' PyTorch references: under the interpreter on CPU, on the device with CUDA."""

from __future__ import annotations

import pytest
import torch

from compile.passes import fused_ops

_CUDA = torch.cuda.is_available()
# On the CPU the kernels run under Triton's interpreter, which tests/conftest.py turns on
# before any kernel module is imported.
triton_fused = pytest.importorskip("v1_engine.kernels.triton_fused")
interpreter_only = pytest.mark.skipif(_CUDA, reason="the gpu cases cover this on a CUDA machine")


def values(shape: tuple[int, ...], dtype: torch.dtype, seed: int, device="cpu") -> torch.Tensor:
    """Normal values with a few large columns, like a residual stream."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=gen)
    x[..., :: max(1, shape[-1] // 4)] *= 20.0
    return x.to(dtype).to(device)


def ulps_apart(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """|a - b| in units of b's dtype epsilon at b's magnitude (up to 2 per spacing of b's
    dtype). float32 results carry the few-ulp differences of reduction order and hardware
    rsqrt/exp straight through; 16-bit ones round them away but for an occasional step."""
    eps = torch.finfo(b.dtype).eps
    apart = (a.float() - b.float()).abs() / (b.float().abs() * eps).clamp_min(1e-30)
    return apart / 4 if b.dtype == torch.float32 else apart


def check_norm(x, residual, weight, eps=1e-6):
    out, summed = triton_fused.add_rms_norm(x, residual, weight, eps)
    out_ref, summed_ref = fused_ops.fused_add_rms_norm_ref(x, residual, weight, eps)
    assert out.dtype == out_ref.dtype and out.shape == out_ref.shape
    assert torch.equal(summed, summed_ref)  # one rounding of the same sum
    # The sum of squares is reduced in another order and rsqrt is the hardware's: a normed
    # value within a few fp32 ulps of a rounding boundary may round the other way.
    apart = ulps_apart(out, out_ref)
    assert (apart <= 2.01).all(), apart.max()
    if out.dtype != torch.float32:  # fp32 has no final rounding to absorb the ulps
        assert (out == out_ref).float().mean() > 0.97


def check_silu(x):
    out = triton_fused.silu_and_mul(x)
    ref = fused_ops.silu_and_mul_ref(x)
    assert out.shape == ref.shape and out.dtype == ref.dtype
    apart = ulps_apart(out, ref)
    assert (apart <= 2.01).all(), apart.max()
    if out.dtype != torch.float32:
        assert (out == ref).float().mean() > 0.97


@interpreter_only
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("shape", [(3, 64), (1, 300), (2, 3, 48)])
def test_kernels_match_refs_interpreted(shape, dtype):
    x, residual = values(shape, dtype, 1), values(shape, dtype, 2)
    weight = (1.0 + 0.2 * torch.randn(shape[-1], generator=torch.Generator().manual_seed(3))).to(
        dtype
    )
    check_norm(x, residual, weight)
    check_silu(values((*shape[:-1], 2 * shape[-1]), dtype, 4) * 0.3)


@interpreter_only
def test_kernels_read_strided_rows_and_wide_silu_rows_interpreted():
    wide = values((4, 96), torch.bfloat16, 5)
    x, residual = wide[:, 16:80], wide[:, 8:72]  # row stride 96
    weight = torch.linspace(0.5, 1.5, 64, dtype=torch.float32)  # promotes the output to fp32
    check_norm(x, residual, weight)
    # 2 x 1100 columns: the output row spans two column blocks of 1024.
    check_silu(values((2, 2200), torch.bfloat16, 6) * 0.3)


@interpreter_only
def test_norm_walks_long_rows_in_chunks_interpreted(monkeypatch):
    """Rows wider than MAX_BLOCK take the two-pass chunked walk (the one-pass body holds a whole
    row in registers): a 300-wide row in chunks of 64 (the last masked) matches the reference as
    the one-pass body does."""
    x, residual = values((3, 300), torch.bfloat16, 12), values((3, 300), torch.bfloat16, 13)
    weight = (1.0 + 0.2 * torch.randn(300, generator=torch.Generator().manual_seed(14))).to(
        torch.bfloat16
    )
    one_pass = triton_fused.add_rms_norm(x, residual, weight, 1e-5)
    monkeypatch.setattr(triton_fused, "MAX_BLOCK", 64)
    check_norm(x, residual, weight)
    chunked = triton_fused.add_rms_norm(x, residual, weight, 1e-5)
    assert torch.equal(chunked[1], one_pass[1])  # x + residual: one rounding either way
    assert (ulps_apart(chunked[0], one_pass[0]) <= 2.01).all()  # one spacing: sum order


@interpreter_only
def test_ops_run_the_kernels_on_a_device_and_the_refs_on_cpu():
    x, residual = values((2, 32), torch.float32, 7), values((2, 32), torch.float32, 8)
    weight = torch.ones(32)
    got = torch.ops.v1_engine.fused_add_rms_norm(x, residual, weight, 1e-6)
    want = fused_ops.fused_add_rms_norm_ref(x, residual, weight, 1e-6)
    assert all(torch.equal(a, b) for a, b in zip(got, want))  # CPU: the reference, exactly


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens", [1, 7, 4096])
def test_kernels_match_refs_gpu(num_tokens):
    """Llama-3-8B widths in bf16 through the custom ops (the CUDA kernels)."""
    cuda, dtype = torch.device("cuda"), torch.bfloat16
    x = values((num_tokens, 4096), dtype, 9, cuda)
    residual = values((num_tokens, 4096), dtype, 10, cuda)
    weight = (1.0 + 0.2 * torch.randn(4096, generator=torch.Generator().manual_seed(11))).to(
        cuda, dtype
    )
    out, summed = torch.ops.v1_engine.fused_add_rms_norm(x, residual, weight, 1e-5)
    out_ref, summed_ref = fused_ops.fused_add_rms_norm_ref(x, residual, weight, 1e-5)
    assert torch.equal(summed, summed_ref)
    assert (ulps_apart(out, out_ref) <= 2.01).all()
    gate_up = values((num_tokens, 2 * 14336), dtype, 12, cuda) * 0.3
    got = torch.ops.v1_engine.silu_and_mul(gate_up)
    ref = fused_ops.silu_and_mul_ref(gate_up)
    assert (ulps_apart(got, ref) <= 2.01).all()
    assert (got == ref).float().mean() > 0.97
