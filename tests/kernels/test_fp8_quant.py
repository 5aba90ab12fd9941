"""FP8 quantization: the PyTorch references against plain fp32 math, the Triton kernels against the
references (bit for bit), and the custom ops' registration, fake impls and input validation.

Without CUDA the Triton kernels run under the interpreter (TRITON_INTERPRET=1) on tiny shapes; the
`gpu` cases run them compiled on model-sized shapes.
"""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from v1_engine.kernels import fp8
from v1_engine.kernels.fp8 import FP8_DTYPE, FP8_MAX, FP8_MIN_SCALE
from v1_engine.kernels.triton_quant import _quantize_to_fp8

_CUDA = torch.cuda.is_available()
E4M3_HALF_ULP = 2.0**-4  # 3 mantissa bits: rounding error <= 1/16 relative in the normal range
E4M3_MIN_NORMAL = 2.0**-6


def random_activations(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Normal values with a few outlier columns, like real activations."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=gen)
    x[..., :: max(1, shape[-1] // 4)] *= 20.0
    return x.to(dtype)


def as_bytes(q: torch.Tensor) -> torch.Tensor:
    return q.view(torch.uint8)


def assert_round_trip(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> None:
    """Dequantized values within half an e4m3 step of x (absolute floor at the subnormal step)."""
    xf = x.float()
    deq = q.float() * scale
    bound = xf.abs() * E4M3_HALF_ULP + scale * E4M3_MIN_NORMAL * 2.0**-3
    assert bool(((deq - xf).abs() <= bound * 1.0001).all())


# ----- references against plain math ---------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_per_token_ref_scales_each_row_to_its_amax(dtype: torch.dtype) -> None:
    x = random_activations((7, 96), dtype, seed=1)
    q, scales = fp8.per_token_fp8_quant_ref(x)
    assert q.dtype == FP8_DTYPE and q.shape == x.shape
    assert scales.dtype == torch.float32 and scales.shape == (7, 1)
    expected = x.float().abs().amax(dim=1, keepdim=True) / 448.0
    torch.testing.assert_close(scales, expected, rtol=0, atol=0)
    # The largest element of every row lands exactly on +-448.
    assert torch.equal(q.float().abs().amax(dim=1), torch.full((7,), FP8_MAX))
    assert_round_trip(x, q, scales)


def test_zero_row_gets_the_floor_scale_and_zeros() -> None:
    x = torch.zeros(2, 32, dtype=torch.bfloat16)
    x[1] = 1.0
    q, scales = fp8.per_token_fp8_quant_ref(x)
    assert scales[0, 0].item() == pytest.approx(FP8_MIN_SCALE)
    assert torch.equal(q[0].float(), torch.zeros(32))
    assert torch.equal(q[1].float(), torch.full((32,), FP8_MAX))
    assert not bool(q.float().isnan().any())


def test_group_ref_equals_per_token_ref_on_each_group() -> None:
    x = random_activations((5, 300), torch.bfloat16, seed=2)  # 300 = 2 full groups of 128 + 44
    q, scales = fp8.per_token_group_fp8_quant_ref(x, group_size=128)
    assert scales.shape == (5, 3) and q.shape == (5, 300)
    for g, (lo, hi) in enumerate([(0, 128), (128, 256), (256, 300)]):
        q_g, s_g = fp8.per_token_fp8_quant_ref(x[:, lo:hi])
        assert torch.equal(as_bytes(q[:, lo:hi]), as_bytes(q_g))
        assert torch.equal(scales[:, g : g + 1], s_g)


def test_static_ref_saturates_and_dynamic_uses_amax() -> None:
    x = torch.tensor([[-1000.0, -1.0, 0.0, 0.5, 2.0, 1000.0]])
    q, scale = fp8.scaled_fp8_quant_ref(x, torch.tensor([1.0]))
    assert q.float().tolist() == [[-448.0, -1.0, 0.0, 0.5, 2.0, 448.0]]
    assert scale.item() == 1.0
    q, scale = fp8.scaled_fp8_quant_ref(x)
    assert scale.shape == (1,) and scale.item() == pytest.approx(1000.0 / 448.0)
    assert q.float()[0, -1].item() == FP8_MAX


def test_quant_rounds_to_nearest_even() -> None:
    # Between 16 and 32 e4m3 steps by 2: 17 and 19 are ties (to 16 and 20), 17.5 rounds up.
    x = torch.tensor([[17.0, 19.0, 17.5, 18.0]])
    q, _ = fp8.scaled_fp8_quant_ref(x, torch.tensor([1.0]))
    assert q.float().tolist() == [[16.0, 20.0, 18.0, 18.0]]


# ----- Triton kernels against the references ---------------------------------------------------

triton_quant = pytest.importorskip("v1_engine.kernels.triton_quant")
interpreter_only = pytest.mark.skipif(_CUDA, reason="the gpu cases cover this on a CUDA machine")


def check_kernels_match_refs(x: torch.Tensor, group_size: int) -> None:
    q, s = triton_quant.per_token_group_quant(x, group_size=None)
    q_ref, s_ref = fp8.per_token_fp8_quant_ref(x)
    assert torch.equal(as_bytes(q), as_bytes(q_ref)) and torch.equal(s, s_ref)

    q, s = triton_quant.per_token_group_quant(x, group_size=group_size)
    q_ref, s_ref = fp8.per_token_group_fp8_quant_ref(x, group_size)
    assert torch.equal(as_bytes(q), as_bytes(q_ref)) and torch.equal(s, s_ref)

    scale = torch.tensor([0.03], device=x.device)  # small enough that the outliers saturate
    q = triton_quant.static_quant(x, scale)
    assert torch.equal(as_bytes(q), as_bytes(fp8.scaled_fp8_quant_ref(x, scale)[0]))


@interpreter_only
@pytest.mark.parametrize(
    ("shape", "group_size"), [((3, 200), 64), ((1, 16), 16), ((2, 3, 48), 32), ((2, 40), 128)]
)
def test_triton_kernels_match_refs_interpreted(shape: tuple[int, ...], group_size: int) -> None:
    check_kernels_match_refs(random_activations(shape, torch.bfloat16, seed=3), group_size)


@interpreter_only
@pytest.mark.parametrize(("shape", "group_size"), [((3, 200), 64), ((2, 40), 128)])
def test_triton_chunked_body_matches_refs_interpreted(monkeypatch, shape, group_size) -> None:
    """Rows past ONE_PASS_MAX take the chunked body: one program per group, read twice."""
    monkeypatch.setattr(triton_quant, "ONE_PASS_MAX", 16)
    assert triton_quant._one_pass_group(shape[-1], group_size, 256) == 0
    check_kernels_match_refs(random_activations(shape, torch.bfloat16, seed=7), group_size)


def test_group_quant_takes_one_pass_at_model_widths() -> None:
    one_pass = triton_quant._one_pass_group
    assert one_pass(4096, 4096, 4096) == 4096  # per token: the row is one group
    assert one_pass(7168, 128, 8192) == 128  # DeepSeek-V3's hidden size in 128-groups
    assert one_pass(18432, 128, 32768) == 0  # past ONE_PASS_MAX: the chunked body


@interpreter_only
def test_triton_kernels_read_strided_rows_interpreted() -> None:
    fused = random_activations((4, 96), torch.float16, seed=4)
    check_kernels_match_refs(fused[:, 16:80], group_size=32)  # a slice: row stride 96


@interpreter_only
def test_triton_rounding_is_exact_over_the_whole_range_interpreted() -> None:
    values = torch.cat(
        [
            torch.linspace(-460.0, 460.0, 20001),
            torch.logspace(-12, 2.6, 3000),
            -torch.logspace(-12, 2.6, 3000),
            torch.tensor([0.0, 2.0**-10, 3 * 2.0**-10, 2.0**-9, 17.0, 19.0, 440.0, 464.0]),
        ]
    ).reshape(1, -1)
    q = triton_quant.static_quant(values, torch.tensor([1.0]))
    assert torch.equal(
        as_bytes(q), as_bytes(fp8.scaled_fp8_quant_ref(values, torch.tensor([1.0]))[0])
    )


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("shape", [(1, 4096), (7, 14336), (333, 4096), (4, 8, 128), (2, 100)])
def test_triton_kernels_match_refs_gpu(shape: tuple[int, ...], dtype: torch.dtype) -> None:
    check_kernels_match_refs(random_activations(shape, dtype, seed=5).cuda(), group_size=128)


@pytest.mark.gpu
def test_cuda_ops_match_refs_gpu() -> None:
    x = random_activations((65, 7168), torch.bfloat16, seed=6).cuda()
    for op, ref in (
        (fp8.per_token_fp8_quant, fp8.per_token_fp8_quant_ref),
        (fp8.scaled_fp8_quant, fp8.scaled_fp8_quant_ref),
        (fp8.per_token_group_fp8_quant, fp8.per_token_group_fp8_quant_ref),
    ):
        (q, s), (q_ref, s_ref) = op(x), ref(x)
        assert torch.equal(as_bytes(q), as_bytes(q_ref)) and torch.equal(s, s_ref)
    scale = torch.tensor([0.05], device="cuda")
    q, s = fp8.scaled_fp8_quant(x, scale)
    assert s is scale
    assert torch.equal(as_bytes(q), as_bytes(fp8.scaled_fp8_quant_ref(x, scale)[0]))


@pytest.mark.gpu
def test_references_divide_exactly_on_gpu() -> None:
    """On CUDA torch divides by a Python number as a multiplication by its reciprocal (one ulp off
    for some amax); the references divide by a device tensor instead, so they give the CPU's
    IEEE quotients, the values the kernels' div_rn computes."""
    x = random_activations((65, 7168), torch.bfloat16, seed=10)
    for ref in (
        fp8.per_token_fp8_quant_ref,
        fp8.scaled_fp8_quant_ref,
        fp8.per_token_group_fp8_quant_ref,
    ):
        (q_gpu, s_gpu), (q_cpu, s_cpu) = ref(x.cuda()), ref(x)
        assert torch.equal(s_gpu.cpu(), s_cpu)
        assert torch.equal(as_bytes(q_gpu).cpu(), as_bytes(q_cpu))


@triton.jit
def _division_mismatch_kernel(counts_ptr, scale_start, BLOCK: tl.constexpr, BYTES: tl.constexpr):
    """Program (y, j): y = +-(1 + m / 128) for the bf16 mantissa m = program_id(0) // 2, against
    the BLOCK scale mantissas from scale_start + j * BLOCK, every scale in [1, 2). Counts: [0]
    fp32 quotients of `_quantize_to_fp8`'s GPU sequence that differ from `div_rn`'s. BYTES (the
    GPU's casts only): [1] e4m3 bytes that differ from the interpreter path's (div_rn, clamp, bit
    rounding) with y scaled by 2^-12 .. 2^8, so the quotients cover e4m3's subnormals, normals
    and saturation; [2] the same for the bf16 subnormal y with that mantissa."""
    pid = tl.program_id(0)
    sign = (pid % 2) << 31
    y_bits = sign | (127 << 23) | ((pid // 2) << 16)
    s_bits = (127 << 23) | (scale_start + tl.program_id(1) * BLOCK + tl.arange(0, BLOCK))
    s = s_bits.to(tl.float32, bitcast=True)
    y = (tl.zeros([BLOCK], tl.int32) + y_bits).to(tl.float32, bitcast=True)
    fast = _quantize_to_fp8(y, s, 448.0, True)
    exact = tl.math.div_rn(y, s)
    bad = fast.to(tl.int32, bitcast=True) != exact.to(tl.int32, bitcast=True)
    tl.atomic_add(counts_ptr, tl.sum(bad.to(tl.int32), axis=0))
    if BYTES:
        bad_bytes = tl.zeros([BLOCK], tl.int32)
        for shift in tl.static_range(-12, 9):
            ys = y * (2.0**shift)
            hw = _quantize_to_fp8(ys, s, 448.0, True).to(tl.float8e4nv).to(tl.uint8, bitcast=True)
            ref = _quantize_to_fp8(ys, s, 448.0, False).to(tl.float8e4nv).to(tl.uint8, bitcast=True)
            bad_bytes += (hw != ref).to(tl.int32)
        tl.atomic_add(counts_ptr + 1, tl.sum(bad_bytes, axis=0))
        tiny = (tl.zeros([BLOCK], tl.int32) + (sign | ((pid // 2) << 16))).to(
            tl.float32, bitcast=True
        )
        hw = _quantize_to_fp8(tiny, s, 448.0, True).to(tl.float8e4nv).to(tl.uint8, bitcast=True)
        ref = _quantize_to_fp8(tiny, s, 448.0, False).to(tl.float8e4nv).to(tl.uint8, bitcast=True)
        tl.atomic_add(counts_ptr + 2, tl.sum((hw != ref).to(tl.int32), axis=0))


@pytest.mark.gpu
def test_quant_division_equals_div_rn_for_every_mantissa_gpu() -> None:
    """`_quantize_to_fp8` replaces `div_rn` on the GPU with a reciprocal and Markstein's fma
    correction. Correct rounding of a normal quotient depends only on the two mantissas, so
    every bf16 mantissa (both signs) against every one of the 2^23 fp32 scale mantissas is the
    whole normal range: no quotient may differ by a bit, and no e4m3 byte from the
    interpreter path's over the exponents the quant meets."""
    block = 1024
    counts = torch.zeros(3, dtype=torch.int32, device="cuda")
    _division_mismatch_kernel[(256, (1 << 23) // block)](counts, 0, BLOCK=block, BYTES=True)
    assert counts.tolist() == [0, 0, 0]


@interpreter_only
def test_quant_division_equals_div_rn_interpreted() -> None:
    """The same check of the quotients on the CPU (the interpreter's fma rounds once, like the
    GPU's), over every bf16 mantissa and the lowest and highest 1024 scale mantissas."""
    counts = torch.zeros(3, dtype=torch.int32)
    for start in (0, (1 << 23) - 1024):
        _division_mismatch_kernel[(256, 1)](counts, start, BLOCK=1024, BYTES=False)
    assert counts.tolist() == [0, 0, 0]


# ----- public API on CPU: ops, fake impls, validation ------------------------------------------


def test_public_ops_on_cpu_run_the_references() -> None:
    x = random_activations((3, 256), torch.bfloat16, seed=7)
    for op, ref in (
        (fp8.per_token_fp8_quant, fp8.per_token_fp8_quant_ref),
        (fp8.scaled_fp8_quant, fp8.scaled_fp8_quant_ref),
        (fp8.per_token_group_fp8_quant, fp8.per_token_group_fp8_quant_ref),
    ):
        (q, s), (q_ref, s_ref) = op(x), ref(x)
        assert torch.equal(as_bytes(q), as_bytes(q_ref)) and torch.equal(s, s_ref)
    scale = torch.tensor([0.5])
    q, s = fp8.scaled_fp8_quant(x, scale)
    assert s is scale
    assert torch.equal(as_bytes(q), as_bytes(fp8.scaled_fp8_quant_ref(x, scale)[0]))


@pytest.mark.parametrize(
    ("op", "args"),
    [
        ("static_scaled_fp8_quant", lambda x: (x, torch.tensor([0.1]))),
        ("dynamic_scaled_fp8_quant", lambda x: (x,)),
        ("per_token_fp8_quant", lambda x: (x,)),
        ("per_token_group_fp8_quant", lambda x: (x, 64)),
    ],
)
def test_quant_ops_pass_opcheck(op: str, args) -> None:
    x = random_activations((4, 128), torch.bfloat16, seed=8)
    torch.library.opcheck(getattr(torch.ops.v1_engine, op).default, args(x))


def test_quant_ops_trace_under_torch_compile() -> None:
    def quantize_all(x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        q1, s1 = fp8.per_token_fp8_quant(x)
        q2, s2 = fp8.per_token_group_fp8_quant(x, 64)
        q3, s3 = fp8.scaled_fp8_quant(x)
        return q1.float() * s1, s2, q2.float(), q3.float() * s3

    x = random_activations((5, 128), torch.bfloat16, seed=9)
    compiled = torch.compile(quantize_all, backend="aot_eager", fullgraph=True)
    for got, want in zip(compiled(x), quantize_all(x)):
        assert torch.equal(got, want)


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda: fp8.per_token_fp8_quant(torch.zeros(2, 8, dtype=torch.int32)), "x dtype"),
        (lambda: fp8.per_token_fp8_quant(torch.zeros(2, 0)), "non-empty last dimension"),
        (lambda: fp8.scaled_fp8_quant(torch.zeros(2, 8), torch.ones(2)), "scale must be"),
        (
            lambda: fp8.scaled_fp8_quant(torch.zeros(2, 8), torch.ones(1, dtype=torch.float16)),
            "scale must be",
        ),
        (lambda: fp8.per_token_group_fp8_quant(torch.zeros(2, 8), 96), "group_size"),
        (lambda: fp8.per_token_group_fp8_quant(torch.zeros(2, 8), 0), "group_size"),
    ],
)
def test_quant_rejects_bad_inputs(call, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        call()
