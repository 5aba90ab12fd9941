"""The skinny FP8 GEMMs (kernels/triton_gemv_fp8.py) against the PyTorch references of fp8.py:
under the interpreter on CPU (tiny shapes, every body, scale granularities, bias, N/K tails,
split K), on the device with CUDA (the Llama-3-8B shapes against the references and CUTLASS, the
op's dispatch, a CUDA graph, torch.compile with an unbacked token count). The ops' dispatch on
the CPU and the launch rules: test_fp8_skinny_dispatch.py.

Kernel and reference see the same e4m3 operands and scales; the kernel's products are exact and
its sums float32, so the two differ by float32 summation order and one rounding to out_dtype.
"""

from __future__ import annotations

import functools

import pytest
import torch
from fp8_gemm_cases import (
    ULP,
    assert_matches,
    block_operands,
    block_quantize,
    channel_operands,
    launch_for,
    randn,
    strided_rows,
)

from v1_engine.kernels import fp8, semaphores, skinny_launch

_CUDA = torch.cuda.is_available()
# On the CPU the kernels run under Triton's interpreter, which tests/conftest.py turns on
# before any kernel module is imported.
skinny = pytest.importorskip("v1_engine.kernels.triton_gemv_fp8")
fp8_launch = pytest.importorskip("v1_engine.kernels.fp8_launch")
interpreter_only = pytest.mark.skipif(_CUDA, reason="the gpu cases cover this on a CUDA machine")

GRANULARITIES = ("tensor", "token", "mixed")
"""Scale layouts of the channel kind: per-tensor a and b; per-token a [M, 1] and per-channel b
[N, 1]; a static per-tensor a with a per-channel b."""

LLAMA3_8B_SHAPES = {  # name: (N, K)
    "qkv": (6144, 4096),
    "o_proj": (4096, 4096),
    "gate_up": (28672, 4096),
    "down": (4096, 14336),
}


def body_cases(kind: str, ms: list[int]) -> list[tuple[str, int]]:
    """(body, M) pairs of the `kind` kernel: every body at every M it takes (fma up to
    skinny_launch.FMA_MAX_M rows)."""
    return [
        (mode, m)
        for mode in fp8_launch.KIND_MODES[kind]
        for m in ms
        if mode != "fma" or m <= skinny_launch.FMA_MAX_M
    ]


# ---- interpreter (CPU) -----------------------------------------------------------------------


@interpreter_only
@pytest.mark.parametrize(("mode", "m"), body_cases("channel", [1, 3, 4, 16, 24, 64]))
@pytest.mark.parametrize("granularity", GRANULARITIES)
@pytest.mark.parametrize("with_bias", [False, True])
def test_channel_kernel_matches_reference_interpreted(mode, m, granularity, with_bias):
    # N = 40 is not a multiple of BLOCK_N (16, or 8 for fma) and K = 88 not one of BLOCK_K = 32:
    # both edges are masked; a's rows are strided. fp16 output with bias, bf16 without. M = 24
    # fills 24 of BLOCK_M = 32 rows, M = 64 all of the largest bucket's.
    n, k = 40, 88
    a, b, scale_a, scale_b = channel_operands(m, n, k, granularity, seed=m)
    a = strided_rows(a)
    out_dtype = torch.float16 if with_bias else torch.bfloat16
    bias = randn((n,), 7).to(out_dtype) if with_bias else None
    out = skinny.fp8_skinny_gemm(
        a, b, scale_a, scale_b, out_dtype, bias, **launch_for(mode, "channel")
    )
    assert_matches(out, fp8.scaled_mm_ref(a, b, scale_a, scale_b, out_dtype, bias))


@interpreter_only
@pytest.mark.parametrize(("mode", "m"), body_cases("block", [1, 3, 4, 16, 24, 64]))
@pytest.mark.parametrize(("n", "k"), [(200, 384), (200, 300)])
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16])
def test_block_kernel_matches_reference_interpreted(mode, m, n, k, out_dtype):
    # N = 200: the last 128-row weight block is partial (and BLOCK_N tiles 8 and 9 of 16 share
    # it); K = 300 ends in a partial scale group (the op on CUDA only takes whole groups); a's
    # rows are strided. Each row's scales differ per group, so a body that scaled a row with
    # another row's or group's scale would fail.
    a, b, scale_a, scale_b = block_operands(m, n, k, seed=m + k)
    a = strided_rows(a)
    launch = launch_for(mode, "block")
    out = skinny.fp8_block_skinny_gemm(a, b, scale_a, scale_b, out_dtype, **launch)
    assert_matches(out, fp8.block_scaled_mm_ref(a, b, scale_a, scale_b, out_dtype))


@interpreter_only
@pytest.mark.parametrize("m", [1, 5, 24])
@pytest.mark.parametrize("split", [2, 3])
def test_channel_split_k_matches_reference_interpreted(m, split):
    """K = 200 is 7 steps of 32: split 2 gives slices of 4 + 3 steps, split 3 of 3 + 3 + 1 (the
    last masked). Per-token a, per-channel b and a bias, applied once to the summed tile; the
    semaphores are back at zero after each launch, so the second (other operands) is right too
    and a repeat is bit-identical (partials summed in slice order)."""
    n, k = 40, 200
    launch = launch_for("dot_swap", "channel") | {"split_k": split}
    for seed in (1, 4):
        a, b, scale_a, scale_b = channel_operands(m, n, k, "token", seed=seed + m)
        bias = randn((n,), seed).to(torch.bfloat16)
        out = skinny.fp8_skinny_gemm(a, b, scale_a, scale_b, torch.bfloat16, bias, **launch)
        assert_matches(out, fp8.scaled_mm_ref(a, b, scale_a, scale_b, torch.bfloat16, bias))
        again = skinny.fp8_skinny_gemm(a, b, scale_a, scale_b, torch.bfloat16, bias, **launch)
        assert torch.equal(out, again)
        assert not semaphores._SEMAPHORES[a.device].any()


@interpreter_only
@pytest.mark.parametrize(("mode", "m"), body_cases("block", [1, 4, 5, 24]))
@pytest.mark.parametrize(("k", "split"), [(640, 2), (640, 5), (600, 3)])
def test_block_split_k_matches_reference_interpreted(mode, m, k, split):
    """Slices of whole 128-wide scale groups: K = 640 is 5 groups (3 + 2, or one each); K = 600
    ends in a partial group (2 + 2 + 1, the last slice's group masked). Each slice scales its
    own groups, the last program adds the slices."""
    n = 200
    launch = launch_for(mode, "block") | {"split_k": split}
    a, b, scale_a, scale_b = block_operands(m, n, k, seed=m + k + split)
    out = skinny.fp8_block_skinny_gemm(a, b, scale_a, scale_b, torch.bfloat16, **launch)
    assert_matches(out, fp8.block_scaled_mm_ref(a, b, scale_a, scale_b, torch.bfloat16))
    assert torch.equal(
        out, skinny.fp8_block_skinny_gemm(a, b, scale_a, scale_b, torch.bfloat16, **launch)
    )
    assert not semaphores._SEMAPHORES[a.device].any()


@interpreter_only
@pytest.mark.parametrize(("mode", "m"), [("dot_swap", 5), ("wgmma", 5), ("fma", 3)])
def test_block_kernel_reads_transposed_scales_and_whole_block_tiles_interpreted(mode, m):
    """scale_a as a column-major view (strides read as given) and BLOCK_N = 128 = one weight
    block per tile."""
    a, b, scale_a, scale_b = block_operands(m, 256, 256, seed=11)
    scale_a = scale_a.T.contiguous().T
    assert scale_a.stride() == (1, m)
    launch = {"mode": mode, "block_n": 128, "num_warps": 4, "num_stages": 2}
    out = skinny.fp8_block_skinny_gemm(a, b, scale_a, scale_b, torch.bfloat16, **launch)
    assert_matches(out, fp8.block_scaled_mm_ref(a, b, scale_a, scale_b, torch.bfloat16))


@interpreter_only
@pytest.mark.parametrize("kind", ["channel", "block"])
def test_default_launch_masks_a_short_k_interpreted(kind):
    # The default configs over K = 96: one masked step (BLOCK_K 512, or 128 for block).
    m, n, k = 5, 24, 96
    assert fp8_launch.fp8_launch_config(kind, m, n, k)["block_k"] == (
        512 if kind == "channel" else 128
    )
    if kind == "channel":
        a, b, scale_a, scale_b = channel_operands(m, n, k, "token", seed=3)
        out = skinny.fp8_skinny_gemm(a, b, scale_a, scale_b, torch.bfloat16)
        ref = fp8.scaled_mm_ref(a, b, scale_a, scale_b, torch.bfloat16)
    else:
        a, b, scale_a, scale_b = block_operands(m, n, k, seed=3)
        out = skinny.fp8_block_skinny_gemm(a, b, scale_a, scale_b, torch.bfloat16)
        ref = fp8.block_scaled_mm_ref(a, b, scale_a, scale_b, torch.bfloat16)
    assert_matches(out, ref)


def test_out_dtype_must_be_16_bit():
    with pytest.raises(ValueError, match="out_dtype"):
        skinny.fp8_skinny_gemm(*channel_operands(1, 16, 32, "tensor", seed=1), torch.float32)


# ---- device ----------------------------------------------------------------------------------


@functools.cache
def llama3_weight(name: str, kind: str) -> tuple[torch.Tensor, torch.Tensor]:
    """One quantized random weight and its scales per shape and kind, made once."""
    n, k = LLAMA3_8B_SHAPES[name]
    w = torch.randn(n, k, device="cuda") * 0.02
    return block_quantize(w) if kind == "block" else fp8.per_token_fp8_quant_ref(w)


def cutlass_is_no_closer(out: torch.Tensor, cutlass: torch.Tensor, ref: torch.Tensor) -> None:
    """The Triton result is at least as close to the float32 reference as CUTLASS's (whose FP8
    accumulator is less precise), give or take one output rounding."""
    err = (out.float() - ref.float()).abs().amax().item()
    cutlass_err = (cutlass.float() - ref.float()).abs().amax().item()
    assert err <= cutlass_err + ULP[out.dtype] * ref.float().abs().amax().item()


@pytest.mark.gpu
@pytest.mark.parametrize("name", sorted(LLAMA3_8B_SHAPES))
@pytest.mark.parametrize(("mode", "m"), body_cases("channel", [1, 3, 4, 16, 32, 64]))
def test_channel_llama3_shapes_gpu(name, m, mode):
    n, k = LLAMA3_8B_SHAPES[name]
    b, scale_b = llama3_weight(name, "channel")
    a, scale_a = fp8.per_token_fp8_quant_ref(randn((m, k), m).cuda())
    bias = randn((n,), 5).to("cuda", torch.bfloat16)
    block_n = {"fma": 4, "wgmma": 64}.get(mode, 32)
    # wgmma: 256-deep steps, so 64 activation rows' stages fit shared memory
    launch = {"mode": mode, "block_n": block_n, "block_k": 256 if mode == "wgmma" else 512}
    out = skinny.fp8_skinny_gemm(a, b, scale_a, scale_b, torch.bfloat16, bias, **launch)
    ref = fp8.scaled_mm_ref(a, b, scale_a, scale_b, torch.bfloat16, bias)
    assert_matches(out, ref, mode)
    cutlass_is_no_closer(out, fp8.scaled_mm(a, b, scale_a, scale_b, torch.bfloat16, bias), ref)


@pytest.mark.gpu
@pytest.mark.parametrize("name", sorted(LLAMA3_8B_SHAPES))
@pytest.mark.parametrize(("mode", "m"), body_cases("block", [1, 3, 4, 16, 32, 64]))
def test_block_llama3_shapes_gpu(name, m, mode):
    _n, k = LLAMA3_8B_SHAPES[name]
    b, scale_b = llama3_weight(name, "block")
    a, scale_a = fp8.per_token_group_fp8_quant_ref(randn((m, k), m).cuda())
    # fma: 32 columns at M = 1, 8 at the 4-row bucket (the accumulators' registers)
    launch = {"mode": mode, "block_n": 32 // skinny_launch.m_bucket(m) if mode == "fma" else 64}
    out = skinny.fp8_block_skinny_gemm(a, b, scale_a, scale_b, torch.float16, **launch)
    ref = fp8.block_scaled_mm_ref(a, b, scale_a, scale_b, torch.float16)
    assert_matches(out, ref, mode)
    cutlass_is_no_closer(out, fp8.block_scaled_mm(a, b, scale_a, scale_b, torch.float16), ref)


@pytest.mark.gpu
@pytest.mark.parametrize("name", sorted(LLAMA3_8B_SHAPES))
@pytest.mark.parametrize("m", [1, 16, 64])
@pytest.mark.parametrize("split", [2, 3, 8])
@pytest.mark.parametrize("kind", ["channel", "block"])
@pytest.mark.parametrize("mode", ["dot_swap", "wgmma", "fma"])
def test_split_k_llama3_shapes_gpu(mode, kind, name, m, split):
    """Split launches at the real shapes on the device (K = 4096 in 16 steps of 256, or 32
    groups; K = 14336 in 56 / 112: split 3 leaves the last slice short): right against the
    reference, bit-identical to a repeat, semaphores back at zero. The fma body at M = 1 only."""
    if mode == "fma" and m > 1:
        pytest.skip("the fma body takes M <= 4; M = 1 stands for it")
    _n, k = LLAMA3_8B_SHAPES[name]
    b, scale_b = llama3_weight(name, kind)
    x = randn((m, k), m + split).cuda()
    launch = {"mode": mode, "block_n": 64 if mode == "wgmma" else 32, "split_k": split}
    if kind == "channel":
        a, scale_a = fp8.per_token_fp8_quant_ref(x)
        args = (a, b, scale_a, scale_b, torch.bfloat16)
        kernel, ref = skinny.fp8_skinny_gemm, fp8.scaled_mm_ref(*args)
        launch["block_k"] = 256
    else:
        a, scale_a = fp8.per_token_group_fp8_quant_ref(x)
        args = (a, b, scale_a, scale_b, torch.bfloat16)
        kernel, ref = skinny.fp8_block_skinny_gemm, fp8.block_scaled_mm_ref(*args)
    out = kernel(*args, **launch)
    assert_matches(out, ref, mode)
    assert torch.equal(kernel(*args, **launch), out)
    torch.cuda.synchronize()
    assert not semaphores._SEMAPHORES[a.device].any()


@pytest.mark.gpu
@pytest.mark.parametrize("granularity", GRANULARITIES)
@pytest.mark.parametrize("mode", fp8_launch.KIND_MODES["channel"])
def test_channel_ragged_shape_every_granularity_gpu(granularity, mode):
    """N = 1000 and K = 4112 are multiples of 16 but of no tile: masked edges on the device."""
    m = 3 if mode == "fma" else 5
    a, b, scale_a, scale_b = channel_operands(m, 1000, 4112, granularity, seed=9, device="cuda")
    a = strided_rows(a)
    launch = {"mode": mode, "block_n": 8 if mode == "fma" else 64, "block_k": 256}
    out = skinny.fp8_skinny_gemm(a, b, scale_a, scale_b, torch.float16, **launch)
    assert_matches(out, fp8.scaled_mm_ref(a, b, scale_a, scale_b, torch.float16), mode)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["channel", "block"])
def test_op_dispatch_gpu(kind, monkeypatch):
    """With a table entry the op returns the Triton kernel's output bit for bit; without one,
    CUTLASS's."""
    n, k = LLAMA3_8B_SHAPES["qkv"]
    b, scale_b = llama3_weight("qkv", kind)
    x = randn((4, k), 3).cuda()
    if kind == "channel":
        a, scale_a = fp8.per_token_fp8_quant_ref(x)
        op, kernel, cutlass = fp8.scaled_mm, skinny.fp8_skinny_gemm, fp8.scaled_mm_cutlass
    else:
        a, scale_a = fp8.per_token_group_fp8_quant_ref(x)
        op, kernel = fp8.block_scaled_mm, skinny.fp8_block_skinny_gemm
        cutlass = fp8.block_scaled_mm_cutlass
    args = (a, b, scale_a, scale_b, torch.bfloat16)
    monkeypatch.setitem(fp8_launch.FP8_TUNED_LAUNCH, kind, {})
    assert torch.equal(op(*args), cutlass(*args))
    launch = fp8_launch.default_fp8_launch(kind, 4, n, k) | {"mode": "dot_swap", "block_n": 64}
    monkeypatch.setitem(fp8_launch.FP8_TUNED_LAUNCH, kind, {(4, n, k): launch})
    monkeypatch.setattr(skinny_launch, "SKINNY_GEMM_ENABLED", True)
    assert torch.equal(op(*args), kernel(*args, **launch))


@pytest.mark.gpu
def test_cuda_graph_replay_gpu(monkeypatch):
    """Per-token quantization and the skinny GEMM (split 4 ways) captured in one graph, replayed
    on new x."""
    n, k = LLAMA3_8B_SHAPES["o_proj"]
    b, scale_b = llama3_weight("o_proj", "channel")
    launch = {"mode": "dot_swap", "block_n": 64, "block_k": 512, "num_warps": 4, "num_stages": 4}
    launch["split_k"] = 4  # the semaphores reset inside the graph, so every replay is right
    monkeypatch.setitem(fp8_launch.FP8_TUNED_LAUNCH, "channel", {(4, n, k): launch})
    monkeypatch.setattr(skinny_launch, "SKINNY_GEMM_ENABLED", True)
    bias = randn((n,), 1).to("cuda", torch.bfloat16)
    x = randn((4, k), 2).to("cuda", torch.bfloat16)

    def step():
        qx, sx = fp8.per_token_fp8_quant(x)
        return fp8.scaled_mm(qx, b, sx, scale_b, torch.bfloat16, bias)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()  # compile outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    for seed in (3, 4):
        x.copy_(randn((4, k), seed).to("cuda", torch.bfloat16))
        graph.replay()
        torch.cuda.synchronize()
        qx, sx = fp8.per_token_fp8_quant_ref(x)
        assert_matches(out, fp8.scaled_mm_ref(qx, b, sx, scale_b, torch.bfloat16, bias))


@pytest.mark.gpu
def test_scaled_mm_under_compile_with_unbacked_token_count_gpu(monkeypatch):
    """One compiled graph for every token count: the Triton kernel for M = 1 and 7 (entries for
    the 1 and 8 buckets), CUTLASS for M = SKINNY_MAX_M + 1."""
    n, k = LLAMA3_8B_SHAPES["qkv"]
    b, scale_b = llama3_weight("qkv", "channel")
    launch = {"mode": "dot_swap", "block_n": 16, "block_k": 512, "num_warps": 4, "num_stages": 4}
    table = {(1, n, k): launch, (8, n, k): launch | {"mode": "dot_swap", "block_n": 64}}
    monkeypatch.setitem(fp8_launch.FP8_TUNED_LAUNCH, "channel", table)
    monkeypatch.setattr(skinny_launch, "SKINNY_GEMM_ENABLED", True)

    def linear(x):
        qx, sx = fp8.per_token_fp8_quant(x)
        return fp8.scaled_mm(qx, b, sx, scale_b, torch.bfloat16)

    torch._dynamo.reset()
    compiled = torch.compile(linear, fullgraph=True)
    for m in (1, 7, skinny_launch.SKINNY_MAX_M + 1):
        x = randn((m, k), m).to("cuda", torch.bfloat16)
        torch._dynamo.decorators.mark_unbacked(x, 0)
        qx, sx = fp8.per_token_fp8_quant_ref(x)
        ref = fp8.scaled_mm_ref(qx, b, sx, scale_b, torch.bfloat16)
        out = compiled(x)
        if m <= skinny_launch.SKINNY_MAX_M:
            assert_matches(out, ref)
        else:  # CUTLASS's FP8 accumulator: the tolerance of test_fp8_gemm.py
            scale = ref.float().abs().amax().item()
            torch.testing.assert_close(out.float(), ref.float(), rtol=1e-2, atol=1e-2 * scale)
