"""Compiles the FP8 decode-size fma kernels (kernels/triton_gemv_fp8.py: the channel and block
kinds' fma bodies, the weight_only and gated kinds) for sm_90 (no GPU needed) at the launches their sweeps
start from, and prints, as JSON per case, registers, spills, the e4m3 conversions in the PTX,
shared-memory loads of single bytes in the SASS and the shared memory the pipeliner gave the
tiles. Run by test_fp8_decode_gemm.py in a fresh
process (the kernel tests turn on Triton's interpreter, which accepts code the GPU compiler may
reject). The launchers run on CPU tensors with the kernels' `run` replaced by a recorder (as in
pipeline_probe.py)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile

os.environ.pop("TRITON_INTERPRET", None)

import pdl_ptx_probe as probe
import torch
import triton
from pipeline_probe import compile_recorded, register_usage

from v1_engine.kernels import triton_gemv_fp8 as fp8_skinny

CASES = {  # name: (kind, M, N, K, block_n, block_k); Llama-3-8B shapes
    "channel_down_m1": ("channel", 1, 4096, 14336, 4, 1024),
    "channel_gate_up_m4": ("channel", 4, 28672, 4096, 4, 256),
    "weight_only_o_proj_m1": ("weight_only", 1, 4096, 4096, 4, 1024),
    "weight_only_down_m4": ("weight_only", 4, 4096, 14336, 4, 256),
    "gated_gate_up_m1": ("gated", 1, 28672, 4096, 2, 1024),
    "gated_gate_up_m2": ("gated", 2, 28672, 4096, 2, 512),
    # the block kind steps one 128-wide scale group: wider column tiles for 16-byte loads
    "block_o_proj_m1": ("block", 1, 4096, 4096, 32, 128),
    "block_down_m4": ("block", 4, 4096, 14336, 8, 128),
}
KERNELS = {"channel": "_fp8_skinny_kernel", "block": "_fp8_block_skinny_kernel",
           "weight_only": "_fp8_decode_kernel", "gated": "_fp8_decode_kernel"}  # fmt: skip


def sass(compiled) -> str:
    """The kernel's SASS, by the cuobjdump Triton ships."""
    tools = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(compiled.asm["cubin"])
        cubin.flush()
        return subprocess.run(
            [os.path.join(tools, "cuobjdump"), "-sass", cubin.name],
            capture_output=True, text=True, check=True,
        ).stdout  # fmt: skip


def describe(kernel_name: str) -> dict:
    compiled, options, _ = compile_recorded(kernel_name)
    probe.recorded.clear()
    registers, stack = register_usage(compiled)
    ptx = compiled.asm["ptx"]
    return {
        "registers": registers,
        "stack": stack,
        "byte_smem_loads": len(re.findall(r"\bLDS\.U8\b", sass(compiled))),
        "e4m3_to_f16x2": len(re.findall(r"cvt\.rn\.f16x2\.e4m3x2", ptx)),
        "tensor_core": "mma." in ptx or "wgmma" in ptx,
        "shared": compiled.metadata.shared,
        "num_warps": options["num_warps"],
    }


def main() -> None:
    kernels = (fp8_skinny._fp8_skinny_kernel, fp8_skinny._fp8_block_skinny_kernel,
               fp8_skinny._fp8_decode_kernel)  # fmt: skip
    for kernel in kernels:
        kernel.run = probe._recorder(kernel)
    fp8 = fp8_skinny.FP8_DTYPE
    results = {}
    for name, (kind, m, n, k, block_n, block_k) in CASES.items():
        b = torch.zeros(n, k, dtype=fp8)
        launch = {"mode": "fma", "block_n": block_n, "block_k": block_k, "num_warps": 4,
                  "num_stages": 4}  # fmt: skip
        if kind == "channel":
            a = torch.zeros(m, k, dtype=fp8)
            fp8_skinny.fp8_skinny_gemm(
                a, b, torch.ones(m, 1), torch.ones(n, 1), torch.bfloat16, **launch
            )
        elif kind == "block":
            a = torch.zeros(m, k, dtype=fp8)
            groups = triton.cdiv(k, fp8_skinny.SCALE_GROUP)
            scale_b = torch.ones(triton.cdiv(n, fp8_skinny.SCALE_GROUP), groups)
            fp8_skinny.fp8_block_skinny_gemm(
                a, b, torch.ones(m, groups), scale_b, torch.bfloat16, **launch
            )
        elif kind == "weight_only":
            x = torch.zeros(m, k, dtype=torch.bfloat16)
            fp8_skinny.fp8_weight_only_gemm(x, b, torch.ones(n, 1), **launch)
        else:
            a = torch.zeros(m, k, dtype=fp8)
            fp8_skinny.fp8_gated_gemm(
                a, b, torch.ones(m, 1), torch.ones(n, 1), torch.bfloat16, **launch
            )
        results[name] = describe(KERNELS[kind])
    json.dump(results, sys.stdout)


if __name__ == "__main__":
    main()
