"""Compiles the FP8 decode-size fma kernels (kernels/triton_gemv_fp8.py: the channel and block
kinds' fma bodies, the weight_only, gated and norm kinds) and the two kinds' wgmma body for sm_90 (no GPU needed) at the launches their sweeps
start from, and prints, as JSON per case, registers, spills, the e4m3 conversions in the PTX,
shared-memory loads of single bytes in the SASS and the shared memory the pipeliner gave the
tiles. Run by test_fp8_decode_gemm.py in a fresh
process (the kernel tests turn on Triton's interpreter, which accepts code the GPU compiler may
reject). The launchers run on CPU tensors with the kernels' `run` replaced by a recorder (as in
pipeline_probe.py)."""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

os.environ.pop("TRITON_INTERPRET", None)

import pdl_ptx_probe as probe
import torch
import triton
from pipeline_probe import compile_recorded, register_usage

from v1_engine.kernels import fp8_launch
from v1_engine.kernels import triton_gemv_fp8 as fp8_skinny
from v1_engine.kernels import triton_gemv_fp8_decode as fp8_decode

CASES = {  # name: (kind, M, N, K, block_n, block_k); Llama-3-8B shapes
    "channel_down_m1": ("channel", 1, 4096, 14336, 4, 1024),
    "channel_gate_up_m4": ("channel", 4, 28672, 4096, 4, 256),
    "weight_only_o_proj_m1": ("weight_only", 1, 4096, 4096, 4, 1024),
    "weight_only_down_m4": ("weight_only", 4, 4096, 14336, 4, 256),
    "gated_gate_up_m1": ("gated", 1, 28672, 4096, 2, 1024),
    "gated_gate_up_m2": ("gated", 2, 28672, 4096, 2, 512),
    # the add + RMSNorm folded in (kernels/triton_gemv_fp8_decode.py's "norm" kinds)
    "norm_qkv_m1": ("norm", 1, 6144, 4096, 16, 512),
    "norm_gated_gate_up_m1": ("norm_gated", 1, 28672, 4096, 4, 1024),
    "norm_qkv_m4": ("norm", 4, 6144, 4096, 4, 256),
    # the block kind steps one 128-wide scale group: wider column tiles for 16-byte loads
    "block_o_proj_m1": ("block", 1, 4096, 4096, 64, 128),
    "block_down_m4": ("block", 4, 4096, 14336, 8, 128),
}
WGMMA_CASES = {  # the "wgmma" body (FP8 warpgroup MMA on the e4m3 tiles as loaded)
    "wgmma_channel_o_proj_m1": ("channel", 1, 4096, 4096, 64, 256),
    "wgmma_channel_down_m16": ("channel", 16, 4096, 14336, 128, 128),
    "wgmma_block_o_proj_m1": ("block", 1, 4096, 4096, 64, 128),
    "wgmma_block_down_m64": ("block", 64, 4096, 14336, 128, 128),
    "wgmma_gated_gate_up_m1": ("gated", 1, 28672, 4096, 64, 256),
    "wgmma_norm_qkv_m1": ("norm", 1, 6144, 4096, 64, 128),
    "wgmma_norm_gated_gate_up_m1": ("norm_gated", 1, 28672, 4096, 64, 128),
}
KERNELS = {"channel": "_fp8_skinny_kernel", "block": "_fp8_block_skinny_kernel",
           "weight_only": "_fp8_decode_kernel", "gated": "_fp8_decode_kernel",
           "norm": "_fp8_decode_kernel", "norm_gated": "_fp8_decode_kernel"}  # fmt: skip


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


def k_loop_instructions(code: str) -> int:
    """Instructions of the SASS's longest backward branch: the K loop's body."""
    lines = re.findall(r"/\*([0-9a-f]{4,})\*/\s+(.*?);", code)
    longest = 0
    for address, text in lines:
        target = re.search(r"\bBRA(?:\.U)?\s+0x([0-9a-f]+)", text)
        if target and int(target.group(1), 16) < int(address, 16):
            longest = max(longest, (int(address, 16) - int(target.group(1), 16)) // 16 + 1)
    return longest


def describe(kernel_name: str, weight_bytes: int) -> dict:
    """The compiled kernel's figures; `weight_bytes` is what one program's K step reads of the
    weight. "issue_per_byte": warp instructions the SM issues per weight byte (the K loop's
    instructions times the warps, over those bytes). At the H200's HBM rate an SM takes about
    16.5 bytes a clock and issues at most 4 warp instructions, so the body is issue-bound above
    about 0.24."""
    compiled, options, _ = compile_recorded(kernel_name)
    probe.recorded.clear()
    registers, stack = register_usage(compiled)
    ptx = compiled.asm["ptx"]
    code = sass(compiled)
    loop = k_loop_instructions(code)
    return {
        "registers": registers,
        "stack": stack,
        "k_loop": loop,
        "issue_per_byte": round(loop * options["num_warps"] / weight_bytes, 4),
        "byte_smem_loads": len(re.findall(r"\bLDS\.U8\b", code)),
        "e4m3_to_f16x2": len(re.findall(r"cvt\.rn\.f16x2\.e4m3x2", ptx)),
        "tensor_core": "mma." in ptx or "wgmma" in ptx,
        "fp8_wgmma": len(re.findall(r"\bQGMMA\.\w+\.F32\.E4M3\.E4M3\b", code)),
        "f16_unpacks": len(re.findall(r"\bF2FP\.F16\.E4M3\.UNPACK", code)),
        "shared": compiled.metadata.shared,
        "num_warps": options["num_warps"],
    }


def compile_case(kind: str, m: int, n: int, k: int, launch: dict) -> dict:
    """Records the `kind` GEMM's launch on zero CPU tensors and describes its sm_90 build."""
    fp8 = fp8_skinny.FP8_DTYPE
    b = torch.zeros(n, k, dtype=fp8)
    if kind == "channel":
        a = torch.zeros(m, k, dtype=fp8)
        fp8_skinny.fp8_skinny_gemm(
            a, b, torch.ones(m, 1), torch.ones(n, 1), torch.bfloat16, **launch
        )
    elif kind == "block":
        a = torch.zeros(m, k, dtype=fp8)
        groups = triton.cdiv(k, fp8_launch.SCALE_GROUP)
        scale_b = torch.ones(triton.cdiv(n, fp8_launch.SCALE_GROUP), groups)
        fp8_skinny.fp8_block_skinny_gemm(
            a, b, torch.ones(m, groups), scale_b, torch.bfloat16, **launch
        )
    elif kind == "weight_only":
        x = torch.zeros(m, k, dtype=torch.bfloat16)
        fp8_decode.fp8_weight_only_gemm(x, b, torch.ones(n, 1), **launch)
    elif kind == "gated":  # n weight rows (gate, then up) for n / 2 output columns
        a = torch.zeros(m, k, dtype=fp8)
        fp8_decode.fp8_gated_gemm(
            a, b, torch.ones(m, 1), torch.ones(n, 1), torch.bfloat16, **launch
        )
    else:  # the norm kinds: x, the residual and the norm weight in bf16
        x, residual = (
            torch.zeros(m, k, dtype=torch.bfloat16),
            torch.zeros(m, k, dtype=torch.bfloat16),
        )
        norm_weight = torch.ones(k, dtype=torch.bfloat16)
        fp8_decode.fp8_add_norm_gemm(
            x, residual, norm_weight, 1e-5, b, torch.ones(n, 1), gated=kind == "norm_gated",
            **launch,
        )  # fmt: skip
    rows = launch["block_n"] * (2 if kind in ("gated", "norm_gated") else 1)
    return describe(KERNELS[kind], rows * launch["block_k"])


def rank(kind: str, m: int, top: int) -> list[dict]:
    """The fma launches sweep_skinny_gemm.py times for `kind` at M (benchmarks/skinny_configs.py's
    fma_configs and fma_fits), one build per tile and warp count, by issue_per_byte, best
    first."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    import skinny_configs as sweep

    tiles = {(c["block_n"], c["block_k"], c["num_warps"]) for c in sweep.fma_configs(kind)}
    rows = []
    for block_n, block_k, warps in sorted(tiles):
        launch = {"mode": "fma", "block_n": block_n, "block_k": block_k, "num_warps": warps,
                  "num_stages": 4}  # fmt: skip
        if sweep.fma_fits(kind, launch, m):
            rows.append(launch | compile_case(kind, m, 8192, 4096, launch))
    return sorted(rows, key=lambda row: row["issue_per_byte"])[:top]


def main() -> None:
    kernels = (fp8_skinny._fp8_skinny_kernel, fp8_skinny._fp8_block_skinny_kernel,
               fp8_decode._fp8_decode_kernel)  # fmt: skip
    for kernel in kernels:
        kernel.run = probe._recorder(kernel)
    parser = argparse.ArgumentParser(description="sm_90 builds of the FP8 fma kernels")
    parser.add_argument("--rank", nargs=2, metavar=("KIND", "M"),
                        help="rank a kind's fma launches at M by issue_per_byte instead")  # fmt: skip
    parser.add_argument("--top", type=int, default=8)
    args = parser.parse_args()
    if args.rank:
        json.dump(rank(args.rank[0], int(args.rank[1]), args.top), sys.stdout, indent=1)
        return
    results = {}
    cases = [(case, "fma") for case in CASES.items()]
    cases += [(case, "wgmma") for case in WGMMA_CASES.items()]
    for (name, (kind, m, n, k, block_n, block_k)), mode in cases:
        launch = {"mode": mode, "block_n": block_n, "block_k": block_k, "num_warps": 4,
                  "num_stages": 4}  # fmt: skip
        results[name] = compile_case(kind, m, n, k, launch)
    json.dump(results, sys.stdout)


if __name__ == "__main__":
    main()
