"""The fused norm / SiLU-and-mul + FP8 quant kernels and the group quant kernel compile for sm_90
in every body (no GPU needed: the interpreter tests run code the GPU compiler may reject), the
launchers pick the one-pass bodies at Llama-3-8B widths with the grids, warps and register caps
benchmarks/sweep_fused_quant.py measured best, and the GPU code rounds to e4m3 with the hardware
cast and divides per value without `div.rn`."""

from __future__ import annotations

import pytest

NORM, SILU = "_rms_norm_quant_kernel", "_silu_and_mul_quant_kernel"
QUANT = "_group_quant_kernel"  # the unfused quant op (triton_quant.py), same helpers


@pytest.fixture(scope="module")
def cases(run_compile_probe) -> dict:
    return run_compile_probe("fused_quant_probe.py")


def test_all_bodies_compile_for_sm90(cases):
    assert sorted(cases) == ["chunked/128", "chunked/token", "one_pass/128", "one_pass/token"]
    for case, kernels in cases.items():
        assert sorted(kernels) == [QUANT, NORM, SILU], case
        for name, info in kernels.items():
            # Every body rounds to e4m3 with the hardware's cast; none emulates it on the bits.
            assert info["hardware_e4m3_casts"] > 0, (case, name)
            assert info["emulated_rounding"] == 0, (case, name)
            # No IEEE division per value (they made the SiLU kernel compute-bound): only the
            # scales a thread sees, their reciprocals and the norm's mean square use div.rn.
            values_per_thread = info["block"] // (32 * info["num_warps"])
            assert info["ieee_divisions"] < values_per_thread, (case, name, info)


def test_one_pass_launches_at_llama_widths(cases):
    for group, norm_group, silu_group in (("token", 4096, 16384), ("128", 128, 128)):
        norm, silu = cases[f"one_pass/{group}"][NORM], cases[f"one_pass/{group}"][SILU]
        assert (norm["one_pass_group"], norm["block"], norm["num_warps"]) == (norm_group, 4096, 8)
        assert norm["grid"] == [3]
        assert norm["maxnreg"] is None
        # One program per row, the 14336-wide row in a 16k tile of 16 warps capped at 64
        # registers (two programs an SM).
        assert (silu["one_pass_group"], silu["block"], silu["num_warps"]) == (silu_group, 16384, 16)
        assert silu["maxnreg"] == 64 and silu["registers"] <= 64
        assert norm["stack"] == 0 and silu["stack"] == 0  # no spills
        assert silu["grid"] == [3, 1]
        # The unfused quant op: one program per row of o_proj's input, quantized per group.
        quant = cases[f"one_pass/{group}"][QUANT]
        assert (quant["one_pass_group"], quant["block"], quant["grid"]) == (
            norm_group,
            4096,
            [3, 1],
        )


def test_chunked_launches_split_silu_rows_into_group_programs(cases):
    assert cases["chunked/token"][SILU]["grid"] == [3, 1]
    assert cases["chunked/128"][SILU]["grid"] == [3, 14336 // 128]
    assert cases["chunked/128"][QUANT]["grid"] == [3, 4096 // 128]
    for group in ("token", "128"):
        assert cases[f"chunked/{group}"][NORM]["one_pass_group"] == 0
        assert cases[f"chunked/{group}"][SILU]["one_pass_group"] == 0
        assert cases[f"chunked/{group}"][QUANT]["one_pass_group"] == 0
