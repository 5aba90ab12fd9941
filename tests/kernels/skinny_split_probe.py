"""Compiles the skinny GEMMs' split-K launches (bf16, and both FP8 kinds) for sm_90 (no GPU
needed) and prints, as JSON per case, the registers, spills and how the PTX synchronizes the
slices. Run by test_triton_gemv.py in a fresh process (the kernel tests turn on Triton's
interpreter, which accepts code the GPU compiler may reject). The launcher runs on CPU tensors with the kernel's `run` replaced by a
recorder (as in pipeline_probe.py)."""

from __future__ import annotations

import json
import os
import sys

os.environ.pop("TRITON_INTERPRET", None)

import pdl_ptx_probe as probe
import torch
from pipeline_probe import compile_recorded, semaphore_usage

from v1_engine.kernels import triton_gemv
from v1_engine.kernels import triton_gemv_fp8 as fp8_skinny

CASES = {  # name: (M, split_k, mode, block_n)
    "down_m64_split4_dot": (64, 4, "dot", 128),
    "down_m32_split2_swap": (32, 2, "dot_swap", 64),
    "down_m2_split2_fma": (2, 2, "fma", 8),
    "down_m64_unsplit": (64, 1, "dot", 64),
}
FP8_CASES = {  # name: (kind, M, split_k, block_n, block_k); Llama-3-8B down_proj, e4m3
    "fp8_channel_down_m1_split4": ("channel", 1, 4, 32, 512),
    "fp8_channel_down_m64_split2": ("channel", 64, 2, 64, 256),
    "fp8_block_down_m16_split8": ("block", 16, 8, 32, 128),
    "fp8_block_down_m1_unsplit": ("block", 1, 1, 32, 128),
}


def describe(kernel_name: str) -> dict:
    """Registers, spills and the slices' synchronization of the recorded launch."""
    compiled, _, constexprs = compile_recorded(kernel_name)
    probe.recorded.clear()
    return {"split": constexprs["SPLIT_K"], **semaphore_usage(compiled)}


def main() -> None:
    kernel = triton_gemv._skinny_gemm_kernel
    kernel.run = probe._recorder(kernel)
    n, k = 4096, 14336  # Llama-3-8B down_proj
    w = torch.zeros(n, k, dtype=torch.bfloat16)
    results = {}
    for name, (m, split, mode, block_n) in CASES.items():
        x = torch.zeros(m, k, dtype=torch.bfloat16)
        launch = {"mode": mode, "block_n": block_n, "block_k": 128, "num_stages": 3}
        triton_gemv.skinny_gemm(x, w, split_k=split, num_warps=4, **launch)
        results[name] = describe("_skinny_gemm_kernel")
    for kernel in (fp8_skinny._fp8_skinny_kernel, fp8_skinny._fp8_block_skinny_kernel):
        kernel.run = probe._recorder(kernel)
    b = torch.zeros(n, k, dtype=fp8_skinny.FP8_DTYPE)
    for name, (kind, m, split, block_n, block_k) in FP8_CASES.items():
        a = torch.zeros(m, k, dtype=fp8_skinny.FP8_DTYPE)
        launch = {"mode": "dot_swap", "block_n": block_n, "block_k": block_k, "split_k": split}
        launch |= {"num_warps": 4, "num_stages": 4}
        if kind == "channel":
            scale_a, scale_b = torch.ones(m, 1), torch.ones(n, 1)
            fp8_skinny.fp8_skinny_gemm(a, b, scale_a, scale_b, torch.bfloat16, **launch)
            results[name] = describe("_fp8_skinny_kernel")
        else:
            scale_a, scale_b = torch.ones(m, k // 128), torch.ones(n // 128, k // 128)
            fp8_skinny.fp8_block_skinny_gemm(a, b, scale_a, scale_b, torch.bfloat16, **launch)
            results[name] = describe("_fp8_block_skinny_kernel")
    json.dump(results, sys.stdout)


if __name__ == "__main__":
    main()
