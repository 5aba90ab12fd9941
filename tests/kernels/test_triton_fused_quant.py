"""The fused RMSNorm / SiLU-and-mul + FP8 quant kernels (kernels/triton_fused_quant.py) against
the references of compile/passes/fused_quant_ops.py. They run under the interpreter on tiny
shapes: bit-identical for bf16/fp16 inputs; for fp32 inputs the norm's sum of squares is reduced
in another order, which may move a row's scale by an ulp (fp8_values.assert_quant_close's bound).
The `gpu` cases compare the compiled kernels with the unfused CUDA ops on Llama-3-8B's hidden
size within the same bound. (The passes that put these ops in a model's graph:
tests/compile/test_fp8_fusion.py.)"""

from __future__ import annotations

import pytest
import torch
from fp8_values import activations, as_bytes, assert_quant_close, norm_weight

from compile.passes import fused_quant_ops as ops
from v1_engine.kernels import fp8
from v1_engine.layers.activation import SiluAndMul
from v1_engine.layers.norm import RMSNorm

triton_fused_quant = pytest.importorskip("v1_engine.kernels.triton_fused_quant")
triton_quant = pytest.importorskip("v1_engine.kernels.triton_quant")
interpreter_only = pytest.mark.skipif(
    torch.cuda.is_available(), reason="the gpu cases cover this on a CUDA machine"
)


def check_norm_kernels(x, residual, weight, group_size, min_exact: float, exact_scales: bool):
    value_dtype = torch.promote_types(weight.dtype, x.dtype)
    q, s, summed = triton_fused_quant.rms_norm_quant(x, residual, weight, 1e-6, group_size)
    q_ref, s_ref, summed_ref = ops.add_rms_norm_quant_ref(x, residual, weight, 1e-6, group_size)
    assert torch.equal(summed, summed_ref)
    assert_quant_close(q, s, q_ref, s_ref, group_size, value_dtype, min_exact)
    if exact_scales:
        assert torch.equal(s, s_ref) and torch.equal(as_bytes(q), as_bytes(q_ref))
    q, s, none = triton_fused_quant.rms_norm_quant(x, None, weight, 1e-6, group_size)
    q_ref, s_ref = ops.rms_norm_quant_ref(x, weight, 1e-6, group_size)
    assert none is None
    assert_quant_close(q, s, q_ref, s_ref, group_size, value_dtype, min_exact)
    if exact_scales:
        assert torch.equal(s, s_ref) and torch.equal(as_bytes(q), as_bytes(q_ref))


def check_silu_kernel(x, group_size, min_exact: float, exact_scales: bool):
    q, s = triton_fused_quant.silu_and_mul_quant(x, group_size)
    q_ref, s_ref = ops.silu_and_mul_quant_ref(x, group_size)
    assert q.shape == q_ref.shape and s.shape == s_ref.shape
    assert_quant_close(q, s, q_ref, s_ref, group_size, x.dtype, min_exact)
    if exact_scales:
        assert torch.equal(s, s_ref) and torch.equal(as_bytes(q), as_bytes(q_ref))


@interpreter_only
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize(
    ("shape", "group_size"), [((3, 64), None), ((2, 300), 128), ((1, 16), None), ((2, 3, 48), 16)]
)
def test_triton_kernels_match_refs_interpreted(shape, group_size, dtype):
    x, residual = activations(shape, dtype, 6), activations(shape, dtype, 7)
    weight = norm_weight(shape[-1], dtype, 8)
    exact = dtype != torch.float32
    check_norm_kernels(x, residual, weight, group_size, min_exact=1.0, exact_scales=exact)
    gate_up = activations((*shape[:-1], 2 * shape[-1]), dtype, 9) * 0.3
    check_silu_kernel(gate_up, group_size, min_exact=1.0, exact_scales=exact)


@interpreter_only
@pytest.mark.parametrize(
    ("shape", "group_size"), [((3, 64), None), ((2, 300), 128), ((2, 3, 48), 16)]
)
def test_triton_chunked_bodies_match_refs_interpreted(monkeypatch, shape, group_size):
    """Rows and groups longer than ONE_PASS_MAX take the chunked bodies (the norm's three
    passes, SiLU's two): same results as the one-pass bodies the other tests run."""
    monkeypatch.setattr(triton_quant, "ONE_PASS_MAX", 16)
    assert triton_quant._one_pass_group(shape[-1], group_size or shape[-1], 512) == 0
    x, residual = activations(shape, torch.bfloat16, 16), activations(shape, torch.bfloat16, 17)
    weight = norm_weight(shape[-1], torch.bfloat16, 18)
    check_norm_kernels(x, residual, weight, group_size, min_exact=1.0, exact_scales=True)
    gate_up = activations((*shape[:-1], 2 * shape[-1]), torch.bfloat16, 19) * 0.3
    check_silu_kernel(gate_up, group_size, min_exact=1.0, exact_scales=True)


def test_one_pass_group_covers_model_widths():
    """The norm's one-pass body takes Llama-3-8B/70B and DeepSeek-V3 rows, per token and in
    128-groups; a row wider than its tile or non-power-of-two groups take the chunked body."""
    one_pass = triton_quant._one_pass_group
    assert one_pass(4096, 4096, 4096) == 4096
    assert one_pass(4096, 128, 4096) == 128
    assert one_pass(7168, 128, 8192) == 128
    assert one_pass(7168, 7168, 8192) == 8192  # one group spans the whole tile
    assert one_pass(300, 100, 512) == 0  # 100-wide groups do not split a power-of-two tile
    assert one_pass(600, 600, 512) == 0  # the row does not fit the tile
    assert one_pass(32768, 32768, 32768) == 0  # past ONE_PASS_MAX (16384)


@interpreter_only
def test_triton_kernels_read_strided_rows_and_fp32_weights_interpreted():
    wide = activations((4, 96), torch.bfloat16, 10)
    x, residual = wide[:, 16:80], wide[:, 8:72]  # slices: row stride 96
    weight = norm_weight(64, torch.float32, 11)  # promotes the norm output to fp32
    check_norm_kernels(x, residual, weight, 32, min_exact=0.99, exact_scales=False)
    check_silu_kernel(wide[:, :64], None, min_exact=1.0, exact_scales=True)


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens", [1, 7, 512])
@pytest.mark.parametrize("group_size", [None, 128])
def test_fused_ops_match_unfused_ops_gpu(num_tokens, group_size):
    """The fused CUDA ops against the unfused CUDA ops (eager norm / SiLU, then the Triton quant)
    on the Llama-3-8B hidden size in bf16."""
    hidden, dtype, cuda = 4096, torch.bfloat16, torch.device("cuda")
    x = activations((num_tokens, hidden), dtype, 12, cuda)
    residual = activations((num_tokens, hidden), dtype, 13, cuda)
    weight = norm_weight(hidden, dtype, 14, cuda)
    gate_up = activations((num_tokens, 2 * hidden), dtype, 15, cuda) * 0.3

    def quantize(y):
        if group_size is None:
            return fp8.per_token_fp8_quant(y)
        return fp8.per_token_group_fp8_quant(y, group_size)

    v = torch.ops.v1_engine
    norm_layer = RMSNorm(hidden, eps=1e-6).to(cuda, dtype)
    norm_layer.weight.data.copy_(weight)
    if group_size is None:
        fused = v.add_rms_norm_per_token_fp8_quant(x, residual, weight, 1e-6)
        plain = v.rms_norm_per_token_fp8_quant(x, weight, 1e-6)
        silu = v.silu_and_mul_per_token_fp8_quant(gate_up)
    else:
        fused = v.add_rms_norm_per_token_group_fp8_quant(x, residual, weight, 1e-6, group_size)
        plain = v.rms_norm_per_token_group_fp8_quant(x, weight, 1e-6, group_size)
        silu = v.silu_and_mul_per_token_group_fp8_quant(gate_up, group_size)
    normed, summed = norm_layer(x, residual)
    assert torch.equal(fused[2], summed)
    for got, unfused_input in (
        (fused[:2], normed),
        (plain, norm_layer(x)),
        (silu, SiluAndMul()(gate_up)),
    ):
        assert_quant_close(*got, *quantize(unfused_input), group_size, dtype, min_exact=0.99)
