"""The decode-sized FP8 GEMV (csrc/fp8_gemv.cu): which calls it takes (CPU), how its C entry
point refuses bad arguments (needs the built library, no GPU), and (gpu) its output against the
float32 reference on fresh random operands, every launch configuration, in a CUDA graph.

Kernel and reference see the same e4m3 operands and scales; the kernel's products are exact and
its sums float32 (tensor-core MMA), so only the summation order differs: a tight tolerance holds.
"""

from __future__ import annotations

import ctypes

import pytest
import torch
from test_fp8_gemm import assert_gemm_close, assert_quant_gemm_replays, random_fp8, random_scales

from v1_engine.kernels import _C, fp8, fp8_cutlass
from v1_engine.kernels.fp8 import FP8_DTYPE

CUDA_ERROR_INVALID_VALUE = 1


# ----- which calls the GEMV takes --------------------------------------------------------------


def test_fits_gemv_by_rows_shape_layout_and_bias() -> None:
    b = torch.zeros(64, 128, dtype=FP8_DTYPE)
    for m in range(1, fp8_cutlass.GEMV_MAX_M + 1):
        assert fp8_cutlass.fits_gemv(torch.zeros(m, 128, dtype=FP8_DTYPE), b, torch.bfloat16)
    assert not fp8_cutlass.fits_gemv(torch.zeros(9, 128, dtype=FP8_DTYPE), b, torch.bfloat16)
    assert not fp8_cutlass.fits_gemv(torch.zeros(0, 128, dtype=FP8_DTYPE), b, torch.bfloat16)
    a = torch.zeros(2, 128, dtype=FP8_DTYPE)
    # N a multiple of 16, K of 64.
    assert not fp8_cutlass.fits_gemv(a, torch.zeros(40, 128, dtype=FP8_DTYPE), torch.bfloat16)
    a96, b96 = torch.zeros(2, 96, dtype=FP8_DTYPE), torch.zeros(64, 96, dtype=FP8_DTYPE)
    assert not fp8_cutlass.fits_gemv(a96, b96, torch.bfloat16)
    # Rows 16-byte aligned: a slice of wider rows qualifies when its stride and start do.
    wide = torch.zeros(2, 256, dtype=FP8_DTYPE)
    assert fp8_cutlass.fits_gemv(wide[:, 128:], b, torch.bfloat16)
    assert not fp8_cutlass.fits_gemv(wide[:, 8:136], b, torch.bfloat16)
    assert not fp8_cutlass.fits_gemv(
        torch.zeros(2, 136, dtype=FP8_DTYPE)[:, :128], b, torch.bfloat16
    )
    # The bias: [N], contiguous, of the output dtype.
    assert fp8_cutlass.fits_gemv(a, b, torch.bfloat16, torch.zeros(64, dtype=torch.bfloat16))
    assert not fp8_cutlass.fits_gemv(a, b, torch.bfloat16, torch.zeros(64, dtype=torch.float16))
    assert not fp8_cutlass.fits_gemv(
        a, b, torch.bfloat16, torch.zeros(128, dtype=torch.bfloat16)[::2]
    )


def test_prefers_gemv_for_decode_rows_of_measured_shapes(monkeypatch: pytest.MonkeyPatch) -> None:
    (n, k), *_ = fp8_cutlass.GEMV_SHAPE_CONFIGS
    assert not fp8_cutlass.GEMV_ENABLED  # opt-in: slower inside the PDL decode graph
    assert not fp8_cutlass.prefers_gemv(1, n, k)
    monkeypatch.setattr(fp8_cutlass, "GEMV_ENABLED", True)
    assert [fp8_cutlass.prefers_gemv(m, n, k) for m in (0, 1, 8, 9, 64)] == [
        False,
        True,
        True,
        False,
        False,
    ]
    assert not fp8_cutlass.prefers_gemv(1, 28672, 4096)  # measured slower than CUTLASS
    monkeypatch.setattr(fp8_cutlass, "GEMV_ENABLED", False)
    assert not fp8_cutlass.prefers_gemv(1, n, k)


# ----- the C entry point's checks (library built; nothing launched) ----------------------------


def _library_or_skip() -> ctypes.CDLL:
    lib = _C.load_library()
    if lib is None:
        pytest.skip("libv1engine_kernels.so was not built (no nvcc)")
    return lib


# out, a, b, scale_a, scale_b, bias, m, n, k, lda, ldb, per_row, per_col, dtype, config, pdl,
# stream: fake 16-byte aligned addresses, rejected before anything touches them.
_GEMV_ARGS = [
    0x1000,
    0x2000,
    0x3000,
    0x4000,
    0x5000,
    None,
    1,
    64,
    128,
    128,
    128,
    1,
    1,
    1,
    0,
    0,
    None,
]


@pytest.mark.parametrize(
    ("index", "value", "message"),
    [
        (6, 9, "m must be in [1, 8], got 9"),
        (6, 0, "m must be in [1, 8], got 0"),
        (7, 40, "n must be a positive multiple of 16 and k of 64, got n=40 k=128"),
        (8, 96, "n must be a positive multiple of 16 and k of 64, got n=64 k=96"),
        (9, 120, "lda (120) and ldb (128) must be >= k (128) and multiples of 16"),
        (2, 0x3008, "a (0x2000) and b (0x3008) must be 16-byte aligned"),
        (13, 2, "out_dtype code 2 is neither bfloat16 (1) nor float16 (0)"),
        (14, fp8_cutlass.NUM_GEMV_CONFIGS, f"config {fp8_cutlass.NUM_GEMV_CONFIGS} is outside"),
        (4, None, "scale_a and scale_b must not be null"),
    ],
)
def test_gemv_entry_names_the_failed_check(index: int, value: object, message: str) -> None:
    lib = _library_or_skip()
    assert lib.v1e_fp8_gemv_num_configs() == fp8_cutlass.NUM_GEMV_CONFIGS
    args = list(_GEMV_ARGS)
    args[index] = value
    assert lib.v1e_fp8_gemv(*args) == CUDA_ERROR_INVALID_VALUE
    reason = lib.v1e_fp8_gemm_error().decode()
    assert reason.startswith("v1e_fp8_gemv: ") and message in reason, reason


# ----- the kernel on the GPU -------------------------------------------------------------------


def _case(m: int, n: int, k: int, seed: int, per_tensor: bool = False):
    a, b = random_fp8((m, k), seed, "cuda"), random_fp8((n, k), seed + 1, "cuda")
    if per_tensor:
        return a, b, random_scales((1,), seed + 2, "cuda"), random_scales((1,), seed + 3, "cuda")
    return a, b, random_scales((m, 1), seed + 2, "cuda"), random_scales((n, 1), seed + 3, "cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("m", range(1, 9))
@pytest.mark.parametrize(
    ("n", "k"),
    [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (16, 64), (48, 192), (8192, 28672)],
)
def test_gemv_matches_ref_gpu(m: int, n: int, k: int) -> None:
    a, b, sa, sb = _case(m, n, k, seed=m * 31 + n + k)
    got = fp8_cutlass.scaled_mm_gemv(a, b, sa, sb, torch.bfloat16)
    assert_gemm_close(got, fp8.scaled_mm_ref(a, b, sa, sb, torch.bfloat16))


@pytest.mark.gpu
@pytest.mark.parametrize("config", range(fp8_cutlass.NUM_GEMV_CONFIGS))
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("per_tensor", [False, True])
@pytest.mark.parametrize("with_bias", [False, True])
def test_every_gemv_config_matches_ref_gpu(
    config: int, out_dtype: torch.dtype, per_tensor: bool, with_bias: bool
) -> None:
    # K of 1, 3 and 100 warp steps: fewer steps than warps, a partial unrolled round, many.
    for m, n, k in [(1, 4096, 64), (3, 512, 192), (8, 1024, 6400), (5, 2048, 4096)]:
        a, b, sa, sb = _case(m, n, k, seed=config * 13 + m, per_tensor=per_tensor)
        bias = torch.randn(n, device="cuda").to(out_dtype) if with_bias else None
        got = fp8_cutlass.scaled_mm_gemv(a, b, sa, sb, out_dtype, bias, config=config)
        assert_gemm_close(got, fp8.scaled_mm_ref(a, b, sa, sb, out_dtype, bias))


@pytest.mark.gpu
def test_gemv_reads_strided_rows_and_only_the_first_m_gpu() -> None:
    a_wide, b_wide, sa, sb = _case(6, 256, 1024, seed=5)
    a, b = a_wide[:, 256:768], b_wide[:, 512:]  # K = 512, row strides 1024
    got = fp8_cutlass.scaled_mm_gemv(a, b, sa, sb, torch.bfloat16)
    assert_gemm_close(got, fp8.scaled_mm_ref(a, b, sa, sb, torch.bfloat16))
    # Rows past M are never read into the result: the first 3 rows of a 6-row buffer.
    got3 = fp8_cutlass.scaled_mm_gemv(a[:3], b, sa[:3], sb, torch.bfloat16)
    assert torch.equal(got3, got[:3])


@pytest.mark.gpu
def test_scaled_mm_op_runs_the_gemv_for_decode_rows_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []
    real = fp8_cutlass.scaled_mm_gemv

    def counting(a, *args, **kwargs):
        calls.append(a.shape[0])
        return real(a, *args, **kwargs)

    monkeypatch.setattr(fp8, "scaled_mm_gemv", counting)
    monkeypatch.setattr(fp8_cutlass, "GEMV_ENABLED", True)
    for m in (1, 8, 9):
        a, b, sa, sb = _case(m, 4096, 4096, seed=60 + m)
        got = fp8.scaled_mm(a, b, sa, sb, torch.bfloat16)
        assert_gemm_close(got, fp8.scaled_mm_ref(a, b, sa, sb, torch.bfloat16))
    assert calls == [1, 8]
    monkeypatch.setattr(fp8_cutlass, "GEMV_ENABLED", False)
    a, b, sa, sb = _case(1, 4096, 4096, seed=70)
    fp8.scaled_mm(a, b, sa, sb, torch.bfloat16)
    assert calls == [1, 8]


@pytest.mark.gpu
def test_gemv_replays_in_a_cuda_graph_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fp8_cutlass, "GEMV_ENABLED", True)  # the op dispatches to the GEMV
    _, b, _, sb = _case(4, 6144, 4096, seed=80)
    assert_quant_gemm_replays(b, sb, 4, (180, 181, 182))
