"""The skinny GEMM with its epilogues (kernels/skinny_epilogues.py): the gated GEMM (SiLU-and-mul
of a gate_up projection) and the GEMM whose last column tile runs the residual add + RMSNorm,
against the unfused ops: under the interpreter on CPU (tiny shapes, every body, masked edges,
split-K, the semaphores), on the device with CUDA (the Llama-3-8B shapes, CUDA graphs)."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F

from compile.passes.fused_ops import fused_add_rms_norm_ref, silu_and_mul_ref
from v1_engine.kernels import semaphores, skinny_launch

_CUDA = torch.cuda.is_available()
# On the CPU the kernels run under Triton's interpreter, which tests/conftest.py turns on
# before any kernel module is imported.
triton_gemv = pytest.importorskip("v1_engine.kernels.triton_gemv")
skinny_linear_op = pytest.importorskip("v1_engine.kernels.skinny_linear_op")
epilogues = pytest.importorskip("v1_engine.kernels.skinny_epilogues")
interpreter_only = pytest.mark.skipif(_CUDA, reason="the gpu cases cover this on a CUDA machine")

BF16_ULP = 2.0**-7


def values(shape: tuple[int, ...], dtype: torch.dtype, seed: int, device="cpu") -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=gen).to(dtype).to(device)


def modes(*dot_ms: int) -> list[tuple[str, int]]:
    return [
        (mode, m)
        for mode in skinny_launch.MODES
        for m in dot_ms
        if mode != "fma" or m <= skinny_launch.FMA_MAX_M
    ]


def assert_within_ulps(out: torch.Tensor, ref: torch.Tensor, ulps: float = 2.0) -> None:
    """out within `ulps` bf16 spacings of ref, relative to each value (and to the row's scale
    near zero, where SiLU's and the GEMM's own roundings dominate)."""
    scale = ref.float().abs().amax().item()
    torch.testing.assert_close(
        out.float(), ref.float(), rtol=ulps * BF16_ULP, atol=ulps * BF16_ULP * scale / 16
    )


def _no_semaphore_left(device: torch.device) -> bool:
    """Every semaphore buffer of the device's kind is zero (none exists where no launch of this
    process split its work, as in a pytest-xdist worker that ran only unsplit shapes)."""
    buffers = [b for d, b in semaphores._SEMAPHORES.items() if d.type == device.type]
    return not any(b.any() for b in buffers)


# ---- interpreter (CPU) -----------------------------------------------------------------------


@interpreter_only
@pytest.mark.parametrize(("mode", "m"), modes(1, 3, 16))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gated_matches_unfused_interpreted(mode, m, dtype):
    """I = 20 outputs: not a multiple of BLOCK_N (8 for the gated tiles here), K = 80 not one
    of BLOCK_K = 32; x's rows strided. In float32 the gated kernel matches the GEMM of the same
    tiles followed by SiLU-and-mul to a few float32 ulps (exp's and the division's own); in
    bf16 the interpreter's GEMM store truncates where the kernel's epilogue rounds to nearest
    (as the device does), so there they are bf16 ulps apart."""
    i, k = 20, 80
    x = values((m, k + 8), dtype, 1)[:, 3 : 3 + k]
    w = values((2 * i, k), dtype, 2)
    launch = {"mode": mode, "block_n": 8 if mode == "fma" else 16, "block_k": 32}
    launch |= {"num_warps": 4, "num_stages": 2}
    out = epilogues.skinny_gemm_silu_mul(x, w, **launch)
    assert out.shape == (m, i) and out.dtype == dtype
    gate_up = torch.cat(
        [triton_gemv.skinny_gemm(x, w[:i], **launch), triton_gemv.skinny_gemm(x, w[i:], **launch)],
        dim=1,
    )
    if dtype == torch.float32:
        torch.testing.assert_close(out, silu_and_mul_ref(gate_up), rtol=4e-7, atol=1e-6)
    else:
        assert_within_ulps(out, silu_and_mul_ref(gate_up), ulps=4.0)
    exact = silu_and_mul_ref((x.double() @ w.double().T).to(dtype))
    assert_within_ulps(out, exact)


@interpreter_only
@pytest.mark.parametrize(("mode", "m"), modes(1, 3, 4))
@pytest.mark.parametrize("split", [1, 3])
def test_add_norm_epilogue_matches_unfused_interpreted(mode, m, split):
    """N = 40 in column tiles of 8 / 16 (the last masked), K = 200 split 1 or 3 ways: the last
    tile to finish adds the residual and normalises every row; equal to the GEMM then
    add + RMSNorm up to the order of the sum of squares, and the semaphores (the tiles' and the
    rows' counter) are zero again after each launch."""
    n, k, eps = 40, 200, 1e-5
    launch = {"mode": mode, "block_n": 8 if mode == "fma" else 16, "block_k": 32}
    launch |= {"num_warps": 4, "num_stages": 2, "split_k": split}
    for seed in (1, 5):
        x = values((m, k), torch.bfloat16, seed)
        w = values((n, k), torch.bfloat16, seed + 1)
        residual = values((m, n + 6), torch.bfloat16, seed + 2)[:, 2 : 2 + n]  # strided rows
        norm_w = values((n,), torch.bfloat16, seed + 3)
        normed, summed = epilogues.skinny_gemm_add_rms_norm(x, w, residual, norm_w, eps, **launch)
        y = triton_gemv.skinny_gemm(x, w, **launch)
        ref_normed, ref_summed = fused_add_rms_norm_ref(y, residual, norm_w, eps)
        assert torch.equal(summed, ref_summed)
        assert_within_ulps(normed, ref_normed, ulps=1.0)
        assert _no_semaphore_left(x.device)


@interpreter_only
def test_gated_launch_rules():
    """The gated launch halves the gate_up entry's block_n (to the body's floor), never splits."""
    key = (1, 28672, 4096)
    entry = skinny_launch.TUNED_LAUNCH[key]
    config = epilogues.gated_launch(1, 28672, 4096, {})
    assert config["block_n"] == max(1 if entry["mode"] == "fma" else 16, entry["block_n"] // 2)
    assert config["mode"] == entry["mode"] and config["split_k"] == 1
    with pytest.raises(ValueError, match="split_k must be 1"):
        epilogues.gated_launch(16, 28672, 4096, {"split_k": 2})


@interpreter_only
def test_cuda_bodies_dispatch_interpreted(monkeypatch):
    """The ops' CUDA bodies on CPU tensors: a measured shape runs the fused kernel (in
    GATED_M_BUCKETS for the gated one, up to NORM_EPILOGUE_MAX_M rows for the norm); an
    unmeasured shape or other row counts run the unfused path, with the same result."""
    calls: list[str] = []
    for name in ("skinny_gemm_silu_mul", "skinny_gemm_add_rms_norm"):
        real = getattr(epilogues, name)
        monkeypatch.setattr(
            epilogues, name, lambda *a, _r=real, _n=name, **kw: calls.append(_n) or _r(*a, **kw)
        )
    tuned = {"mode": "dot_swap", "block_n": 16, "block_k": 32, "num_warps": 4, "num_stages": 2}
    n, k, eps = 24, 64, 1e-6
    w2, w = values((2 * n, k), torch.bfloat16, 1), values((n, k), torch.bfloat16, 2)
    norm_w = values((n,), torch.bfloat16, 3)
    max_m = epilogues.NORM_EPILOGUE_MAX_M
    for m in (1, max_m, max_m + 1):
        x, residual = values((m, k), torch.bfloat16, m), values((m, n), torch.bfloat16, m + 1)
        calls.clear()
        unmeasured = epilogues.silu_mul_linear_cuda(x, w2)
        assert calls == [] and torch.equal(unmeasured, silu_and_mul_ref(F.linear(x, w2)))
        bucket = skinny_launch.m_bucket(m)
        monkeypatch.setitem(skinny_launch.TUNED_LAUNCH, (bucket, 2 * n, k), tuned)
        monkeypatch.setitem(skinny_launch.TUNED_LAUNCH, (bucket, n, k), tuned)
        gated = epilogues.silu_mul_linear_cuda(x, w2)
        normed, summed = epilogues.linear_add_rms_norm_cuda(x, w, residual, norm_w, eps)
        fused_gate = ["skinny_gemm_silu_mul"] if bucket in epilogues.GATED_M_BUCKETS else []
        fused_norm = ["skinny_gemm_add_rms_norm"] if m <= max_m else []
        assert calls == fused_gate + fused_norm
        assert_within_ulps(gated, silu_and_mul_ref(F.linear(x, w2)))
        ref_normed, ref_summed = fused_add_rms_norm_ref(F.linear(x, w), residual, norm_w, eps)
        # 2 ulps: the interpreter's stores truncate the GEMM output where F.linear rounds it.
        assert_within_ulps(summed, ref_summed)
        assert_within_ulps(normed, ref_normed)


def folded_norm_ref(x, residual, norm_w, weight, eps, gated, operand_dtype=None):
    """(y, h) of the folded norm in float64 from the same operands (h rounded as the add);
    `operand_dtype`: h * norm_w rounded to it (from float32) as the tensor-core bodies take it,
    the row's rsqrt applied after the GEMM."""
    h = (x.float() + residual.float()).to(x.dtype)
    hd = h.double()
    rstd = torch.rsqrt(hd.pow(2).mean(-1, keepdim=True) + eps)
    if operand_dtype is None:
        y = ((hd * rstd * norm_w.double()) @ weight.double().t()).to(x.dtype)
    else:
        operand = (h.float() * norm_w.float()).to(operand_dtype).double()
        y = (rstd * (operand @ weight.double().t())).to(x.dtype)
    return (silu_and_mul_ref(y) if gated else y), h


@interpreter_only
@pytest.mark.parametrize(("mode", "m"), modes(1, 3, 17))
@pytest.mark.parametrize("gated", [False, True])
def test_folded_norm_matches_the_formula_interpreted(mode, m, gated):
    """The add + RMSNorm folded into the GEMM: the residual sum bit-identical to the add (written
    by program 0 alone), the output within 2 ulps of the folded formula in float64; N = 48 (24
    gated outputs) and K = 96 leave masked tiles; rows do not leak into each other (one loud
    row)."""
    n, k, eps = 48, 96, 1e-5
    x, residual = values((m, k), torch.bfloat16, m), values((m, k), torch.bfloat16, m + 7)
    x[m // 2] *= 40.0
    norm_w = (1.0 + 0.2 * values((k,), torch.float32, 3)).to(torch.bfloat16)
    weight = (0.1 * values((n, k), torch.float32, 4)).to(torch.bfloat16)
    launch = {"mode": mode, "block_n": 16, "block_k": 32, "num_warps": 4, "num_stages": 2}
    out, h = epilogues.skinny_gemm_add_norm(x, residual, norm_w, eps, weight, gated, **launch)
    want, want_h = folded_norm_ref(x, residual, norm_w, weight, eps, gated)
    assert torch.equal(h, want_h)
    assert out.shape == (m, n // 2 if gated else n)
    assert_within_ulps(out, want)
    with pytest.raises(ValueError, match="split_k must be 1"):
        epilogues.skinny_gemm_add_norm(x, residual, norm_w, eps, weight, **launch, split_k=2)


@interpreter_only
def test_add_norm_linear_dispatch_interpreted(monkeypatch):
    """The op's CUDA body on CPU tensors: the add + RMSNorm kernel and the GEMM op outside
    NORM_IN_M_BUCKETS (empty until measured), without a measured launch or with a split one; the
    folded kernel with both, gated in the kernel where GATED_M_BUCKETS has M, else followed by
    the SiLU-and-mul kernel."""
    calls: list[bool] = []
    real = epilogues.skinny_gemm_add_norm
    monkeypatch.setattr(
        epilogues, "skinny_gemm_add_norm", lambda *a, **kw: calls.append(a[5]) or real(*a, **kw)
    )
    assert epilogues.NORM_IN_M_BUCKETS == () and epilogues.GATED_M_BUCKETS == (1,)
    n, k, eps = 24, 64, 1e-5
    norm_w = values((k,), torch.bfloat16, 3)
    w, w2 = values((n, k), torch.bfloat16, 4), values((2 * n, k), torch.bfloat16, 5)
    tuned = {"mode": "dot_swap", "block_n": 16, "block_k": 32, "num_warps": 4, "num_stages": 2}

    def check(m: int, folded: bool) -> None:
        x, residual = values((m, k), torch.bfloat16, m), values((m, k), torch.bfloat16, m + 1)
        normed, summed = fused_add_rms_norm_ref(x, residual, norm_w, eps)
        for weight, gated in ((w, False), (w2, True)):
            out, h = epilogues.add_norm_linear_cuda(x, residual, norm_w, eps, weight, gated)
            if folded:
                want = folded_norm_ref(x, residual, norm_w, weight, eps, gated)[0]
            else:
                chain = F.linear(normed, weight)
                want = silu_and_mul_ref(chain) if gated else chain
            assert_within_ulps(out, want)
            assert torch.equal(h, summed)

    check(1, folded=False)
    monkeypatch.setattr(epilogues, "NORM_IN_M_BUCKETS", (1, 2))
    check(1, folded=False)  # no measured launch
    assert calls == []
    for bucket, shape in itertools.product((1, 2), ((n, k), (2 * n, k))):
        monkeypatch.setitem(skinny_launch.TUNED_LAUNCH, (bucket, *shape), tuned)
    check(1, folded=True)
    assert calls == [False, True]  # the gated epilogue in the kernel at M = 1
    check(2, folded=True)
    assert calls == [False, True, False, False]  # at M = 2 the SiLU-and-mul kernel after it
    monkeypatch.setitem(skinny_launch.TUNED_LAUNCH, (2, n, k), tuned | {"split_k": 2})
    x, residual = values((2, k), torch.bfloat16, 8), values((2, k), torch.bfloat16, 9)
    epilogues.add_norm_linear_cuda(x, residual, norm_w, eps, w, False)  # split: the chain
    assert len(calls) == 4


def test_epilogues_compile_for_sm90(run_compile_probe):
    """The epilogue launches compile for the GPU (the interpreter accepts more) without spills.
    Gated and the folded norm (NORM_IN): no synchronization at all; the folded norm at M = 64
    holds the [64, 128] activation tile's float32 math in 209 registers. Add + norm: one acq_rel arrival after a barrier over the
    tile's stores, the counter reset by an exchange, the other tiles' outputs read past L1; a
    split launch has the tile semaphore's pair of atomics besides."""
    cases = run_compile_probe("skinny_epilogue_probe.py")
    assert len(cases) == 9
    for name, info in cases.items():
        assert info["stack"] == 0, (name, info)
        if info["norm_in"]:  # the folded norm: no synchronization either
            assert (info["acq_rel_adds"], info["exchanges"], info["reads_past_l1"]) == (0, 0, 0)
            assert info["registers"] <= (255 if name.endswith("m64_dot") else 128), (name, info)
            continue
        atomics = (0, 0) if info["gated"] else (1, 1)
        if info["split"] > 1:
            atomics = (atomics[0] + 1, atomics[1] + 1)
        assert (info["acq_rel_adds"], info["exchanges"]) == atomics, (name, info)
        assert info["barrier_before_atomic"] == info["add_norm"], name
        assert (info["reads_past_l1"] > 0) == info["add_norm"], name


# ---- device (CUDA) ---------------------------------------------------------------------------

LLAMA3_8B = {"gate_up": (28672, 4096), "o_proj": (4096, 4096), "down": (4096, 14336)}


def _unfused_silu(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    from v1_engine.kernels.triton_fused import silu_and_mul

    return silu_and_mul(skinny_linear_op.skinny_linear(x, w))


def _unfused_norm(x, w, residual, norm_w, eps):
    from v1_engine.kernels.triton_fused import add_rms_norm

    return add_rms_norm(skinny_linear_op.skinny_linear(x, w), residual, norm_w, eps)


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 2, 4, 8, 16, 64])
def test_gated_llama3_gate_up_gpu(m):
    """The gated kernel at the gate_up shape (with its derived launch at every M bucket, and
    through the op, which takes it only in GATED_M_BUCKETS), against the GEMM then SiLU-and-mul
    kernels: one bf16 rounding apart at most."""
    n2, k = LLAMA3_8B["gate_up"]
    w = values((n2, k), torch.bfloat16, 1, "cuda") * 0.02
    x = values((m, k), torch.bfloat16, 2, "cuda")
    ref = _unfused_silu(x, w)
    exact = silu_and_mul_ref((x.double() @ w.double().T).to(torch.bfloat16))
    for out in (
        epilogues.skinny_gemm_silu_mul(x, w),
        torch.ops.v1_engine.skinny_linear_silu_mul(x, w),
    ):
        assert out.shape == ref.shape
        assert_within_ulps(out, ref, ulps=1.0)
        assert_within_ulps(out, exact)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["o_proj", "down"])
@pytest.mark.parametrize("m", [1, 2, 3, 4, 8])
def test_add_norm_llama3_shapes_gpu(name, m):
    """o_proj / down_proj with the next add + RMSNorm, on the device where the tiles race to the
    counter: equal to the unfused kernels (the summed rows bit for bit), repeatable, and the
    semaphores zero after every launch."""
    n, k = LLAMA3_8B[name]
    w = values((n, k), torch.bfloat16, 3, "cuda") * 0.02
    x = values((m, k), torch.bfloat16, 4, "cuda")
    residual = values((m, n), torch.bfloat16, 5, "cuda")
    norm_w = values((n,), torch.bfloat16, 6, "cuda")
    normed, summed = torch.ops.v1_engine.skinny_linear_add_rms_norm(x, w, residual, norm_w, 1e-5)
    ref_normed, ref_summed = _unfused_norm(x, w, residual, norm_w, 1e-5)
    assert torch.equal(summed, ref_summed)
    assert_within_ulps(normed, ref_normed, ulps=1.0)
    for _ in range(3):
        again = torch.ops.v1_engine.skinny_linear_add_rms_norm(x, w, residual, norm_w, 1e-5)
        assert torch.equal(again[0], normed) and torch.equal(again[1], summed)
    assert _no_semaphore_left(x.device)


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("m", "shape", "gated"),
    [(1, "qkv", False), (1, "gate_up", True), (64, "gate_up", False), (64, "qkv", False)],
)
def test_folded_norm_llama3_shapes_gpu(m, shape, gated):
    """The folded norm at the launches the op would take (the bf16 table's, gated halved; qkv at
    M = 64, which has no entry, at the gate_up entry's tiles) on the Llama-3-8B shapes: the
    residual sum bit-identical to the add, the output within 2 ulps of the folded formula with
    the tensor-core bodies' one more rounding (h * w to bf16) modelled."""
    n, k = {"qkv": (6144, 4096), "gate_up": (28672, 4096)}[shape]
    x, residual = (
        values((m, k), torch.bfloat16, m, "cuda"),
        values((m, k), torch.bfloat16, 2, "cuda"),
    )
    norm_w = (1.0 + 0.2 * values((k,), torch.float32, 3, "cuda")).to(torch.bfloat16)
    weight = (0.02 * values((n, k), torch.float32, 4, "cuda")).to(torch.bfloat16)
    launch = {"split_k": 1}
    if not skinny_launch.TUNED_LAUNCH.get((m, n, k)):  # 64 x 256 x 4 stages needs 329 KB of smem
        launch |= {"mode": "dot", "block_n": 64, "block_k": 128, "num_stages": 3}
    out, h = epilogues.skinny_gemm_add_norm(x, residual, norm_w, 1e-5, weight, gated, **launch)
    resolve = epilogues.gated_launch if gated else skinny_launch.resolve_launch
    mode = resolve(m, n, k, launch)["mode"]
    operand = None if mode == "fma" else torch.bfloat16
    want, want_h = folded_norm_ref(x, residual, norm_w, weight, 1e-5, gated, operand)
    assert torch.equal(h, want_h)
    assert_within_ulps(out, want)


@pytest.mark.gpu
def test_epilogues_in_a_cuda_graph_gpu():
    """Both fused ops captured in one graph and replayed on new inputs."""
    n2, k = LLAMA3_8B["gate_up"]
    n, k_down = LLAMA3_8B["down"]
    w_gate_up = values((n2, k), torch.bfloat16, 1, "cuda") * 0.02
    w_down = values((n, k_down), torch.bfloat16, 2, "cuda") * 0.02
    norm_w = values((n,), torch.bfloat16, 3, "cuda")
    x = values((1, k), torch.bfloat16, 4, "cuda")
    residual = values((1, n), torch.bfloat16, 5, "cuda")

    def step():
        act = torch.ops.v1_engine.skinny_linear_silu_mul(x, w_gate_up)
        return torch.ops.v1_engine.skinny_linear_add_rms_norm(act, w_down, residual, norm_w, 1e-5)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()  # compile and allocate the semaphores outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        normed, summed = step()
    for seed in (6, 7):
        x.copy_(values((1, k), torch.bfloat16, seed, "cuda"))
        residual.copy_(values((1, n), torch.bfloat16, seed + 10, "cuda"))
        graph.replay()
        torch.cuda.synchronize()
        ref_normed, ref_summed = _unfused_norm(
            _unfused_silu(x, w_gate_up), w_down, residual, norm_w, 1e-5
        )
        assert_within_ulps(summed, ref_summed, ulps=2.0)
        assert_within_ulps(normed, ref_normed, ulps=2.0)
    assert _no_semaphore_left(x.device)
