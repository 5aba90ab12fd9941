"""The FP8 decode kernels of kernels/triton_gemv_fp8_decode.py ("weight_only": bf16 activations times
an e4m3 weight; "gated": gate_up with SiLU-and-mul in the epilogue) and the CUDA bodies of
compile/passes/fp8_linear_ops.py's ops that take them: under the interpreter on CPU (tiny
shapes with ragged edges, the ops' dispatch with the quantized chain stubbed), on the device
with CUDA (the Llama-3-8B shapes, a CUDA graph of both ops).

The kernels' products are exact in float32 and their sums float32, so they differ from the
float32 references by summation order and one rounding to the 16-bit output."""

from __future__ import annotations

import inspect

import pytest
import torch
from fp8_gemm_cases import ULP, Recorder, randn

from compile.passes import fp8_linear_ops
from compile.passes.fused_ops import silu_and_mul_ref
from v1_engine.kernels import fp8, skinny_launch

_CUDA = torch.cuda.is_available()
skinny = pytest.importorskip("v1_engine.kernels.triton_gemv_fp8")
fp8_launch = pytest.importorskip("v1_engine.kernels.fp8_launch")
decode = pytest.importorskip("v1_engine.kernels.triton_gemv_fp8_decode")
interpreter_only = pytest.mark.skipif(_CUDA, reason="the gpu cases cover this on a CUDA machine")

SMALL = {"block_n": 8, "block_k": 32, "num_warps": 4, "num_stages": 2}
"""Tiles small enough that the tiny shapes span several programs and K steps."""


def quantized_weight(n: int, k: int, seed: int, per_channel: bool = True, device: str = "cpu"):
    w = randn((n, k), seed, 0.05).to(device)
    return fp8.per_token_fp8_quant_ref(w) if per_channel else fp8.scaled_fp8_quant_ref(w)


def weight_only_ref(x, w, scale_w, bias=None) -> torch.Tensor:
    """(x @ w^T) * scale_w (+ bias) in float32 from the same operands, rounded to x's dtype."""
    out = (x.float() @ w.float().t()) * scale_w.float().reshape(1, -1)
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype)


def assert_matches(out: torch.Tensor, ref: torch.Tensor, ulps: float = 1.0) -> None:
    assert out.dtype == ref.dtype and out.shape == ref.shape
    ulp = ULP[out.dtype] * ulps
    scale = ref.float().abs().amax().item()
    torch.testing.assert_close(out.float(), ref.float(), rtol=ulp, atol=ulp * scale / 64)


def strided(x: torch.Tensor) -> torch.Tensor:
    """x [M, K] in a buffer whose rows sit K + 8 elements apart."""
    wide = torch.zeros((x.shape[0], x.shape[1] + 8), dtype=x.dtype, device=x.device)
    wide[:, 4 : 4 + x.shape[1]] = x
    return wide[:, 4 : 4 + x.shape[1]]


# ---- interpreter (CPU) -----------------------------------------------------------------------


@interpreter_only
@pytest.mark.parametrize("m", [1, 3, 4])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("per_channel", [True, False])
def test_weight_only_matches_reference_interpreted(m, dtype, per_channel):
    # N = 40 and K = 88 leave partial column tiles (8) and K steps (32); x's rows are strided.
    n, k = 40, 88
    x = strided(randn((m, k), m).to(dtype))
    w, scale_w = quantized_weight(n, k, seed=m + 1, per_channel=per_channel)
    bias = randn((n,), 7).to(dtype) if per_channel else None
    out = decode.fp8_weight_only_gemm(x, w, scale_w, bias, mode="fma", **SMALL)
    assert_matches(out, weight_only_ref(x, w, scale_w, bias))


@interpreter_only
@pytest.mark.parametrize("m", [1, 3, 4])
@pytest.mark.parametrize("per_token", [True, False])
@pytest.mark.parametrize("mode", fp8_launch.KIND_MODES["gated"])
def test_gated_matches_the_quantized_chain_interpreted(m, per_token, mode):
    # I = 40 gate rows then 40 up rows: the up half starts inside a column tile's stride (the
    # wgmma body's 64-row tile masks 24 of them); K = 88 is one masked step of 32, or of 128.
    i, k = 40, 88
    x = randn((m, k), m)
    a, scale_a = fp8.per_token_fp8_quant_ref(x) if per_token else fp8.scaled_fp8_quant_ref(x)
    w, scale_w = quantized_weight(2 * i, k, seed=5)
    launch = SMALL | ({"block_n": 64, "block_k": 128} if mode == "wgmma" else {})
    out = decode.fp8_gated_gemm(a, w, scale_a, scale_w, torch.bfloat16, mode=mode, **launch)
    ref = silu_and_mul_ref(fp8.scaled_mm_ref(a, w, scale_a, scale_w, torch.bfloat16))
    assert out.shape == (m, i)
    assert_matches(out, ref, ulps=2.0)


def test_decode_kind_launch_rules(monkeypatch):
    default = fp8_launch.default_fp8_launch("weight_only", 1, 4096, 4096)
    assert default["mode"] == "fma" and default["split_k"] == 1
    assert fp8_launch.default_fp8_launch("gated", 1, 28672, 4096)["block_n"] == 2
    measured = fp8_launch.fp8_launch_config("gated", 1, 28672, 4096)  # a table entry
    assert measured["mode"] == "wgmma"
    # The K step shrinks with M: the float32 accumulator stays at 32 registers a thread.
    block_ks = [
        fp8_launch.fp8_launch_config("weight_only", m, 64, 64)["block_k"] for m in (1, 2, 3)
    ]
    assert block_ks == [1024, 512, 256]
    for kind, m, bad, match in (
        ("weight_only", 8, {}, "'fma' needs M in 1..4"),
        ("gated", 1, {"mode": "dot_swap", "block_n": 32}, "mode must be one of"),
        ("weight_only", 1, {"mode": "wgmma", "block_n": 64, "block_k": 128}, "mode must be"),
        ("gated", 1, {"mode": "wgmma", "block_n": 32}, "block_n must be a multiple of 64"),
        ("weight_only", 1, {"split_k": 2}, "split_k must be 1"),
    ):
        with pytest.raises(ValueError, match=match):
            fp8_launch.resolve_fp8_launch(kind, m, 4096, 4096, bad)
    monkeypatch.setitem(fp8_launch.FP8_TUNED_LAUNCH, "weight_only", {})
    assert not fp8_launch.prefers_fp8_skinny("weight_only", 1, 4096, 4096)  # no entry: the chain
    # An entry beyond the fma body's rows is never taken (its launch would be refused).
    monkeypatch.setattr(skinny_launch, "SKINNY_GEMM_ENABLED", True)
    for bucket in (4, 8):
        monkeypatch.setitem(fp8_launch.FP8_TUNED_LAUNCH["weight_only"], (bucket, 64, 64), {})
    assert fp8_launch.prefers_fp8_skinny("weight_only", 3, 64, 64)
    assert not fp8_launch.prefers_fp8_skinny("weight_only", 5, 64, 64)


@pytest.fixture
def chain(monkeypatch):
    """The quantized chain's CUDA bodies stubbed by their references (CUTLASS cannot run on the
    CPU), call counters on both decode kernels, the decode tables empty."""
    from compile.passes import fused_quant_ops

    stubs = {
        "quant": Recorder(fp8.per_token_fp8_quant_ref),
        "scaled_mm": Recorder(fp8.scaled_mm_ref),
        "silu_quant": Recorder(lambda x, group_size: fused_quant_ops.silu_and_mul_quant_ref(x)),
    }
    monkeypatch.setattr(fp8, "_per_token_fp8_quant_cuda", stubs["quant"])
    monkeypatch.setattr(fp8, "_scaled_mm_cuda", stubs["scaled_mm"])

    class FusedQuant:
        silu_and_mul_quant = stubs["silu_quant"]

    monkeypatch.setattr(fused_quant_ops, "_triton", lambda: FusedQuant)
    kernels = {}
    for name in ("fp8_weight_only_gemm", "fp8_gated_gemm"):
        kernels[name] = Recorder(getattr(decode, name))
        monkeypatch.setattr(decode, name, lambda *a, _r=kernels[name], **kw: _r(*a, **kw))
    for kind in fp8_launch.DECODE_KINDS:
        monkeypatch.setitem(fp8_launch.FP8_TUNED_LAUNCH, kind, {})
    monkeypatch.setattr(skinny_launch, "SKINNY_GEMM_ENABLED", True)
    return stubs, kernels


@interpreter_only
def test_dynamic_linear_cuda_body_dispatch_interpreted(chain, monkeypatch):
    """The quantized chain without a table entry, for another dtype and for M beyond the fma
    body; the weight-only kernel (x not quantized) with one."""
    stubs, kernels = chain
    n, k = 40, 64
    x = randn((3, k), 1).to(torch.bfloat16)
    w, scale_w = quantized_weight(n, k, seed=2)
    bias = randn((n,), 3).to(torch.bfloat16)
    args = (x, w, scale_w, torch.bfloat16, bias)
    want = fp8_linear_ops.fp8_dynamic_linear_ref(*args)
    assert torch.equal(fp8_linear_ops.fp8_dynamic_linear_cuda(*args), want)
    assert (stubs["quant"].calls, stubs["scaled_mm"].calls) == (1, 1)

    launch = fp8_launch.resolve_fp8_launch("weight_only", 3, n, k, SMALL)
    monkeypatch.setitem(fp8_launch.FP8_TUNED_LAUNCH["weight_only"], (4, n, k), launch)
    out = fp8_linear_ops.fp8_dynamic_linear_cuda(*args)
    assert_matches(out, weight_only_ref(x, w, scale_w, bias))
    assert kernels["fp8_weight_only_gemm"].calls == 1
    # Not x's own quantization: the quantized chain differs by the e4m3 rounding of x.
    assert not torch.equal(out, want)

    fp8_linear_ops.fp8_dynamic_linear_cuda(x.float(), w, scale_w, torch.bfloat16, bias)
    x8 = randn((8, k), 4).to(torch.bfloat16)
    monkeypatch.setitem(fp8_launch.FP8_TUNED_LAUNCH["weight_only"], (8, n, k), launch)
    fp8_linear_ops.fp8_dynamic_linear_cuda(x8, w, scale_w, torch.bfloat16, bias)
    assert kernels["fp8_weight_only_gemm"].calls == 1
    assert (stubs["quant"].calls, stubs["scaled_mm"].calls) == (3, 3)


@interpreter_only
def test_gated_mlp_cuda_body_dispatch_interpreted(chain, monkeypatch):
    """The quantized chain unless both tables hold the shapes (and the activation stays in the
    GEMM's dtype); with both, the gated kernel then the weight-only one."""
    stubs, kernels = chain
    i, k, n = 40, 64, 48
    a, scale_a = fp8.per_token_fp8_quant_ref(randn((2, k), 1))
    w_gu, s_gu = quantized_weight(2 * i, k, seed=2)
    w_d, s_d = quantized_weight(n, i, seed=3)
    args = (a, scale_a, w_gu, s_gu, w_d, s_d, torch.bfloat16, torch.bfloat16)
    want = fp8_linear_ops.fp8_gated_mlp_ref(*args)
    assert torch.equal(fp8_linear_ops.fp8_gated_mlp_cuda(*args), want)
    assert (stubs["scaled_mm"].calls, stubs["silu_quant"].calls) == (2, 1)

    gated = fp8_launch.resolve_fp8_launch("gated", 2, 2 * i, k, SMALL)
    monkeypatch.setitem(fp8_launch.FP8_TUNED_LAUNCH["gated"], (2, 2 * i, k), gated)
    fp8_linear_ops.fp8_gated_mlp_cuda(*args)  # the down shape has no entry yet
    assert kernels["fp8_gated_gemm"].calls == 0
    down = fp8_launch.resolve_fp8_launch("weight_only", 2, n, i, SMALL)
    monkeypatch.setitem(fp8_launch.FP8_TUNED_LAUNCH["weight_only"], (2, n, i), down)
    out = fp8_linear_ops.fp8_gated_mlp_cuda(*args)
    h = silu_and_mul_ref(fp8.scaled_mm_ref(a, w_gu, scale_a, s_gu, torch.bfloat16))
    assert_matches(out, weight_only_ref(h, w_d, s_d), ulps=2.0)
    assert (kernels["fp8_gated_gemm"].calls, kernels["fp8_weight_only_gemm"].calls) == (1, 1)

    fp8_linear_ops.fp8_gated_mlp_cuda(*args[:-1], torch.float32)  # a float32 model's SiLU input
    assert kernels["fp8_gated_gemm"].calls == 1
    assert (stubs["scaled_mm"].calls, stubs["silu_quant"].calls) == (6, 3)


def test_fma_kernels_compile_for_sm90_without_spills(run_compile_probe):
    """The fma launches the sweeps start from, compiled for sm_90 (fp8_decode_probe.py): no
    spills, at M = 1 a K loop the SM can issue at the HBM rate, no tensor-core instructions,
    e4m3 upcast by the packed two-value conversion, the weight tiles multi-buffered in shared
    memory (cp.async pipelining) and read back in vectors (a 3-D broadcast read them byte by
    byte: 200 instructions a 4 KB step at M = 1 against 160, the bf16 kernel's 106). The wgmma
    launches: FP8 warpgroup MMAs on the tiles as loaded, no upcast, half the fma body's
    instructions a byte or fewer. The norm kinds (the add + RMSNorm folded in) likewise, with
    more registers."""
    report = run_compile_probe("fp8_decode_probe.py")
    assert len(report) == 18
    for name, case in report.items():
        assert case["k_loop"] > 0, (name, case)  # the K loop was found in the SASS
        if name.startswith("wgmma_"):  # FP8 warpgroup MMAs on the tiles as loaded
            assert case["stack"] == 0 and case["fp8_wgmma"] > 0, (name, case)
            assert case["f16_unpacks"] == 0 and case["e4m3_to_f16x2"] == 0, (name, case)
            assert case["issue_per_byte"] < 0.1, (name, case)
            continue
        if name.endswith("_m1"):  # below the ~0.24 warp instructions a byte an SM issues at HBM
            assert case["issue_per_byte"] < 0.2, (name, case)
        # The norm kinds' row work (x + residual, h^2, h * w) amortizes over 64 accumulator
        # values a thread (0.16-0.17 at M = 1; 0.25-0.27 with 32): 130-160 registers, 3 programs
        # an SM.
        limit = 168 if name.startswith("norm") else 128
        assert case["stack"] == 0 and case["registers"] <= limit, (name, case)
        assert case["e4m3_to_f16x2"] > 0 and not case["tensor_core"], (name, case)
        assert case["shared"] > 0, (name, case)
        assert case["byte_smem_loads"] == 0, (name, case)  # 2-D tiles, vector reads


# ---- device ----------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 3, 4])
@pytest.mark.parametrize(("n", "k"), [(4096, 4096), (4096, 14336), (6144, 4096)])
def test_weight_only_llama3_shapes_gpu(m, n, k):
    x = randn((m, k), m).to("cuda", torch.bfloat16)
    w, scale_w = quantized_weight(n, k, seed=1, device="cuda")
    out = decode.fp8_weight_only_gemm(x, w, scale_w)
    assert_matches(out, weight_only_ref(x, w, scale_w))
    launch = {"block_n": 8, "block_k": 512, "num_stages": 3}
    assert_matches(decode.fp8_weight_only_gemm(x, w, scale_w, **launch), out, ulps=2.0)


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 3, 4])
@pytest.mark.parametrize("mode", [*fp8_launch.KIND_MODES["gated"], "table"])
def test_gated_llama3_gate_up_gpu(m, mode):
    """Each body, and "table": the launch the op takes at this M (at M = 1 the measured wgmma
    entry, 128-deep steps)."""
    a, scale_a = fp8.per_token_fp8_quant_ref(randn((m, 4096), m).cuda())
    w, scale_w = quantized_weight(28672, 4096, seed=2, device="cuda")
    launch = {
        "fma": {"mode": "fma", "block_n": 4, "block_k": 1024 if m == 1 else 256},
        "wgmma": {"mode": "wgmma", "block_n": 64, "block_k": 256},
        "table": {},
    }[mode]
    out = decode.fp8_gated_gemm(a, w, scale_a, scale_w, torch.bfloat16, **launch)
    ref = silu_and_mul_ref(fp8.scaled_mm_ref(a, w, scale_a, scale_w, torch.bfloat16))
    assert_matches(out, ref, ulps=2.0)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["weight_only", "gated"])
def test_early_release_leaves_results_unchanged_gpu(kind, monkeypatch):
    """The last waves' early signal changes when the next kernel's programs start, not what
    this one computes: bit-identical outputs to the launch without it, eager and replayed in a
    CUDA graph after the same GEMM."""
    a, scale_a = fp8.per_token_fp8_quant_ref(randn((1, 4096), 7).cuda())
    w, scale_w = quantized_weight(28672 if kind == "gated" else 4096, 4096, seed=8, device="cuda")
    x = a.float().to(torch.bfloat16)

    def run():
        if kind == "gated":
            return decode.fp8_gated_gemm(a, w, scale_a, scale_w, torch.bfloat16)
        return decode.fp8_weight_only_gemm(x, w, scale_w)

    monkeypatch.setattr(decode, "EARLY_RELEASE_PER_SM", 0)
    base = run()
    monkeypatch.setattr(decode, "EARLY_RELEASE_PER_SM", 2)
    assert torch.equal(run(), base)
    run()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        first = run()
        second = run()
    graph.replay()
    assert torch.equal(first, base) and torch.equal(second, base)


@pytest.mark.gpu
def test_decode_ops_replay_in_a_cuda_graph_gpu(monkeypatch):
    """Both ops with table entries for the Llama-3-8B shapes at M = 1, captured once and
    replayed on new inputs: the replay equals an eager call, and is near the quantized chain."""
    import compile.passes.fp8_linear_ops  # noqa: F401 - registers the ops

    for kind, shape in (
        ("weight_only", (4096, 4096)),
        ("weight_only", (4096, 14336)),
        ("gated", (28672, 4096)),
    ):
        key = (1, *shape)
        monkeypatch.setitem(
            fp8_launch.FP8_TUNED_LAUNCH[kind], key, fp8_launch.fp8_launch_config(kind, *key)
        )
    w_o, s_o = quantized_weight(4096, 4096, seed=1, device="cuda")
    w_gu, s_gu = quantized_weight(28672, 4096, seed=2, device="cuda")
    w_d, s_d = quantized_weight(4096, 14336, seed=3, device="cuda")
    x = torch.zeros((1, 4096), device="cuda", dtype=torch.bfloat16)
    ops = torch.ops.v1_engine

    def step():
        o = ops.fp8_dynamic_linear(x, w_o, s_o, torch.bfloat16, None)
        q, scale = fp8.per_token_fp8_quant(o)
        bf16 = torch.bfloat16
        return ops.fp8_gated_mlp(q, scale, w_gu, s_gu, w_d, s_d, bf16, bf16)

    step()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    for seed in (4, 5):
        x.copy_(randn((1, 4096), seed).cuda().to(torch.bfloat16))
        graph.replay()
        eager = step()
        assert torch.equal(captured, eager)
        monkeypatch.setattr(skinny_launch, "SKINNY_GEMM_ENABLED", False)
        quantized = step()
        monkeypatch.setattr(skinny_launch, "SKINNY_GEMM_ENABLED", True)
        scale = quantized.float().abs().amax().item()
        assert (eager.float() - quantized.float()).abs().amax().item() < 0.1 * scale


@pytest.mark.parametrize(
    ("kind", "mode"),
    [("channel", "fma"), ("channel", "dot_swap"), ("block", "fma"), ("weight_only", "fma"),
     ("gated", "fma"), ("gated", "wgmma"), ("norm", "fma"), ("norm_gated", "fma"),
     ("norm", "wgmma"), ("norm_gated", "wgmma")],
)  # fmt: skip
def test_precompile_passes_every_constexpr_of_its_kernel(kind, mode, monkeypatch):
    """`precompile_fp8` (the sweeps' parallel compiles) warms up the kernel with exactly the
    compile-time arguments the launch passes: each kernel's constexpr parameters, no other."""
    kernels = {"channel": skinny._fp8_skinny_kernel, "block": skinny._fp8_block_skinny_kernel,
               "weight_only": decode._fp8_decode_kernel, "gated": decode._fp8_decode_kernel,
               "norm": decode._fp8_decode_kernel, "norm_gated": decode._fp8_decode_kernel}  # fmt: skip
    kernel = kernels[kind]
    seen = {}
    monkeypatch.setattr(kernel, "warmup", lambda *args, grid, **kwargs: seen.update(kwargs))
    monkeypatch.setattr(skinny, "launch_options", lambda device: {"PDL": False})
    n, k = (256, 512) if kind in ("gated", "norm_gated") else (128, 512)
    block_n = {"wgmma": 64, "dot_swap": 16}.get(mode, 8)
    launch = {"mode": mode, "block_n": block_n, "block_k": 128}
    skinny.precompile_fp8(kind, torch.bfloat16, 1, n, k, **launch)
    signature = inspect.signature(getattr(kernel, "fn", kernel))  # interpreted or jitted
    constexprs = {
        name for name, p in signature.parameters.items() if "constexpr" in str(p.annotation)
    }
    launch_options = {"num_warps", "num_stages"}
    assert set(seen) - launch_options == constexprs
