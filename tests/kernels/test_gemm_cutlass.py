"""The bf16 stream-K CUTLASS GEMM (csrc/gemm_sm90.cu): which calls it takes (CPU), how its C
entry points refuse bad arguments (needs the built library, no GPU), and (gpu) its output
against the float32 product for every tile configuration and decomposition, calls sharing one
workspace (the split tiles' locks must be left zero), strided rows, CUDA graph replay and the
linear op's dispatch.

bf16 operands, fp32 accumulation, bf16 output: kernel and reference differ by the output
rounding and the summation order (split tiles add their partials in a fixed order).
"""

from __future__ import annotations

import ctypes

import pytest
import torch
import torch.nn.functional as F

from v1_engine.kernels import _C, gemm_cutlass, skinny_linear_op

CUDA_ERROR_INVALID_VALUE = 1


# ----- which calls it takes ---------------------------------------------------------------------


def test_m_bucket_and_prefers_only_tuned_shapes(monkeypatch: pytest.MonkeyPatch) -> None:
    assert [gemm_cutlass.m_bucket(m) for m in (1, 16, 17, 64, 65, 128, 129)] == [
        16,
        16,
        32,
        64,
        128,
        128,
        None,
    ]
    monkeypatch.setattr(gemm_cutlass, "GEMM_TUNED", {(64, 6144, 4096): (2, "stream_k", 1)})
    monkeypatch.setattr(gemm_cutlass, "ENABLED", True)
    assert [gemm_cutlass.prefers(m, 6144, 4096) for m in (32, 33, 64, 65)] == [
        False,
        True,
        True,
        False,
    ]
    assert not gemm_cutlass.prefers(64, 4096, 4096)
    assert gemm_cutlass.tuned_launch(40, 6144, 4096) == (2, "stream_k", 1)
    monkeypatch.setattr(gemm_cutlass, "ENABLED", False)  # V1ENGINE_CUTLASS_GEMM=0
    assert not gemm_cutlass.prefers(64, 6144, 4096)


def test_fits_only_bf16_without_bias_on_a_gpu() -> None:
    x, w = torch.zeros(4, 64, dtype=torch.bfloat16), torch.zeros(32, 64, dtype=torch.bfloat16)
    assert not gemm_cutlass.fits(x, w, None)  # CPU tensors
    assert not gemm_cutlass.fits(x.half(), w.half(), None)
    assert not gemm_cutlass.fits(x, w, torch.zeros(32, dtype=torch.bfloat16))
    assert not gemm_cutlass.fits(x[:, :60], w[:, :60], None)  # K not a multiple of 8


def test_launch_arguments_are_validated() -> None:
    with pytest.raises(ValueError, match=r"config must be in \[0, 5\), got 5"):
        gemm_cutlass._validate(5, "stream_k", 1)
    with pytest.raises(ValueError, match="decomposition must be one of"):
        gemm_cutlass._validate(0, "streamk", 1)
    with pytest.raises(ValueError, match="split_k needs splits >= 1, got 0"):
        gemm_cutlass._validate(0, "split_k", 0)
    with pytest.raises(ValueError, match="split_k_unordered needs splits >= 1, got 0"):
        gemm_cutlass._validate(0, "split_k_unordered", 0)
    assert gemm_cutlass._validate(2, "data_parallel", 1) == 3


# ----- the C entry points' checks (library built; nothing launched) ----------------------------


def _library_or_skip() -> ctypes.CDLL:
    lib = _C.load_library()
    if lib is None:
        pytest.skip("libv1engine_kernels.so was not built (no nvcc)")
    return lib


# out, a, b, m, n, k, lda, ldb, dtype, config, decomposition, splits, workspace, workspace
# bytes, pdl, stream: fake 16-byte aligned addresses, rejected before anything touches them.
_GEMM_ARGS = [0x1000, 0x2000, 0x3000, 64, 4096, 4096, 4096, 4096, 1, 2, 1, 1, 0x4000, 1024, 0,
              None]  # fmt: skip


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({3: 0}, "m, n, k must be in [1, INT_MAX], got m=0 n=4096 k=4096"),
        ({4: 4100}, "n (4100) and k (4096) must be multiples of 8 (TMA)"),
        ({6: 4088}, "lda (4088) and ldb (4096) must be >= k (4096) and multiples of 8"),
        ({8: 0}, "dtype code 0 is not bfloat16 (1), the one type it has"),
        ({9: gemm_cutlass.NUM_CONFIGS}, f"config {gemm_cutlass.NUM_CONFIGS} is outside [0, 5)"),
        ({10: 6}, "decomposition 6 is outside [0, 6)"),
        ({10: 2, 11: 0}, "split-K needs splits >= 1, got 0"),
        ({10: 5, 11: 0}, "split-K needs splits >= 1, got 0"),
        ({1: 0x2008}, "a (0x2008)"),
        ({12: None}, "a workspace of 1024 bytes at (nil): it must be none (0 bytes) or non-null"),
        ({12: 0x4010}, "a workspace of 1024 bytes at 0x4010"),
        ({13: 1000}, "a workspace of 1000 bytes at 0x4000"),
        ({0: None}, "out, a and b must not be null"),
    ],
)
def test_gemm_entry_names_the_failed_check(changes: dict[int, object], message: str) -> None:
    lib = _library_or_skip()
    assert lib.v1e_gemm_num_configs() == gemm_cutlass.NUM_CONFIGS
    args = list(_GEMM_ARGS)
    for index, value in changes.items():
        args[index] = value
    assert lib.v1e_gemm(*args) == CUDA_ERROR_INVALID_VALUE
    reason = lib.v1e_fp8_gemm_error().decode()
    assert reason.startswith("v1e_gemm: ") and message in reason, reason


def test_workspace_size_entry_checks_its_arguments() -> None:
    lib = _library_or_skip()
    size = ctypes.c_int64(-1)
    code = lib.v1e_gemm_workspace_size(64, 4096, 4096, 9, 1, 1, ctypes.byref(size))
    assert code == CUDA_ERROR_INVALID_VALUE
    assert "config 9 is outside [0, 5)" in lib.v1e_fp8_gemm_error().decode()
    code = lib.v1e_gemm_workspace_size(64, 4096, 4096, 0, 1, 1, None)
    assert code == CUDA_ERROR_INVALID_VALUE
    assert "bytes must not be null" in lib.v1e_fp8_gemm_error().decode()


# ----- the kernel on the GPU -------------------------------------------------------------------

LLAMA_8B = {"qkv": (6144, 4096), "o_proj": (4096, 4096), "gate_up": (28672, 4096),
            "down": (4096, 14336)}  # fmt: skip
LAUNCHES = [
    ("heuristic", 1),
    ("stream_k", 1),
    ("split_k", 3),
    ("data_parallel", 1),
    ("stream_k_unordered", 1),
    ("split_k_unordered", 2),
]


def _require_kernel() -> None:
    if not gemm_cutlass.available(torch.device("cuda")):
        pytest.skip("needs an sm_90 GPU and the library built with CUTLASS")


def _operands(m: int, n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=gen)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=gen) * 0.02
    return x, w


def assert_matches_product(out: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> None:
    """out equals x @ w^T computed in float32 up to the bf16 rounding of the output and the
    summation order (fp32 either way)."""
    ref = x.float() @ w.float().T
    assert out.dtype == torch.bfloat16 and out.shape == ref.shape
    err = (out.float() - ref).abs()
    bound = ref.abs() * 2**-8 + 1e-3 * ref.abs().amax()
    assert bool((err <= bound).all()), f"max err {err.max().item():.4g} of {ref.abs().amax():.4g}"


@pytest.mark.gpu
@pytest.mark.parametrize("config", range(gemm_cutlass.NUM_CONFIGS))
@pytest.mark.parametrize(("decomposition", "splits"), LAUNCHES)
@pytest.mark.parametrize("shape", ["qkv", "o_proj", "down"])
def test_every_config_and_decomposition_matches_gpu(
    config: int, decomposition: str, splits: int, shape: str
) -> None:
    _require_kernel()
    n, k = LLAMA_8B[shape]
    for m in (1, 16, 33, 64, 100):  # within one tile, several M tiles, partial tiles
        x, w = _operands(m, n, k, seed=1000 * config + m)
        out = gemm_cutlass.gemm(x, w, config=config, decomposition=decomposition, splits=splits)
        assert_matches_product(out, x, w)


@pytest.mark.gpu
def test_calls_sharing_the_workspace_stay_correct_gpu() -> None:
    """Split tiles wait on locks in the shared workspace; each call must leave them zero, or the
    next call's peers would pass their waits early (wrong sums) or never (a hang)."""
    _require_kernel()
    cases = []
    for i, (shape, m) in enumerate([("qkv", 64), ("o_proj", 64), ("down", 32), ("o_proj", 16)]):
        n, k = LLAMA_8B[shape]
        cases.append(_operands(m, n, k, seed=2000 + i))
    outs = []
    for _ in range(5):
        for x, w in cases:
            outs.append((gemm_cutlass.gemm(x, w, config=2, decomposition="stream_k"), x, w))
            outs.append((gemm_cutlass.gemm(x, w, config=0, decomposition="split_k", splits=4),
                         x, w))  # fmt: skip
    torch.cuda.synchronize()
    for out, x, w in outs:
        assert_matches_product(out, x, w)


@pytest.mark.gpu
def test_reads_strided_rows_gpu() -> None:
    _require_kernel()
    n, k = LLAMA_8B["o_proj"]
    wide, w = _operands(48, n, 2 * k, seed=3000)
    x = wide[:, k:]  # rows 2k apart, 16-byte aligned
    out = gemm_cutlass.gemm(x, w[:, :k].contiguous(), config=2, decomposition="stream_k")
    assert_matches_product(out, x, w[:, :k])


@pytest.mark.gpu
def test_replays_in_a_cuda_graph_with_new_inputs_gpu() -> None:
    _require_kernel()
    n, k = LLAMA_8B["qkv"]
    x, w = _operands(64, n, k, seed=4000)
    gemm_cutlass.gemm(x, w, config=2, decomposition="stream_k")  # sizes the workspace
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = gemm_cutlass.gemm(x, w, config=2, decomposition="stream_k")
        out2 = gemm_cutlass.gemm(out[:, :k].contiguous(), w, config=2, decomposition="stream_k")
    for seed in (4001, 4002, 4003):
        fresh, _ = _operands(64, n, k, seed=seed)
        x.copy_(fresh)
        graph.replay()
        torch.cuda.synchronize()
        assert_matches_product(out, x, w)
        assert_matches_product(out2, out[:, :k], w)


@pytest.mark.gpu
def test_workspace_cannot_grow_during_capture_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    _require_kernel()
    monkeypatch.setattr(gemm_cutlass, "_WORKSPACES", {})
    x, w = _operands(64, 6144, 4096, seed=5000)
    graph = torch.cuda.CUDAGraph()
    with (
        pytest.raises(RuntimeError, match="during CUDA graph capture"),
        torch.cuda.graph(graph),
    ):
        gemm_cutlass.gemm(x, w, config=2, decomposition="stream_k")


@pytest.mark.gpu
def test_linear_op_runs_it_for_tuned_shapes_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    _require_kernel()
    calls: list[tuple[int, int]] = []
    real = gemm_cutlass.gemm

    def counting(x, w, **kwargs):
        calls.append((x.shape[0], w.shape[0]))
        return real(x, w, **kwargs)

    monkeypatch.setattr(gemm_cutlass, "gemm", counting)
    monkeypatch.setattr(gemm_cutlass, "ENABLED", True)
    monkeypatch.setattr(gemm_cutlass, "GEMM_TUNED", {(64, 6144, 4096): (3, "split_k", 2)})
    for m in (48, 64, 65):
        x, w = _operands(m, 6144, 4096, seed=6000 + m)
        assert_matches_product(skinny_linear_op.skinny_linear_cuda(x, w), x, w)
    x, w = _operands(64, 4096, 4096, seed=6100)  # not tuned: the previous kernel
    torch.testing.assert_close(skinny_linear_op.skinny_linear_cuda(x, w), F.linear(x, w))
    assert calls == [(48, 6144), (64, 6144)]


@pytest.mark.gpu
def test_fp8_stream_k_configs_share_the_workspace_gpu() -> None:
    """The FP8 GEMM's stream-K configurations (kernels/fp8_cutlass.STREAM_K_CONFIGS) use the same
    device workspace: interleaved with bf16 calls, every result stays right."""
    _require_kernel()
    from v1_engine.kernels import fp8, fp8_cutlass

    outs = []
    for i in range(3):
        for config in fp8_cutlass.STREAM_K_CONFIGS:
            x, w = _operands(16 * (i + 1), 4096, 14336, seed=7000 + 10 * i + config)
            qx, sx = fp8.per_token_fp8_quant(x)
            qw, sw = fp8.per_token_fp8_quant(w)
            got = fp8_cutlass.scaled_mm_cutlass(qx, qw, sx, sw, torch.bfloat16, config=config)
            outs.append((got, fp8.scaled_mm_ref(qx, qw, sx, sw, torch.bfloat16)))
            xb, wb = _operands(64, 6144, 4096, seed=7100 + i)
            outs.append((gemm_cutlass.gemm(xb, wb, config=3, decomposition="stream_k"), xb, wb))
    torch.cuda.synchronize()
    for item in outs:
        if len(item) == 3:
            assert_matches_product(*item)
        else:  # FP8 tolerance as in test_fp8_gemm: relative to the output's scale (K = 14336)
            got, ref = item
            scale = ref.float().abs().amax().item()
            torch.testing.assert_close(got.float(), ref.float(), rtol=1e-2, atol=1e-2 * scale)
