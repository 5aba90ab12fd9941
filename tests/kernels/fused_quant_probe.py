"""Compiles the fused norm / SiLU-and-mul + FP8 quant kernels and the unfused group quant kernel
for sm_90 (no GPU needed) in each of their bodies and prints, as JSON per case, the body the
launcher chose, its grid, launch options, registers and spills, and how its PTX divides and
rounds to e4m3. Run by test_fused_quant_compile.py in a fresh process, since the kernel tests
turn on Triton's interpreter for the rest of the session (and the interpreter runs code the GPU
compiler rejects, such as a tuple of constexprs passed on with `*`).

The launchers run on small CPU tensors with the kernels' `run` replaced by a recorder (as in
pipeline_probe.py); the Llama-3-8B widths take the one-pass bodies, ONE_PASS_MAX = 16 forces the
chunked ones.
"""

from __future__ import annotations

import json
import os
import sys

os.environ.pop("TRITON_INTERPRET", None)

import pdl_ptx_probe as probe
import torch
import triton
from pipeline_probe import compile_recorded, register_usage

from v1_engine.kernels import triton_fused_quant as fused_quant
from v1_engine.kernels import triton_quant

KERNELS = (
    fused_quant._rms_norm_quant_kernel,
    fused_quant._silu_and_mul_quant_kernel,
    triton_quant._group_quant_kernel,
)
_grids: dict[str, tuple] = {}


def _recorder(kernel: triton.JITFunction):
    record = probe._recorder(kernel)

    def run(*args, grid, warmup, **kwargs):
        _grids[kernel.fn.__name__] = tuple(grid)
        record(*args, grid=grid, warmup=warmup, **kwargs)

    return run


def _compile(name: str) -> dict:
    compiled, options, constexprs = compile_recorded(name)
    ptx = compiled.asm["ptx"]
    registers, stack = register_usage(compiled)
    return {
        "one_pass_group": constexprs["ONE_PASS_GROUP"],
        "block": constexprs["BLOCK"],
        "num_warps": options["num_warps"],
        "maxnreg": options.get("maxnreg"),
        "registers": registers,
        "stack": stack,
        "grid": list(_grids[name]),
        "hardware_e4m3_casts": ptx.count("cvt.rn.satfinite.e4m3x2.f32"),
        "ieee_divisions": ptx.count("div.rn.f32"),
        # 2^23, which the interpreter's bit-level e4m3 rounding adds and subtracts.
        "emulated_rounding": ptx.count("0f4B000000"),
    }


def main() -> None:
    for kernel in KERNELS:
        kernel.run = _recorder(kernel)
    bf16, rows, hidden, inter = torch.bfloat16, 3, 4096, 14336
    x = torch.zeros(rows, hidden, dtype=bf16)
    gate_up = torch.zeros(rows, 2 * inter, dtype=bf16)
    weight = torch.ones(hidden, dtype=bf16)
    results = {}
    for body, one_pass_max in (("one_pass", triton_quant.ONE_PASS_MAX), ("chunked", 16)):
        triton_quant.ONE_PASS_MAX = one_pass_max
        for group in (None, 128):
            case = f"{body}/{'token' if group is None else group}"
            fused_quant.rms_norm_quant(x, x.clone(), weight, 1e-6, group)
            fused_quant.silu_and_mul_quant(gate_up, group)
            triton_quant.per_token_group_quant(x, group)
            results[case] = {name: _compile(name) for name in probe.recorded}
            probe.recorded.clear()
    json.dump(results, sys.stdout)


if __name__ == "__main__":
    main()
