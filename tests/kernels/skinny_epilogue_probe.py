"""Compiles the skinny GEMM's epilogue launches (kernels/skinny_epilogues.py: the gated GEMM and
the add + RMSNorm by the last tile) for sm_90 (no GPU needed) and prints, as JSON per case, the
registers, spills and how the PTX synchronizes the tiles. Run by test_skinny_epilogues.py in a
fresh process (its kernel tests turn on Triton's interpreter, which accepts code the GPU
compiler may reject); the launcher runs on CPU tensors with the kernel's `run` replaced by a
recorder (as in skinny_split_probe.py)."""

from __future__ import annotations

import json
import os
import sys

os.environ.pop("TRITON_INTERPRET", None)

import pdl_ptx_probe as probe
import torch
from pipeline_probe import compile_recorded, semaphore_usage

from v1_engine.kernels import skinny_epilogues, triton_gemv

GATED = {  # name: (M, mode, block_n, block_k); Llama-3-8B gate_up [28672, 4096]
    "gated_m1_fma": (1, "fma", 2, 512),
    "gated_m16_swap": (16, "dot_swap", 32, 128),
    "gated_m64_dot": (64, "dot", 32, 128),
}
NORM = {  # name: (M, mode, block_n, block_k, split_k); Llama-3-8B down_proj [4096, 14336]
    "norm_m1_fma": (1, "fma", 4, 512, 1),
    "norm_m4_swap": (4, "dot_swap", 64, 256, 1),
    "norm_m2_swap_split2": (2, "dot_swap", 64, 128, 2),
}
FOLD = {  # name: (M, mode, block_n, block_k, gated); the add + RMSNorm folded in (NORM_IN)
    "fold_qkv_m1_fma": (1, "fma", 8, 256, False),  # qkv_proj [6144, 4096]
    "fold_gated_m1_fma": (1, "fma", 2, 512, True),  # gate_up [28672, 4096]
    "fold_gate_up_m64_dot": (64, "dot", 64, 128, False),  # the M = 64 entry, ungated
}


def describe() -> dict:
    compiled, _, constexprs = compile_recorded("_skinny_gemm_kernel")
    probe.recorded.clear()
    return {
        "gated": constexprs["GATED"],
        "add_norm": constexprs["ADD_NORM"],
        "norm_in": constexprs["NORM_IN"],
        "split": constexprs["SPLIT_K"],
        **semaphore_usage(compiled),
    }


def main() -> None:
    kernel = triton_gemv._skinny_gemm_kernel
    kernel.run = probe._recorder(kernel)
    results = {}
    w = torch.zeros(28672, 4096, dtype=torch.bfloat16)
    for name, (m, mode, block_n, block_k) in GATED.items():
        x = torch.zeros(m, 4096, dtype=torch.bfloat16)
        launch = {"mode": mode, "block_n": block_n, "block_k": block_k, "num_stages": 4}
        skinny_epilogues.skinny_gemm_silu_mul(x, w, num_warps=4, **launch)
        results[name] = describe()
    w = torch.zeros(4096, 14336, dtype=torch.bfloat16)
    norm_w = torch.zeros(4096, dtype=torch.bfloat16)
    for name, (m, mode, block_n, block_k, split) in NORM.items():
        x = torch.zeros(m, 14336, dtype=torch.bfloat16)
        residual = torch.zeros(m, 4096, dtype=torch.bfloat16)
        launch = {"mode": mode, "block_n": block_n, "block_k": block_k, "num_stages": 4}
        skinny_epilogues.skinny_gemm_add_rms_norm(
            x, w, residual, norm_w, 1e-5, num_warps=4, split_k=split, **launch
        )
        results[name] = describe()
    for name, (m, mode, block_n, block_k, gated) in FOLD.items():
        w = torch.zeros(28672 if gated else 6144, 4096, dtype=torch.bfloat16)
        x, residual = (
            torch.zeros(m, 4096, dtype=torch.bfloat16),
            torch.zeros(m, 4096, dtype=torch.bfloat16),
        )
        launch = {"mode": mode, "block_n": block_n, "block_k": block_k, "num_stages": 4}
        skinny_epilogues.skinny_gemm_add_norm(
            x, residual, norm_w[:4096], 1e-5, w, gated, num_warps=4, **launch
        )
        results[name] = describe()
    json.dump(results, sys.stdout)


if __name__ == "__main__":
    main()
