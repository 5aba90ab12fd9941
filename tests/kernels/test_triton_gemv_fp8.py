"""The skinny FP8 GEMMs (kernels/triton_gemv_fp8.py) and their dispatch from the `scaled_mm` /
`block_scaled_mm` ops against the PyTorch references of fp8.py: under the interpreter on CPU
(tiny shapes, every body, scale granularities, bias, N/K tails, the op's CUDA body with CUTLASS
stubbed), on the device with CUDA (the Llama-3-8B shapes against the references and CUTLASS, the
op's dispatch, a CUDA graph, torch.compile with an unbacked token count).

Kernel and reference see the same e4m3 operands and scales; the kernel's products are exact and
its sums float32, so the two differ by float32 summation order and one rounding to out_dtype.
"""

from __future__ import annotations

import functools

import pytest
import torch

from v1_engine.kernels import fp8, semaphores, skinny_launch
from v1_engine.kernels.fp8 import FP8_DTYPE
from v1_engine.layers.quantization.fp8_moe import quantize_matrix_block_fp8

_CUDA = torch.cuda.is_available()
# On the CPU the kernels run under Triton's interpreter, which tests/conftest.py turns on
# before any kernel module is imported.
skinny = pytest.importorskip("v1_engine.kernels.triton_gemv_fp8")
fp8_launch = pytest.importorskip("v1_engine.kernels.fp8_launch")
interpreter_only = pytest.mark.skipif(_CUDA, reason="the gpu cases cover this on a CUDA machine")

ULP = {torch.bfloat16: 2.0**-7, torch.float16: 2.0**-10}
"""Relative spacing of the output dtypes; the interpreter truncates float32 -> 16 bits (the
device rounds to nearest), so a result may sit one spacing from the reference."""

GRANULARITIES = ("tensor", "token", "mixed")
"""Scale layouts of the channel kind: per-tensor a and b; per-token a [M, 1] and per-channel b
[N, 1]; a static per-tensor a with a per-channel b."""

LLAMA3_8B_SHAPES = {  # name: (N, K)
    "qkv": (6144, 4096),
    "o_proj": (4096, 4096),
    "gate_up": (28672, 4096),
    "down": (4096, 14336),
}


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


def body_cases(kind: str, ms: list[int]) -> list[tuple[str, int]]:
    """(body, M) pairs of the `kind` kernel: every body at every M it takes (fma up to
    skinny_launch.FMA_MAX_M rows)."""
    return [
        (mode, m)
        for mode in fp8_launch.KIND_MODES[kind]
        for m in ms
        if mode != "fma" or m <= skinny_launch.FMA_MAX_M
    ]


def launch_for(mode: str, kind: str) -> dict:
    """Small tiles so the tiny shapes span several programs and K steps (the wgmma body's
    smallest: 64 columns, 128-deep steps)."""
    block_n = 64 if mode == "wgmma" else 16
    block_k = 128 if kind == "block" or mode == "wgmma" else 32
    return {"mode": mode, "block_n": block_n, "block_k": block_k, "num_warps": 4, "num_stages": 2}


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


class Recorder:
    """Stands in for a CUTLASS entry point on CPU: records the call, returns the reference."""

    def __init__(self, reference):
        self.calls = 0
        self.reference = reference

    def __call__(self, *args):
        self.calls += 1
        return self.reference(*args)


@pytest.fixture
def stubs(monkeypatch):
    """CUTLASS stubbed out in fp8 and call counters on both Triton GEMMs."""
    cutlass = {
        "channel": Recorder(fp8.scaled_mm_ref),
        "block": Recorder(fp8.block_scaled_mm_ref),
    }
    monkeypatch.setattr(fp8, "scaled_mm_cutlass", cutlass["channel"])
    monkeypatch.setattr(fp8, "block_scaled_mm_cutlass", cutlass["block"])
    triton_calls = {"channel": 0, "block": 0}
    for kind, name in (("channel", "fp8_skinny_gemm"), ("block", "fp8_block_skinny_gemm")):
        kernel = getattr(skinny, name)

        def counted(*args, _kernel=kernel, _kind=kind, **kwargs):
            triton_calls[_kind] += 1
            return _kernel(*args, **kwargs)

        monkeypatch.setattr(skinny, name, counted)
    for kind in fp8_launch.KINDS:  # as shipped before any measurement: no shape has an entry
        monkeypatch.setitem(fp8_launch.FP8_TUNED_LAUNCH, kind, {})
    monkeypatch.setattr(skinny_launch, "SKINNY_GEMM_ENABLED", True)
    return cutlass, triton_calls


@interpreter_only
def test_scaled_mm_cuda_body_dispatch_interpreted(stubs, monkeypatch):
    """The op's CUDA body on CPU tensors: CUTLASS for shapes without a table entry, for entries
    that say None, beyond SKINNY_MAX_M (even with an entry for its bucket) and with
    V1ENGINE_SKINNY_GEMM=0; the Triton kernel for M <= SKINNY_MAX_M of a shape with a config
    (the 4 bucket serves M = 3)."""
    cutlass, triton_calls = stubs
    n, k = 32, 64
    a, b, scale_a, scale_b = channel_operands(3, n, k, "token", seed=1)
    bias = randn((n,), 2).to(torch.bfloat16)
    args = (a, b, scale_a, scale_b, torch.bfloat16, bias)
    ref = fp8.scaled_mm_ref(*args)
    assert torch.equal(fp8._scaled_mm_cuda(*args), ref)
    assert (cutlass["channel"].calls, triton_calls["channel"]) == (1, 0)

    monkeypatch.setitem(
        fp8_launch.FP8_TUNED_LAUNCH["channel"], (4, n, k), launch_for("dot_swap", "")
    )
    assert_matches(fp8._scaled_mm_cuda(*args), ref)
    assert (cutlass["channel"].calls, triton_calls["channel"]) == (1, 1)

    monkeypatch.setattr(skinny_launch, "SKINNY_GEMM_ENABLED", False)
    fp8._scaled_mm_cuda(*args)
    monkeypatch.setattr(skinny_launch, "SKINNY_GEMM_ENABLED", True)
    beyond = skinny_launch.SKINNY_MAX_M + 1
    a_beyond, _, scale_a_beyond, _ = channel_operands(beyond, n, k, "token", seed=3)
    key = (skinny_launch.m_bucket(beyond), n, k)
    monkeypatch.setitem(fp8_launch.FP8_TUNED_LAUNCH["channel"], key, launch_for("dot_swap", ""))
    fp8._scaled_mm_cuda(a_beyond, b, scale_a_beyond, scale_b, torch.bfloat16, bias)
    monkeypatch.setitem(fp8_launch.FP8_TUNED_LAUNCH["channel"], (4, n, k), None)  # CUTLASS faster
    fp8._scaled_mm_cuda(*args)
    assert (cutlass["channel"].calls, triton_calls["channel"]) == (4, 1)


@interpreter_only
def test_block_scaled_mm_cuda_body_dispatch_interpreted(stubs, monkeypatch):
    cutlass, triton_calls = stubs
    n, k = 160, 256
    a, b, scale_a, scale_b = block_operands(2, n, k, seed=4)
    args = (a, b, scale_a, scale_b, torch.float16)
    ref = fp8.block_scaled_mm_ref(*args)
    assert torch.equal(fp8._block_scaled_mm_cuda(*args), ref)
    assert (cutlass["block"].calls, triton_calls["block"]) == (1, 0)
    monkeypatch.setitem(
        fp8_launch.FP8_TUNED_LAUNCH["block"], (2, n, k), launch_for("dot_swap", "block")
    )
    assert_matches(fp8._block_scaled_mm_cuda(*args), ref)
    assert (cutlass["block"].calls, triton_calls["block"]) == (1, 1)
    # The channel table does not serve the block kind, nor the other way round.
    assert not fp8_launch.prefers_fp8_skinny("channel", 2, n, k)
    monkeypatch.setattr(skinny_launch, "SKINNY_GEMM_ENABLED", False)
    fp8._block_scaled_mm_cuda(*args)
    assert (cutlass["block"].calls, triton_calls["block"]) == (2, 1)


# ---- dispatch rules, launch table (no kernel runs) ------------------------------------------


def test_fits_fp8_skinny_rules():
    a, b, _, _ = channel_operands(4, 32, 64, "tensor", seed=1)
    fits = skinny.fits_fp8_skinny
    bias = torch.zeros(32, dtype=torch.bfloat16)
    assert fits(a, b) and fits(a, b, bias) and fits(strided_rows(a), b)
    max_m = skinny_launch.SKINNY_MAX_M
    assert fits(channel_operands(max_m, 32, 64, "tensor", seed=2)[0], b)
    assert not fits(channel_operands(max_m + 1, 32, 64, "tensor", seed=2)[0], b)  # > SKINNY_MAX_M
    assert not fits(a[:0], b)  # no rows
    assert not fits(a.float(), b)  # not e4m3
    assert not fits(a, b.T.contiguous().T)  # K not contiguous in the weight
    assert not fits(a[:, :40], b[:, :40].contiguous())  # K = 40: rows not 16-byte aligned
    assert not fits(torch.zeros((4, 72), dtype=torch.uint8)[:, 8:].view(FP8_DTYPE), b)
    assert not fits(a, b, torch.zeros(64, dtype=torch.bfloat16)[::2])  # strided bias


def test_every_table_entry_is_a_valid_launch():
    """Each measured entry resolves at its shape (a split dividing K into non-empty slices, the
    block kind's one-group K step); None entries and unmeasured shapes keep CUTLASS."""
    entries = 0
    for kind, table in fp8_launch.FP8_TUNED_LAUNCH.items():
        for (m, n, k), launch in table.items():
            assert skinny_launch.m_bucket(m) == m, (kind, m, n, k)
            if launch is not None:
                resolved = fp8_launch.resolve_fp8_launch(kind, m, n, k, {})
                assert resolved == {"split_k": 1} | launch
                entries += 1
    assert entries > 0


def test_vector_stride_reads_scales_in_place():
    assert skinny._vector_stride(torch.ones(1)) == 0
    assert skinny._vector_stride(torch.ones(1, 1)) == 0
    assert skinny._vector_stride(torch.ones(5, 1)) == 1
    assert skinny._vector_stride(torch.ones(1, 5)) == 1
    assert skinny._vector_stride(torch.ones(5)) == 1
    assert skinny._vector_stride(torch.ones(10, 2)[:, :1]) == 2


def test_launch_table_and_overrides(monkeypatch):
    tuned = {"mode": "dot_swap", "block_n": 16, "block_k": 1024, "num_warps": 8, "num_stages": 5}
    monkeypatch.setitem(fp8_launch.FP8_TUNED_LAUNCH, "channel", {(4, 1024, 2048): tuned})
    monkeypatch.setitem(fp8_launch.FP8_TUNED_LAUNCH, "block", {(16, 1024, 2048): None})
    monkeypatch.setattr(skinny_launch, "SKINNY_GEMM_ENABLED", True)
    assert fp8_launch.fp8_launch_config("channel", 3, 1024, 2048) == tuned  # the 4 bucket
    assert fp8_launch.prefers_fp8_skinny("channel", 3, 1024, 2048)
    assert not fp8_launch.prefers_fp8_skinny("channel", 5, 1024, 2048)  # unmeasured: CUTLASS
    assert not fp8_launch.prefers_fp8_skinny("block", 9, 1024, 2048)  # measured: CUTLASS faster
    assert fp8_launch.fp8_launch_config("block", 9, 1024, 2048) == fp8_launch.default_fp8_launch(
        "block", 9, 1024, 2048
    )
    resolved = fp8_launch.resolve_fp8_launch("channel", 3, 1024, 2048, {"num_stages": 2})
    assert resolved == tuned | {"num_stages": 2, "split_k": 1}
    assert fp8_launch.resolve_fp8_launch("block", 3, 1024, 2048, {"split_k": 4})["split_k"] == 4
    fma = {"mode": "fma", "block_n": 8}  # the block kind's fma body: one group a K step too
    assert fp8_launch.resolve_fp8_launch("block", 3, 1024, 2048, fma)["block_k"] == 128
    wgmma = {"mode": "wgmma", "block_n": 128, "block_k": 256}
    assert fp8_launch.resolve_fp8_launch("channel", 64, 1024, 2048, wgmma)["mode"] == "wgmma"
    monkeypatch.setattr(skinny_launch, "SKINNY_GEMM_ENABLED", False)
    assert not fp8_launch.prefers_fp8_skinny("channel", 3, 1024, 2048)
    for kind, bad, match in (
        ("channel", {"block_m": 16}, "unknown launch key"),
        ("channel", {"mode": "split_k"}, "mode"),
        ("channel", {"block_n": 8}, "block_n"),  # below the dot's 16
        ("channel", {"mode": "dot"}, "mode must be one of"),  # no e4m3 body on sm_90
        ("weight_only", {"mode": "dot_swap", "block_n": 16}, "mode must be one of"),
        ("weight_only", {"mode": "wgmma", "block_n": 64, "block_k": 128}, "mode must be one of"),
        ("channel", {"mode": "wgmma", "block_n": 32}, "block_n must be a multiple of 64"),
        ("block", {"mode": "wgmma", "block_n": 16}, "block_n must be a multiple of 64"),
        ("channel", {"mode": "wgmma", "block_n": 64, "block_k": 64}, "multiple of 128"),
        ("channel", {"block_k": 48}, "block_k"),
        ("block", {"block_k": 256}, "block_k must be 128"),
        ("block", {"block_n": 256}, "block_n must be <= 128"),
        ("block", {"num_warps": 3}, "num_warps"),
        ("block", {"split_k": 17}, "split_k must be an integer in 1..16"),  # 16 groups of 128
        ("channel", {"block_k": 256, "split_k": 7}, "would leave a slice empty"),
    ):
        with pytest.raises(ValueError, match=match):
            fp8_launch.resolve_fp8_launch(kind, 3, 1024, 2048, bad)
    with pytest.raises(ValueError, match="'fma' needs M in 1..4"):
        fp8_launch.resolve_fp8_launch("channel", 8, 1024, 2048, {"mode": "fma", "block_n": 8})
    with pytest.raises(ValueError, match="kind must be one of"):
        fp8_launch.fp8_launch_config("tensor", 1, 64, 64)
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
