"""Programmatic dependent launch (kernels/pdl.py): when it is on, that every PDL kernel keeps the
contract in its PTX (wait before any memory access; short kernels signal first, long ones after
their main loop), and on the GPU that a chain of PDL kernels in a CUDA graph never reads a stale
value."""

from __future__ import annotations

import pytest
import torch

from v1_engine.kernels import pdl

PDL_KERNELS = {
    "_add_rms_norm_kernel",
    "_fp8_block_skinny_kernel",
    "_fp8_decode_kernel",
    "_fp8_skinny_kernel",
    "_group_quant_kernel",
    "_merge_splits_kernel",
    "_mla_decode_kernel",
    "_moe_align_kernel",
    "_moe_gemm_kernel",
    "_paged_attention_kernel",
    "_quantize_and_cache_kernel",
    "_rms_norm_quant_kernel",
    "_rope_kernel",
    "_silu_and_mul_kernel",
    "_silu_and_mul_quant_kernel",
    "_skinny_gemm_kernel",
    "_static_quant_kernel",
    "_write_latent_kernel",
}
LATE_RELEASE = {
    "_skinny_gemm_kernel",
    "_fp8_skinny_kernel",
    "_fp8_block_skinny_kernel",
    "_fp8_decode_kernel",
    "_paged_attention_kernel",
    "_mla_decode_kernel",
    "_moe_gemm_kernel",
}
"""Long kernels: they let their dependents launch after their main loop, not at their start."""

LOADS_BEFORE_WAIT = {"_paged_attention_kernel", "_add_rms_norm_kernel", "_rms_norm_quant_kernel"}
"""Kernels that load, before the wait, what no kernel of the step writes: paged attention the
step's paging metadata (written before the forward starts, complete by the time a GEMM in front
lets it launch), the one-pass norms their weight. Loads only, no store."""


def test_off_on_the_cpu_and_when_disabled(monkeypatch):
    assert not pdl.use_pdl(torch.device("cpu"))
    assert pdl.launch_options(torch.device("cpu")) == {"PDL": False}
    monkeypatch.setattr(pdl, "PDL_ENABLED", False)
    assert not pdl.use_pdl(torch.device("cuda", 0))  # decided before any CUDA query
    monkeypatch.setattr(pdl, "PDL_ENABLED", True)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert not pdl.use_pdl(torch.device("cuda", 0))


@pytest.fixture(scope="module")
def ptx_report(run_compile_probe) -> dict:
    return run_compile_probe("pdl_ptx_probe.py")


def test_every_pdl_kernel_was_compiled(ptx_report):
    assert set(ptx_report) == PDL_KERNELS | {
        "_fp8_decode_kernel+early",
        "_skinny_gemm_kernel+early",
    }


@pytest.mark.parametrize("kernel", sorted(PDL_KERNELS))
def test_ptx_waits_before_any_memory_access(ptx_report, kernel):
    where = ptx_report[kernel]
    assert where["launch_pdl"] and where["pdl_constexpr"]
    assert where["memory_ops"] > 0
    if kernel in LOADS_BEFORE_WAIT:
        assert where["wait"] >= 0 and where["loads_before_wait"] > 0, where
        assert where["others_before_wait"] == 0, where
    else:
        assert 0 <= where["wait"] < where["first_memory_op"], where
    if kernel in LATE_RELEASE:
        assert where["launch_dependents"] > where["first_memory_op"], where
    else:
        assert 0 <= where["launch_dependents"] < where["wait"], where


@pytest.mark.parametrize("kernel", ["_fp8_decode_kernel", "_skinny_gemm_kernel"])
def test_gemv_last_waves_signal_right_after_the_wait(ptx_report, kernel):
    """With EARLY_RELEASE (pdl.pdl_release_early) a GEMV signals twice: right after its wait
    (the last waves' programs, a runtime condition) and after its loop (the others); nothing
    touches memory before the wait. Without it (the CPU launches of the report above), once,
    after the loop."""
    where = ptx_report[f"{kernel}+early"]
    first_access = where["first_memory_op_after_wait"]
    assert 0 <= where["wait"] < where["launch_dependents"] < first_access, where
    assert where["last_launch_dependents"] > first_access, where
    assert where["releases"] == 2 and ptx_report[kernel]["releases"] == 1
    assert where["loads_before_wait"] == 0 and where["others_before_wait"] == 0, where


def test_early_release_rule(monkeypatch):
    """pdl.early_release_from: the last `per_sm` programs per SM signal the next kernel as they
    start (all of a grid of fewer programs; none off the GPU or at 0). The FP8 decode GEMV runs
    it and the bf16 skinny GEMM at 2 a SM (measured: RESULTS.md)."""
    from v1_engine.kernels import triton_gemv
    from v1_engine.kernels import triton_gemv_fp8_decode as decode

    monkeypatch.setattr(pdl, "target_programs", lambda device, per_sm: 132 * per_sm)
    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    assert decode.EARLY_RELEASE_PER_SM == 2 and triton_gemv.EARLY_RELEASE_PER_SM == 2
    assert pdl.early_release_from(1792, cuda, 2) == 1792 - 264
    assert pdl.early_release_from(200, cuda, 2) == 0
    assert pdl.early_release_from(1792, cpu, 2) == 1792
    assert pdl.early_release_from(1792, cuda, 1) == 1792 - 132
    assert pdl.early_release_from(1792, cuda, 0) == 1792


def _skip_without_pdl() -> None:
    if not pdl.use_pdl(torch.device("cuda")):
        pytest.skip("PDL is off here (V1ENGINE_PDL=0, a GPU before sm_90 or an older Triton)")


@pytest.mark.gpu
def test_chain_in_a_cuda_graph_reads_fresh_values():
    """add+RMSNorm -> GEMM -> SiLU-and-mul -> GEMM -> add+RMSNorm, replayed with new inputs:
    each kernel starts early under PDL, so a missing or misplaced wait would read the previous
    replay's (or uninitialised) intermediates."""
    from v1_engine.kernels import triton_fused, triton_gemv

    _skip_without_pdl()
    gen = torch.Generator(device="cuda").manual_seed(0)
    hidden, inter = 4096, 14336

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, device="cuda", generator=gen) * scale).to(torch.bfloat16)

    w_gate_up = rand(2 * inter, hidden, scale=hidden**-0.5)
    w_down = rand(hidden, inter, scale=inter**-0.5)
    norm_w = rand(hidden) + 1
    x = rand(1, hidden)
    residual = rand(1, hidden)

    def chain():
        h, res = triton_fused.add_rms_norm(x, residual, norm_w, 1e-6)
        up = triton_gemv.skinny_gemm(h, w_gate_up)
        act = triton_fused.silu_and_mul(up)
        down = triton_gemv.skinny_gemm(act, w_down)
        return triton_fused.add_rms_norm(down, res, norm_w, 1e-6)

    def reference():
        s = (x.float() + residual.float()).to(torch.bfloat16)
        h = (s.float() * torch.rsqrt(s.float().pow(2).mean(-1, keepdim=True) + 1e-6)).to(
            torch.bfloat16
        ) * norm_w
        up = (h.float() @ w_gate_up.float().T).to(torch.bfloat16)
        gate, lin = up.float().chunk(2, dim=-1)
        act = (torch.nn.functional.silu(gate).to(torch.bfloat16).float() * lin).to(torch.bfloat16)
        down = (act.float() @ w_down.float().T).to(torch.bfloat16)
        s2 = (down.float() + s.float()).to(torch.bfloat16)
        out = (s2.float() * torch.rsqrt(s2.float().pow(2).mean(-1, keepdim=True) + 1e-6)).to(
            torch.bfloat16
        ) * norm_w
        return out, s2

    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        chain()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, res_out = chain()
    for _ in range(20):
        x.copy_(rand(1, hidden))
        residual.copy_(rand(1, hidden))
        graph.replay()
        want, want_res = reference()
        torch.testing.assert_close(res_out.float(), want_res.float(), rtol=2e-2, atol=2e-2)
        torch.testing.assert_close(out.float(), want.float(), rtol=3e-2, atol=3e-2)


@pytest.mark.gpu
def test_fp8_chain_with_cutlass_gemms_in_a_cuda_graph_reads_fresh_values():
    """Per-token quant (Triton) -> CUTLASS scaled_mm -> quant -> CUTLASS scaled_mm at M = 1, all
    launched with PDL, replayed with new inputs: each GEMM must see this replay's quantized
    activations and scales, checked against the PyTorch reference on the same quantized values."""
    from v1_engine.kernels import fp8

    _skip_without_pdl()
    gen = torch.Generator(device="cuda").manual_seed(1)
    n = k = 4096

    def weight():
        w = torch.randn(n, k, device="cuda", generator=gen) * k**-0.5
        scale = w.abs().amax(dim=1, keepdim=True) / 448.0
        return (w / scale).to(torch.float8_e4m3fn), scale.float()

    (w1, s1), (w2, s2) = weight(), weight()
    x = torch.randn(1, k, device="cuda", generator=gen).to(torch.bfloat16)
    seen = {}

    def chain():
        q1, a1 = fp8.per_token_fp8_quant(x)
        h = fp8.scaled_mm(q1, w1, a1, s1, torch.bfloat16)
        q2, a2 = fp8.per_token_fp8_quant(h)
        seen.update(q1=q1, a1=a1, h=h, q2=q2, a2=a2)
        return fp8.scaled_mm(q2, w2, a2, s2, torch.bfloat16)

    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        chain()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = chain()
    for _ in range(20):
        x.copy_(torch.randn(1, k, device="cuda", generator=gen))
        graph.replay()
        _, want_a1 = fp8.per_token_fp8_quant_ref(x)
        torch.testing.assert_close(seen["a1"], want_a1, rtol=1e-5, atol=0)
        want_h = fp8.scaled_mm_ref(seen["q1"], w1, seen["a1"], s1, torch.bfloat16)
        torch.testing.assert_close(seen["h"].float(), want_h.float(), rtol=1e-2, atol=1e-2)
        _, want_a2 = fp8.per_token_fp8_quant_ref(seen["h"])
        torch.testing.assert_close(seen["a2"], want_a2, rtol=1e-5, atol=0)
        want = fp8.scaled_mm_ref(seen["q2"], w2, seen["a2"], s2, torch.bfloat16)
        torch.testing.assert_close(out.float(), want.float(), rtol=1e-2, atol=1e-2)
