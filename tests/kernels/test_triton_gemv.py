"""The skinny Triton GEMM (kernels/triton_gemv.py) and the `v1_engine::skinny_linear` op against
torch matmuls: under the interpreter on CPU (tiny shapes, every body, masks, strides, bias), on
the device with CUDA (the Llama-3-8B linear shapes, CUDA graphs, torch.compile)."""

from __future__ import annotations

import functools
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from v1_engine.kernels import semaphores, skinny_launch
from v1_engine.layers.quantization.base import UnquantizedLinearMethod

_CUDA = torch.cuda.is_available()
# On the CPU the kernel runs under Triton's interpreter, which tests/conftest.py turns on
# before any kernel module is imported.
triton_gemv = pytest.importorskip("v1_engine.kernels.triton_gemv")
skinny_linear_op = pytest.importorskip("v1_engine.kernels.skinny_linear_op")
interpreter_only = pytest.mark.skipif(_CUDA, reason="the gpu cases cover this on a CUDA machine")

BF16_ULP = 2.0**-7
"""Relative spacing of bf16 values; the interpreter truncates float32 -> bf16 (the device rounds
to nearest), so a result may sit one spacing from the float32 reference."""

LLAMA3_8B_SHAPES = {  # name: (N, K)
    "qkv": (6144, 4096),
    "o_proj": (4096, 4096),
    "gate_up": (28672, 4096),
    "down": (4096, 14336),
}


def values(shape: tuple[int, ...], dtype: torch.dtype, seed: int, device="cpu") -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=gen).to(dtype).to(device)


def strided_rows(m: int, k: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """x [m, k] whose rows sit k + 24 elements apart (a slice of a wider buffer)."""
    x = values((m, k + 24), dtype, seed)[:, 5 : 5 + k]
    assert x.stride(0) == k + 24 and x.stride(1) == 1
    return x


def reference(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """float32 x @ w^T + bias of the (possibly 16-bit) operands."""
    out = x.double() @ w.double().T
    if bias is not None:
        out += bias.double()
    return out.float()


def mode_and_m(*dot_ms: int) -> list[tuple[str, int]]:
    """(mode, M) cases: `dot_ms` for the tensor-core bodies, the M <= FMA_MAX_M ones for fma."""
    return [
        (mode, m)
        for mode in skinny_launch.MODES
        for m in dot_ms
        if mode != "fma" or m <= skinny_launch.FMA_MAX_M
    ]


def assert_matches(out: torch.Tensor, ref: torch.Tensor, k: int) -> None:
    if out.dtype == torch.float32:
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5 * k**0.5)
        return
    # One 16-bit rounding of a float32 sum (plus the float32 sum's own few-ulp error).
    scale = ref.abs().amax().item()
    torch.testing.assert_close(out.float(), ref, rtol=BF16_ULP, atol=BF16_ULP * scale / 64)


# ---- interpreter (CPU) -----------------------------------------------------------------------


@interpreter_only
@pytest.mark.parametrize(("mode", "m"), mode_and_m(1, 3, 16, 24, 64))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("with_bias", [False, True])
def test_kernel_matches_reference_interpreted(mode, m, dtype, with_bias):
    # N = 40 is not a multiple of BLOCK_N (16, or 8 for fma) and K = 80 not one of BLOCK_K = 32:
    # both edges are masked; x's rows are strided. M = 24 fills 24 of BLOCK_M = 32 rows, M = 64
    # all of the largest bucket's.
    n, k = 40, 80
    x = strided_rows(m, k, dtype, 1)
    w = values((n, k), dtype, 2)
    bias = values((n,), dtype, 3) if with_bias else None
    block_n = 8 if mode == "fma" else 16
    out = triton_gemv.skinny_gemm(
        x, w, bias, mode=mode, block_n=block_n, block_k=32, num_warps=4, num_stages=2
    )
    assert out.shape == (m, n) and out.dtype == dtype
    assert_matches(out, reference(x, w, bias), k)


@interpreter_only
@pytest.mark.parametrize(("mode", "m"), mode_and_m(1, 3, 64))
@pytest.mark.parametrize("split", [2, 3])
def test_split_k_matches_reference_and_resets_its_semaphores_interpreted(mode, m, split):
    """K = 200 is 7 steps of 32: split 2 gives slices of 4 + 3 steps, split 3 slices of 3 + 3 +
    1 (the last masked). The last program of each tile sums the partials and resets its
    semaphore, so a second launch (other operands, same tiles) is right too."""
    n, k = 40, 200
    block_n = 8 if mode == "fma" else 16
    launch = {"mode": mode, "block_n": block_n, "block_k": 32, "num_warps": 4, "num_stages": 2}
    for seed in (1, 4):
        x = strided_rows(m, k, torch.float32, seed)
        w, bias = values((n, k), torch.float32, seed + 1), values((n,), torch.float32, seed + 2)
        out = triton_gemv.skinny_gemm(x, w, bias, split_k=split, **launch)
        assert_matches(out, reference(x, w, bias), k)
        # Deterministic: the partials are summed in slice order, whichever program is last.
        assert torch.equal(out, triton_gemv.skinny_gemm(x, w, bias, split_k=split, **launch))
        assert not semaphores._SEMAPHORES[x.device].any()
    assert skinny_launch.k_per_split(k, launch | {"split_k": split}) == (128 if split == 2 else 96)


def test_every_table_entry_is_a_valid_launch():
    """Each measured entry of TUNED_LAUNCH (kernels/skinny_tuned.py) resolves at its shape: a
    known body, tiles the body takes, a split that leaves no slice of K empty."""
    entries = 0
    for (m, n, k), launch in skinny_launch.TUNED_LAUNCH.items():
        assert skinny_launch.m_bucket(m) == m, (m, n, k)
        if launch is not None:
            assert skinny_launch.resolve_launch(m, n, k, {}) == {"split_k": 1} | launch
            entries += 1
    assert entries > 0


def test_outgrown_semaphores_stay_alive(monkeypatch):
    """A launch with more tiles than the semaphore buffer holds gets a larger one; the old buffer
    stays referenced, since CUDA graphs captured before may still point at it."""
    monkeypatch.setattr(semaphores, "_SEMAPHORES", {})
    monkeypatch.setattr(semaphores, "_OUTGROWN", [])
    device = torch.device("cpu")
    first = semaphores.split_semaphores(device, 10)
    assert first.numel() == 4096 and not first.any()
    assert semaphores.split_semaphores(device, 4096) is first
    second = semaphores.split_semaphores(device, 5000)
    assert second.numel() == 5000 and semaphores.split_semaphores(device, 1) is second
    assert len(semaphores._OUTGROWN) == 1 and semaphores._OUTGROWN[0] is first


def test_split_k_compiles_for_sm90(run_compile_probe):
    """The split launches compile for the GPU (the interpreter accepts more): without spills, the
    slice's arrival an acq_rel atomic after a barrier over the program's partial stores, the
    semaphore reset by an exchange, the partials read past L1; an unsplit launch has none of it."""
    cases = run_compile_probe("skinny_split_probe.py")
    for name, info in cases.items():
        split = info["split"] > 1
        assert info["stack"] == 0, (name, info)
        assert (info["acq_rel_adds"], info["exchanges"]) == ((1, 1) if split else (0, 0)), name
        assert info["barrier_before_atomic"] == split, name
        assert (info["reads_past_l1"] > 0) == split, name


@interpreter_only
def test_default_launch_masks_a_short_k_interpreted():
    # The default config (BLOCK_K 256) over K = 72: one masked step; fp16, M in the 8 bucket.
    x, w, bias = values((5, 72), torch.float16, 4), values((24, 72), torch.float16, 5), None
    assert skinny_launch.launch_config(5, 24, 72)["block_k"] == 256
    assert_matches(triton_gemv.skinny_gemm(x, w, bias), reference(x, w, bias), 72)


@interpreter_only
def test_cuda_body_runs_the_kernel_up_to_max_m_interpreted(monkeypatch):
    """The op's CUDA body on CPU tensors (the interpreter runs the kernel): M = SKINNY_MAX_M of a
    measured shape goes to the kernel; unmeasured shapes, M = SKINNY_MAX_M + 1 (even with an
    entry for its bucket), float32 operands and shapes the table marks for F.linear go to
    F.linear."""
    calls = []
    kernel = triton_gemv.skinny_gemm
    monkeypatch.setattr(
        skinny_linear_op, "skinny_gemm", lambda *args, **kw: calls.append(1) or kernel(*args, **kw)
    )
    max_m = skinny_launch.SKINNY_MAX_M
    w, bias = values((24, 64), torch.bfloat16, 6), values((24,), torch.bfloat16, 7)
    x = values((max_m, 64), torch.bfloat16, 8)
    unmeasured = skinny_linear_op.skinny_linear_cuda(x, w, bias)  # no table entry: F.linear
    assert calls == [] and torch.equal(unmeasured, F.linear(x, w, bias))
    tuned = {"mode": "dot_swap", "block_n": 16, "block_k": 32, "num_warps": 4, "num_stages": 2}
    monkeypatch.setitem(skinny_launch.TUNED_LAUNCH, (skinny_launch.m_bucket(max_m), 24, 64), tuned)
    out = skinny_linear_op.skinny_linear_cuda(x, w, bias)
    assert calls == [1]
    assert_matches(out, reference(x, w, bias), 64)

    monkeypatch.setitem(
        skinny_launch.TUNED_LAUNCH, (skinny_launch.m_bucket(max_m + 1), 24, 64), tuned
    )
    monkeypatch.setitem(skinny_launch.TUNED_LAUNCH, (2, 24, 64), None)  # measured: F.linear
    for x in (
        values((max_m + 1, 64), torch.bfloat16, 9),
        values((3, 64), torch.float32, 10),
        values((2, 64), torch.bfloat16, 11),
    ):
        w_x, bias_x = w.to(x.dtype), bias.to(x.dtype)
        out = skinny_linear_op.skinny_linear_cuda(x, w_x, bias_x)
        assert calls == [1]
        assert torch.equal(out, F.linear(x, w_x, bias_x))


# ---- dispatch rules, launch table, tracing (no kernel runs) ---------------------------------


def test_fits_skinny_rules():
    w = values((32, 64), torch.bfloat16, 1)
    x = values((4, 64), torch.bfloat16, 2)
    fits = skinny_linear_op.fits_skinny
    assert fits(x, w, None) and fits(x, w, values((32,), torch.bfloat16, 3))
    max_m = skinny_launch.SKINNY_MAX_M
    assert fits(values((max_m, 64), torch.float16, 4), w.half(), None)
    assert not fits(values((max_m + 1, 64), torch.bfloat16, 4), w, None)  # M > SKINNY_MAX_M
    assert not fits(x[:0], w, None)  # no rows
    assert not fits(x.float(), w.float(), None)  # float32 stays on F.linear
    assert not fits(x, w.half(), None)  # mixed dtypes
    assert not fits(x, w.T.contiguous().T, None)  # K not contiguous in the weight
    assert not fits(values((4, 60), torch.bfloat16, 5), values((32, 60), torch.bfloat16, 6), None)
    assert not fits(values((4, 70), torch.bfloat16, 7)[:, 1:65], w, None)  # misaligned rows
    assert not fits(x, w, values((32,), torch.float32, 8))  # bias dtype
    assert not fits(x, w, values((64,), torch.bfloat16, 9)[::2])  # strided bias


def test_launch_table_and_overrides(monkeypatch):
    buckets = [skinny_launch.m_bucket(m) for m in (1, 2, 3, 5, 8, 9, 16, 17, 33, 64)]
    assert buckets == [1, 2, 4, 8, 8, 16, 16, 32, 64, 64]
    tuned = {"mode": "dot_swap", "block_n": 32, "block_k": 128, "num_warps": 8, "num_stages": 5}
    monkeypatch.setitem(skinny_launch.TUNED_LAUNCH, (4, 1024, 1024), tuned)
    # M = 3 is in the 4 bucket; an entry without split_k is not split.
    assert skinny_launch.launch_config(3, 1024, 1024) == tuned | {"split_k": 1}
    assert skinny_launch.launch_config(5, 1024, 1024) == skinny_launch.default_launch(5, 1024, 1024)
    resolved = skinny_launch.resolve_launch(3, 1024, 1024, {"num_stages": 2})
    assert resolved == tuned | {"num_stages": 2, "split_k": 1}
    assert skinny_launch.resolve_launch(3, 1024, 1024, {"split_k": 8})["split_k"] == 8
    for bad in (
        {"block_m": 16},
        {"mode": "split_k"},
        {"block_n": 8},  # below the dot's 16
        {"block_k": 48},
        {"num_warps": 3},
        {"num_stages": 0},
        {"split_k": 0},
        {"split_k": 9},  # K = 1024 is 8 steps of block_k 128
        {"split_k": 7},  # 2 steps a slice fill only 4 slices: the rest would be empty
    ):
        with pytest.raises(ValueError, match=next(iter(bad)) if "block_m" not in bad else "key"):
            skinny_launch.resolve_launch(3, 1024, 1024, bad)
    assert skinny_launch.resolve_launch(1, 64, 64, {"mode": "fma", "block_n": 4})["block_n"] == 4
    fma_max_m = skinny_launch.FMA_MAX_M
    assert skinny_launch.resolve_launch(fma_max_m, 64, 64, {"mode": "fma"})["mode"] == "fma"
    with pytest.raises(
        ValueError, match=f"'fma' needs M in 1..{fma_max_m}, got M = {fma_max_m + 1}"
    ):
        skinny_launch.resolve_launch(fma_max_m + 1, 64, 64, {"mode": "fma", "block_n": 4})
    assert skinny_launch.prefers_skinny(3, 1024, 1024)  # the 4 bucket holds a config
    assert not skinny_launch.prefers_skinny(1, 64, 64)  # unmeasured: F.linear
    monkeypatch.setitem(skinny_launch.TUNED_LAUNCH, (16, 1024, 1024), None)  # F.linear faster
    assert not skinny_launch.prefers_skinny(9, 1024, 1024)
    assert skinny_launch.launch_config(9, 1024, 1024) == skinny_launch.default_launch(9, 1024, 1024)


def test_op_traces_with_unbacked_token_count():
    """Under torch.compile the op is one node and the row count stays unbacked: its fake
    implementation gives the [M, N] output without branching on M."""
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return torch._dynamo.backends.debugging.aot_eager(gm, example_inputs)

    def fn(x, w, b):
        return skinny_linear_op.skinny_linear(x, w, b) * 2

    torch._dynamo.reset()
    compiled = torch.compile(fn, backend=backend, fullgraph=True)
    w, b = values((24, 32), torch.bfloat16, 1), values((24,), torch.bfloat16, 2)
    for m in (3, 20):
        x = values((m, 32), torch.bfloat16, m)
        torch._dynamo.decorators.mark_unbacked(x, 0)
        assert torch.equal(compiled(x, w, b), F.linear(x, w, b) * 2)
    assert len(graphs) == 1  # one graph for every token count
    targets = [str(node.target) for node in graphs[0].graph.nodes if node.op == "call_function"]
    assert any(target.startswith("v1_engine.skinny_linear") for target in targets), targets


def test_op_keeps_leading_dims():
    x, w = values((2, 3, 32), torch.bfloat16, 1), values((24, 32), torch.bfloat16, 2)
    out = skinny_linear_op.skinny_linear(x, w)
    assert out.shape == (2, 3, 24) and torch.equal(out, F.linear(x, w))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_unquantized_apply_on_cpu_is_f_linear(dtype):
    layer = SimpleNamespace(weight=values((24, 32), dtype, 1))
    x, bias = values((3, 32), dtype, 2), values((24,), dtype, 3)
    out = UnquantizedLinearMethod().apply(layer, x, bias)
    assert torch.equal(out, F.linear(x, layer.weight, bias))


# ---- device ----------------------------------------------------------------------------------


@functools.cache
def llama3_weight(name: str) -> torch.Tensor:
    """One random weight per shape, made once (the largest is 117M values)."""
    n, k = LLAMA3_8B_SHAPES[name]
    return torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02


@pytest.mark.gpu
@pytest.mark.parametrize("name", sorted(LLAMA3_8B_SHAPES))
@pytest.mark.parametrize("m", [1, 2, 4, 8, 16, 32, 64])
def test_llama3_shapes_match_torch_mm_gpu(name, m):
    # Through the op: the kernel where TUNED_LAUNCH holds the shape's M bucket, else F.linear.
    k = LLAMA3_8B_SHAPES[name][1]
    w = llama3_weight(name)
    x = values((m, k), torch.bfloat16, 2, "cuda")
    out = skinny_linear_op.skinny_linear(x, w)
    ref = reference(x, w, None)
    assert_matches(out, ref, k)
    # As close to the float32 result as cuBLAS's own bf16 output is, give or take a rounding.
    cublas_err = (torch.mm(x, w.T).float() - ref).abs().amax()
    assert (out.float() - ref).abs().amax() <= 2 * cublas_err + 1e-3


@pytest.mark.gpu
@pytest.mark.parametrize(("mode", "m"), mode_and_m(1, 3, 5, 16, 32, 64))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_every_mode_on_device_gpu(mode, m, dtype):
    n, k = 1000, 4104  # ragged N and K: masked edges on the device too
    x = strided_rows(m, k, dtype, 3).cuda()
    w = (values((n, k), dtype, 4) * 0.02).cuda()
    bias = values((n,), dtype, 5).cuda()
    launch = {"mode": mode, "block_n": 16 if mode == "fma" else 32, "block_k": 128}
    out = triton_gemv.skinny_gemm(x, w, bias, num_warps=4, num_stages=3, **launch)
    assert_matches(out, reference(x, w, bias), k)


@pytest.mark.gpu
@pytest.mark.parametrize(("mode", "m"), [("dot", 64), ("dot_swap", 32), ("dot_swap", 1)])
@pytest.mark.parametrize("split", [2, 4, 7])
def test_split_k_on_device_gpu(mode, m, split):
    """Split launches on the device, where the slices' programs really race to the semaphore:
    the result, its determinism over repeated launches, and the semaphores left at zero."""
    n, k = 4096, 14336  # Llama-3-8B down_proj
    x = strided_rows(m, k, torch.bfloat16, 6).cuda()
    w = (values((n, k), torch.bfloat16, 7) * 0.02).cuda()
    launch = {"mode": mode, "block_n": 64, "block_k": 128, "num_warps": 4, "num_stages": 3}
    out = triton_gemv.skinny_gemm(x, w, split_k=split, **launch)
    assert_matches(out, reference(x, w, None), k)
    for _ in range(3):
        assert torch.equal(triton_gemv.skinny_gemm(x, w, split_k=split, **launch), out)
    assert not semaphores._SEMAPHORES[x.device].any()


@pytest.mark.gpu
@pytest.mark.parametrize(("m", "split"), [(1, 1), (64, 2)])
def test_early_release_leaves_results_unchanged_gpu(m, split, monkeypatch):
    """The last waves' early signal (EARLY_RELEASE_PER_SM) changes when the next kernel's
    programs start, not what this one computes: bit-identical to the launch without it, eager
    and in a CUDA graph of two GEMMs in a row (the second reads the first's output)."""
    n, k = LLAMA3_8B_SHAPES["o_proj"]
    w = values((n, k), torch.bfloat16, 1, "cuda") * 0.02
    x = values((m, k), torch.bfloat16, 3, "cuda")
    launch = {"mode": "fma" if m == 1 else "dot", "block_n": 8 if m == 1 else 64}
    launch |= {"block_k": 256, "num_warps": 4, "num_stages": 3, "split_k": split}

    def run():
        return triton_gemv.skinny_gemm(triton_gemv.skinny_gemm(x, w, **launch), w, **launch)

    monkeypatch.setattr(triton_gemv, "EARLY_RELEASE_PER_SM", 0)
    base = run()
    monkeypatch.setattr(triton_gemv, "EARLY_RELEASE_PER_SM", 2)
    assert torch.equal(run(), base)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, base)


@pytest.mark.gpu
def test_cuda_graph_replay_gpu():
    n, k = LLAMA3_8B_SHAPES["o_proj"]
    w = values((n, k), torch.bfloat16, 1, "cuda") * 0.02
    bias = values((n,), torch.bfloat16, 2, "cuda")
    x = values((4, k), torch.bfloat16, 3, "cuda")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        skinny_linear_op.skinny_linear(x, w, bias)  # compile outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = skinny_linear_op.skinny_linear(x, w, bias)
    for seed in (4, 5):
        x.copy_(values((4, k), torch.bfloat16, seed, "cuda"))
        graph.replay()
        torch.cuda.synchronize()
        assert_matches(out, reference(x, w, bias), k)


@pytest.mark.gpu
def test_apply_under_compile_gpu():
    """The unquantized linear method compiled with an unbacked token count: skinny kernel for
    small M, F.linear beyond SKINNY_MAX_M; one graph for all."""
    layer = SimpleNamespace(weight=values((6144, 4096), torch.bfloat16, 1, "cuda") * 0.02)
    method = UnquantizedLinearMethod()
    torch._dynamo.reset()
    compiled = torch.compile(lambda x: method.apply(layer, x, None), fullgraph=True)
    for m in (1, 7, skinny_launch.SKINNY_MAX_M + 1):
        x = values((m, 4096), torch.bfloat16, m, "cuda")
        torch._dynamo.decorators.mark_unbacked(x, 0)
        assert_matches(compiled(x), reference(x, layer.weight, None), 4096)
