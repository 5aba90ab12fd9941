"""The "norm" kinds of kernels/triton_gemv_fp8_decode.py (an FP8 GEMM with the residual add and
RMSNorm before it folded in) and the ops of compile/passes/fp8_norm_ops.py that run them: under
the interpreter on CPU (tiny shapes with ragged edges, the ops' dispatch with the quantized chain
stubbed), on the device with CUDA (the Llama-3-8B shapes, both ops in a CUDA graph).

The fma body computes rsqrt(mean(h^2) + eps) * ((h * w_norm) @ W^T) * scale_w for h = x +
residual rounded to x's dtype. Its products are exact in float32 and its sums float32, so it
differs from a float64 evaluation of that formula by summation order and one rounding to the
16-bit output; from the quantized chain (norm, bf16 rounding, e4m3 activation) by the
activation's roundings. The wgmma body is the quantized chain: it norms and quantizes the
activation as the norm-quant kernel does and multiplies e4m3 by e4m3."""

from __future__ import annotations

import pytest
import torch
from test_fp8_decode_gemm import assert_matches, quantized_weight, randn, strided

from compile.passes import fp8_norm_ops
from compile.passes.fused_ops import silu_and_mul_ref
from compile.passes.fused_quant_ops import add_rms_norm_quant_ref
from v1_engine.kernels import fp8, skinny_launch

_CUDA = torch.cuda.is_available()
fp8_launch = pytest.importorskip("v1_engine.kernels.fp8_launch")
decode = pytest.importorskip("v1_engine.kernels.triton_gemv_fp8_decode")
interpreter_only = pytest.mark.skipif(_CUDA, reason="the gpu cases cover this on a CUDA machine")

SMALL = {"mode": "fma", "block_n": 8, "block_k": 32, "num_warps": 4, "num_stages": 2}
WGMMA = {"mode": "wgmma", "block_n": 64, "block_k": 128, "num_warps": 4, "num_stages": 2}
EPS = 1e-5


def norm_operands(m: int, k: int, dtype: torch.dtype, seed: int, device: str = "cpu"):
    x = randn((m, k), seed).to(device, dtype)
    residual = randn((m, k), seed + 100).to(device, dtype)
    norm_weight = (1.0 + randn((k,), seed + 200, 0.2)).to(device, dtype)
    return x, residual, norm_weight


def folded_ref(x, residual, norm_weight, w, scale_w, bias=None, gated=False):
    """(out, h) of the folded formula in float64 from the same operands: the kernel's result up
    to summation order and its output rounding."""
    h = (x.float() + residual.float()).to(x.dtype)
    hd = h.double()
    normed = hd * torch.rsqrt(hd.pow(2).mean(-1, keepdim=True) + EPS) * norm_weight.double()
    out = (normed @ w.double().t()) * scale_w.double().reshape(1, -1)
    if bias is not None:
        out = out + bias.double()
    if gated:  # gate and up rounded to the output dtype as scaled_mm stores them
        return silu_and_mul_ref(out.to(x.dtype)), h
    return out.to(x.dtype), h


def chain_ref(x, residual, norm_weight, w, scale_w, bias=None, gated=False):
    """The quantized chain the ops replace: add + RMSNorm + e4m3 quant, then scaled_mm (and
    SiLU-and-mul where `gated`)."""
    q, scale, summed = add_rms_norm_quant_ref(x, residual, norm_weight, EPS)
    out = fp8.scaled_mm_ref(q, w, scale, scale_w, x.dtype, bias)
    return (silu_and_mul_ref(out) if gated else out), summed


# ---- interpreter (CPU) -----------------------------------------------------------------------


@interpreter_only
@pytest.mark.parametrize("m", [1, 3, 4])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("gated", [False, True])
def test_norm_gemm_matches_the_folded_formula_interpreted(m, dtype, gated):
    # N = 40 (gated: 20 gate then 20 up rows) and K = 88 leave partial column tiles (8) and K
    # steps (32); x's rows are strided, the residual's contiguous.
    n, k = 40, 88
    x, residual, norm_weight = norm_operands(m, k, dtype, seed=m)
    x = strided(x)
    w, scale_w = quantized_weight(n, k, seed=m + 1)
    bias = None if gated else randn((n,), 7).to(dtype)
    out, h = decode.fp8_add_norm_gemm(
        x, residual, norm_weight, EPS, w, scale_w, bias, gated=gated, **SMALL
    )
    want, want_h = folded_ref(x, residual, norm_weight, w, scale_w, bias, gated)
    assert torch.equal(h, want_h)  # the residual sum, written once by program 0
    assert out.shape == (m, n // 2 if gated else n)
    assert_matches(out, want, ulps=2.0)


@interpreter_only
def test_norm_gemm_is_near_the_quantized_chain_interpreted():
    """Against the chain it replaces: the same residual sum, and outputs within the e4m3
    rounding of the activation (2^-4 relative) the fused kernel skips."""
    x, residual, norm_weight = norm_operands(2, 256, torch.bfloat16, seed=3)
    w, scale_w = quantized_weight(48, 256, seed=4)
    out, h = decode.fp8_add_norm_gemm(x, residual, norm_weight, EPS, w, scale_w, **SMALL)
    want, want_h = chain_ref(x, residual, norm_weight, w, scale_w)
    assert torch.equal(h, want_h)
    scale = want.float().abs().amax().item()
    error = (out.float() - want.float()).abs().amax().item()
    assert 0 < error < 2.0**-4 * scale  # different roundings, but close


@interpreter_only
@pytest.mark.parametrize("m", [1, 3, 4])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("gated", [False, True])
def test_norm_gemm_wgmma_body_is_the_quantized_chain_interpreted(m, dtype, gated):
    """The wgmma body norms and quantizes the activation in every program as the norm-quant
    kernel does, so it computes the chain's e4m3 x e4m3 product: within the output's rounding
    of it, where the fma body (not quantized) is 2^-4 of the activation away. N = 160 (gated:
    80 gate then 80 up rows) leaves a partial 64-row tile, K = 200 a partial 128-wide step; the
    rows of m = 3 / 4 get their own scales (one loud row)."""
    n, k = 160, 200
    x, residual, norm_weight = norm_operands(m, k, dtype, seed=m + 20)
    x[-1] *= 30.0
    x = strided(x)
    w, scale_w = quantized_weight(n, k, seed=m + 21)
    bias = None if gated else randn((n,), 8).to(dtype)
    out, h = decode.fp8_add_norm_gemm(
        x, residual, norm_weight, EPS, w, scale_w, bias, gated=gated, **WGMMA
    )
    want, want_h = chain_ref(x, residual, norm_weight, w, scale_w, bias, gated)
    assert torch.equal(h, want_h)
    assert_matches(out, want, ulps=1.0)
    folded, _ = folded_ref(x, residual, norm_weight, w, scale_w, bias, gated)
    assert not torch.allclose(out.float(), folded.float(), rtol=2**-7, atol=0)


@interpreter_only
def test_norm_gemm_rows_are_independent_interpreted():
    """A row's output depends on its own sum of squares only: rows computed together equal rows
    computed alone (a shared or mixed-up rstd would break this)."""
    x, residual, norm_weight = norm_operands(4, 64, torch.bfloat16, seed=9)
    x[2] *= 50.0  # one loud row
    w, scale_w = quantized_weight(16, 64, seed=10)
    together, _ = decode.fp8_add_norm_gemm(x, residual, norm_weight, EPS, w, scale_w, **SMALL)
    for row in range(4):
        alone, _ = decode.fp8_add_norm_gemm(
            x[row : row + 1], residual[row : row + 1], norm_weight, EPS, w, scale_w, **SMALL
        )
        assert torch.equal(together[row : row + 1], alone)


def test_norm_kind_launch_rules():
    assert fp8_launch.default_fp8_launch("norm_gated", 1, 28672, 4096)["block_n"] == 2
    assert fp8_launch.default_fp8_launch("norm", 1, 6144, 4096)["mode"] == "fma"
    for kind, bad, match in (
        ("norm", {"mode": "dot_swap", "block_n": 32}, "mode must be one of"),
        ("norm_gated", {"mode": "wgmma", "block_n": 32, "block_k": 128}, "multiple of 64"),
        ("norm", {"split_k": 2}, "split_k must be 1"),
    ):
        with pytest.raises(ValueError, match=match):
            fp8_launch.resolve_fp8_launch(kind, 1, 4096, 4096, bad)
    wgmma = {"mode": "wgmma", "block_n": 64, "block_k": 128}
    assert fp8_launch.resolve_fp8_launch("norm_gated", 4, 28672, 4096, wgmma)["mode"] == "wgmma"
    with pytest.raises(ValueError, match="K <= 8192"):  # the row the prologue holds
        fp8_launch.resolve_fp8_launch("norm", 1, 4096, 16384, wgmma)
    # Measured: Llama-3-8B's qkv and gate_up at M = 1, valid launches of their kinds; every
    # other M bucket and shape runs the quantized chain.
    for kind, shape in (("norm", (6144, 4096)), ("norm_gated", (28672, 4096))):
        assert set(fp8_launch.FP8_TUNED_LAUNCH[kind]) == {(1, *shape)}
        launch = fp8_launch.FP8_TUNED_LAUNCH[kind][(1, *shape)]
        assert fp8_launch.resolve_fp8_launch(kind, 1, *shape, launch)["mode"] == "fma"
        assert fp8_launch.prefers_fp8_skinny(kind, 1, *shape)
        assert not fp8_launch.prefers_fp8_skinny(kind, 2, *shape)
    assert not fp8_launch.prefers_fp8_skinny("norm", 1, 4096, 4096)


class Recorder:
    """Counts calls, then runs the wrapped function."""

    def __init__(self, function):
        self.calls = 0
        self.function = function

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return self.function(*args, **kwargs)


@pytest.fixture
def chain(monkeypatch):
    """The quantized chain's CUDA bodies stubbed by their references (CUTLASS cannot run on the
    CPU), call counters on the kernels, the decode tables empty."""
    from compile.passes import fused_quant_ops

    stubs = {
        "norm_quant": Recorder(
            lambda x, residual, w, eps, group_size: add_rms_norm_quant_ref(x, residual, w, eps)
        ),
        "scaled_mm": Recorder(fp8.scaled_mm_ref),
        "silu_quant": Recorder(lambda x, group_size: fused_quant_ops.silu_and_mul_quant_ref(x)),
    }
    monkeypatch.setattr(fp8, "_scaled_mm_cuda", stubs["scaled_mm"])

    class FusedQuant:
        rms_norm_quant = stubs["norm_quant"]
        silu_and_mul_quant = stubs["silu_quant"]

    monkeypatch.setattr(fused_quant_ops, "_triton", lambda: FusedQuant)
    kernels = {}
    for name in ("fp8_add_norm_gemm", "fp8_weight_only_gemm", "fp8_gated_gemm"):
        kernels[name] = Recorder(getattr(decode, name))
        monkeypatch.setattr(decode, name, lambda *a, _r=kernels[name], **kw: _r(*a, **kw))
    for kind in fp8_launch.DECODE_KINDS:
        monkeypatch.setitem(fp8_launch.FP8_TUNED_LAUNCH, kind, {})
    monkeypatch.setattr(skinny_launch, "SKINNY_GEMM_ENABLED", True)
    return stubs, kernels


@interpreter_only
def test_add_norm_linear_cuda_body_dispatch_interpreted(chain, monkeypatch):
    """The chain (norm-quant kernel, then scaled_mm) without a table entry and beyond the fma
    body's rows; the folded kernel with one."""
    stubs, kernels = chain
    m, n, k = 2, 48, 64
    x, residual, norm_weight = norm_operands(m, k, torch.bfloat16, seed=5)
    w, scale_w = quantized_weight(n, k, seed=6)
    args = (x, residual, norm_weight, EPS, w, scale_w, torch.bfloat16)
    want = fp8_norm_ops.fp8_add_norm_linear_ref(*args)
    got = fp8_norm_ops.fp8_add_norm_linear_cuda(*args)
    assert all(torch.equal(g, v) for g, v in zip(got, want, strict=True))
    assert (stubs["norm_quant"].calls, stubs["scaled_mm"].calls) == (1, 1)

    launch = fp8_launch.resolve_fp8_launch("norm", m, n, k, SMALL)
    monkeypatch.setitem(fp8_launch.FP8_TUNED_LAUNCH["norm"], (m, n, k), launch)
    out, h = fp8_norm_ops.fp8_add_norm_linear_cuda(*args)
    assert kernels["fp8_add_norm_gemm"].calls == 1
    assert torch.equal(h, want[1])
    assert_matches(out, folded_ref(x, residual, norm_weight, w, scale_w)[0], ulps=2.0)

    fp8_norm_ops.fp8_add_norm_linear_cuda(*args[:-1], torch.float16)  # another output dtype
    big = norm_operands(8, k, torch.bfloat16, seed=7)  # beyond the fma body
    fp8_norm_ops.fp8_add_norm_linear_cuda(*big, EPS, w, scale_w, torch.bfloat16)
    assert kernels["fp8_add_norm_gemm"].calls == 1
    assert stubs["norm_quant"].calls == 3


@interpreter_only
def test_add_norm_gated_mlp_cuda_body_dispatch_interpreted(chain, monkeypatch):
    """The chain unless the norm_gated and weight_only tables both hold the shapes; with both,
    the folded gated kernel then the weight-only down GEMM."""
    stubs, kernels = chain
    m, i, k, n = 1, 40, 64, 48
    x, residual, norm_weight = norm_operands(m, k, torch.bfloat16, seed=8)
    w_gu, s_gu = quantized_weight(2 * i, k, seed=2)
    w_d, s_d = quantized_weight(n, i, seed=3)
    bf16 = torch.bfloat16
    args = (x, residual, norm_weight, EPS, w_gu, s_gu, w_d, s_d, bf16, bf16)
    want = fp8_norm_ops.fp8_add_norm_gated_mlp_ref(*args)
    got = fp8_norm_ops.fp8_add_norm_gated_mlp_cuda(*args)
    assert all(torch.equal(g, v) for g, v in zip(got, want, strict=True))
    assert (stubs["norm_quant"].calls, stubs["scaled_mm"].calls, stubs["silu_quant"].calls) == (
        1,
        2,
        1,
    )

    gated = fp8_launch.resolve_fp8_launch("norm_gated", m, 2 * i, k, SMALL)
    monkeypatch.setitem(fp8_launch.FP8_TUNED_LAUNCH["norm_gated"], (m, 2 * i, k), gated)
    fp8_norm_ops.fp8_add_norm_gated_mlp_cuda(*args)  # the down shape has no entry yet
    assert kernels["fp8_add_norm_gemm"].calls == 0
    down = fp8_launch.resolve_fp8_launch("weight_only", m, n, i, SMALL)
    monkeypatch.setitem(fp8_launch.FP8_TUNED_LAUNCH["weight_only"], (m, n, i), down)
    out, h = fp8_norm_ops.fp8_add_norm_gated_mlp_cuda(*args)
    assert (kernels["fp8_add_norm_gemm"].calls, kernels["fp8_weight_only_gemm"].calls) == (1, 1)
    assert torch.equal(h, want[1])
    act, _ = folded_ref(x, residual, norm_weight, w_gu, s_gu, gated=True)
    down_ref = (act.float() @ w_d.float().t()) * s_d.float().reshape(1, -1)
    assert_matches(out, down_ref.to(bf16), ulps=2.0)
    # Against the quantized MLP: within the activations' e4m3 roundings.
    scale = want[0].float().abs().amax().item()
    assert (out.float() - want[0].float()).abs().amax().item() < 0.1 * scale


def test_norm_ops_pass_opcheck():
    x, residual, norm_weight = norm_operands(3, 256, torch.bfloat16, seed=11)
    w, s = quantized_weight(64, 256, seed=12)
    w_gu, s_gu = quantized_weight(128, 256, seed=13)
    w_d, s_d = quantized_weight(32, 64, seed=14)
    bias = randn((64,), 15).to(torch.bfloat16)
    bf16 = torch.bfloat16
    v = torch.ops.v1_engine
    # opcheck's schema test perturbs the inputs arithmetically, which e4m3 tensors do not support.
    utils = ("test_faketensor", "test_aot_dispatch_dynamic")
    torch.library.opcheck(
        v.fp8_add_norm_linear.default,
        (x, residual, norm_weight, EPS, w, s, bf16, bias),
        test_utils=utils,
    )
    torch.library.opcheck(
        v.fp8_add_norm_gated_mlp.default,
        (x, residual, norm_weight, EPS, w_gu, s_gu, w_d, s_d, bf16, bf16),
        test_utils=utils,
    )


# ---- device ----------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 3, 4])
@pytest.mark.parametrize(("n", "gated"), [(6144, False), (28672, True)])
def test_norm_gemm_llama3_shapes_gpu(m, n, gated):
    k = 4096
    x, residual, norm_weight = norm_operands(m, k, torch.bfloat16, seed=m, device="cuda")
    w, scale_w = quantized_weight(n, k, seed=1, device="cuda")
    # The default launch, and one with other tiles (64 float32 accumulators a thread at M = 4
    # gated, as the sweep's register rule allows).
    for launch in ({}, {"block_n": 4, "block_k": 256, "num_stages": 3}):
        out, h = decode.fp8_add_norm_gemm(
            x, residual, norm_weight, EPS, w, scale_w, gated=gated, mode="fma", **launch
        )
        want, want_h = folded_ref(x, residual, norm_weight, w, scale_w, gated=gated)
        assert torch.equal(h, want_h)
        assert_matches(out, want, ulps=2.0)


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 3, 4])
@pytest.mark.parametrize(("n", "gated"), [(6144, False), (28672, True)])
def test_norm_gemm_wgmma_body_llama3_shapes_gpu(m, n, gated):
    """The wgmma body against the quantized chain's reference (the norm-quant reference, then
    the float32 product of the e4m3 operands). Not bit for bit: the kernel's sum of squares
    runs in another order than torch's and rsqrt is the hardware's, so a normed value within a
    few float32 ulps of a bf16 rounding boundary may round the other way and move its e4m3 value
    one step (2^-3), as the norm-quant kernel's own tests allow; each such element moves every
    output by |w x| 2^-3, on top of the output's own rounding (up to 2^-7 of the scale at the
    largest value). So: within 2^-6 of the output's scale everywhere, and far nearer the chain
    than the unquantized fold (whose activation is off by up to 2^-4 in every element: on the
    interpreter at K = 1024, mean errors 0.0035 against 0.036)."""
    k = 4096
    x, residual, norm_weight = norm_operands(m, k, torch.bfloat16, seed=m + 30, device="cuda")
    w, scale_w = quantized_weight(n, k, seed=2, device="cuda")
    for launch in (WGMMA, WGMMA | {"block_k": 256, "num_stages": 4}):
        out, h = decode.fp8_add_norm_gemm(
            x, residual, norm_weight, EPS, w, scale_w, gated=gated, **launch
        )
        want, want_h = chain_ref(x, residual, norm_weight, w, scale_w, gated=gated)
        folded, _ = folded_ref(x, residual, norm_weight, w, scale_w, gated=gated)
        assert torch.equal(h, want_h)
        error = (out.float() - want.float()).abs()
        scale = want.float().abs().amax().item()
        assert error.amax().item() <= 2.0**-6 * scale, (error.amax().item(), scale)
        assert 4 * error.mean() < (out.float() - folded.float()).abs().mean()


@pytest.mark.gpu
def test_norm_ops_replay_in_a_cuda_graph_gpu(monkeypatch):
    """Both ops with table entries for the Llama-3-8B shapes at M = 1, captured once and
    replayed on new inputs: the replay equals an eager call and is near the quantized chain."""
    for kind, shape in (
        ("norm", (6144, 4096)),
        ("norm_gated", (28672, 4096)),
        ("weight_only", (4096, 14336)),
    ):
        key = (1, *shape)
        monkeypatch.setitem(
            fp8_launch.FP8_TUNED_LAUNCH[kind], key, fp8_launch.fp8_launch_config(kind, *key)
        )
    w_qkv, s_qkv = quantized_weight(6144, 4096, seed=1, device="cuda")
    w_gu, s_gu = quantized_weight(28672, 4096, seed=2, device="cuda")
    w_d, s_d = quantized_weight(4096, 14336, seed=3, device="cuda")
    x, residual, norm_weight = (
        t.clone() for t in norm_operands(1, 4096, torch.bfloat16, 0, "cuda")
    )
    ops = torch.ops.v1_engine
    bf16 = torch.bfloat16

    def step():
        qkv, summed = ops.fp8_add_norm_linear(x, residual, norm_weight, EPS, w_qkv, s_qkv, bf16)
        mlp, summed2 = ops.fp8_add_norm_gated_mlp(
            qkv[:, :4096], summed, norm_weight, EPS, w_gu, s_gu, w_d, s_d, bf16, bf16
        )
        return qkv, mlp, summed, summed2

    step()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    for seed in (4, 5):
        new = norm_operands(1, 4096, torch.bfloat16, seed, "cuda")
        x.copy_(new[0])
        residual.copy_(new[1])
        graph.replay()
        eager = step()
        for c, e in zip(captured, eager, strict=True):
            assert torch.equal(c, e)
        monkeypatch.setattr(skinny_launch, "SKINNY_GEMM_ENABLED", False)
        quantized = step()
        monkeypatch.setattr(skinny_launch, "SKINNY_GEMM_ENABLED", True)
        # The first residual sum is the same add. The second adds qkv, which the fold computes
        # from the unquantized activation, so it is only near the chain's.
        assert torch.equal(eager[2], quantized[2])
        for e, q in zip(eager[:2] + eager[3:], quantized[:2] + quantized[3:], strict=True):
            scale = q.float().abs().amax().item()
            assert (e.float() - q.float()).abs().amax().item() < 0.1 * scale
