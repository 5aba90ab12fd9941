"""Compiles the skinny GEMM's split-K launches for sm_90 (no GPU needed) and prints, as JSON per
case, the registers, spills and how the PTX synchronizes the slices. Run by test_triton_gemv.py
in a fresh process (the kernel tests turn on Triton's interpreter, which accepts code the GPU
compiler may reject). The launcher runs on CPU tensors with the kernel's `run` replaced by a
recorder (as in pipeline_probe.py)."""

from __future__ import annotations

import json
import os
import re
import sys

os.environ.pop("TRITON_INTERPRET", None)

import pdl_ptx_probe as probe
import torch
from pipeline_probe import compile_recorded, register_usage

from v1_engine.kernels import triton_gemv

CASES = {  # name: (M, split_k, mode, block_n)
    "down_m64_split4_dot": (64, 4, "dot", 128),
    "down_m32_split2_swap": (32, 2, "dot_swap", 64),
    "down_m2_split2_fma": (2, 2, "fma", 8),
    "down_m64_unsplit": (64, 1, "dot", 64),
}


def main() -> None:
    kernel = triton_gemv._skinny_gemm_kernel
    kernel.run = probe._recorder(kernel)
    w = torch.zeros(4096, 14336, dtype=torch.bfloat16)  # Llama-3-8B down_proj
    results = {}
    for name, (m, split, mode, block_n) in CASES.items():
        x = torch.zeros(m, 14336, dtype=torch.bfloat16)
        launch = {"mode": mode, "block_n": block_n, "block_k": 128, "num_stages": 3}
        triton_gemv.skinny_gemm(x, w, split_k=split, num_warps=4, **launch)
        compiled, _, constexprs = compile_recorded("_skinny_gemm_kernel")
        probe.recorded.clear()
        ptx = compiled.asm["ptx"]
        atomic = ptx.find("atom.global")
        registers, stack = register_usage(compiled)
        results[name] = {
            "split": constexprs["SPLIT_K"],
            "registers": registers,
            "stack": stack,
            "acq_rel_adds": len(re.findall(r"atom\.global\.gpu\.acq_rel\.add", ptx)),
            "exchanges": len(re.findall(r"atom\.global\.\S*exch", ptx)),
            "barrier_before_atomic": atomic > 0 and "bar.sync" in ptx[:atomic],
            "partials_read_past_l1": ptx.count("ld.global.cg"),
        }
    json.dump(results, sys.stdout)


if __name__ == "__main__":
    main()
