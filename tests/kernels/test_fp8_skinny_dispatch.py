"""The `scaled_mm` / `block_scaled_mm` ops' choice between CUTLASS and the skinny FP8 GEMMs
(kernels/fp8.py's CUDA bodies, kernels/fp8_launch.py's rules and tables), on the CPU: the CUDA
bodies with CUTLASS stubbed and the kernels under Triton's interpreter, which tests/conftest.py
turns on before any kernel module is imported; the operand rules, the launch table and its
overrides without running a kernel. The kernels themselves: test_triton_gemv_fp8.py."""

from __future__ import annotations

import pytest
import torch
from fp8_gemm_cases import (
    Recorder,
    assert_matches,
    block_operands,
    channel_operands,
    launch_for,
    randn,
    strided_rows,
)

from v1_engine.kernels import fp8, skinny_launch
from v1_engine.kernels.fp8 import FP8_DTYPE

skinny = pytest.importorskip("v1_engine.kernels.triton_gemv_fp8")
fp8_launch = pytest.importorskip("v1_engine.kernels.fp8_launch")
interpreter_only = pytest.mark.skipif(
    torch.cuda.is_available(), reason="the gpu cases cover this on a CUDA machine"
)


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
