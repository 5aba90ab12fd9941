"""F.linear on torch's two CUDA BLAS back-ends, cuBLAS (torch's default) and cuBLASLt, on the
Llama-3-8B linear shapes, at decode and prefill M.

torch calls cuBLAS for a bf16 matmul unless told otherwise; `torch.backends.cuda.
preferred_blas_library("cublaslt")` (or TORCH_BLAS_PREFER_CUBLASLT=1 for a whole process, the
engine's core process included) sends the same call to cuBLASLt, whose heuristic picks from
another set of kernels (split-K and stream-K ones among them). The engine runs F.linear wherever
no skinny Triton or CUTLASS entry holds the shape: qkv and o_proj at batch 64 (1.5x and 1.6x
their roofline on the H200, the largest share of batch 64 x 1k's distance to issue 6's goal) and
every prefill GEMM. Each back-end is timed in this process as sweep_skinny_gemm.py times a kernel:
10 calls captured in one CUDA graph over enough weight copies that none is served from L2,
replayed under do_bench, after its output was checked against the float32 product. Prints a
markdown table (us, the weight bytes' fraction of the HBM roofline, TFLOP/s) and the shapes where
either was at least 3% faster. Measured on an H100 (benchmarks/RESULTS.md, "The H100's M = 1
launches re-swept, cuBLASLt at batch 64, ..."): qkv and o_proj at M = 64 take the same time on
both, and the engine at batch 64 x 1k the same with TORCH_BLAS_PREFER_CUBLASLT=1, so the engine
has no per-shape route to cuBLASLt.

    python benchmarks/benchmark_blas_library.py
    python benchmarks/benchmark_blas_library.py --m 64 --shapes qkv,o_proj
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import sys
from collections.abc import Iterator
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
import torch.nn.functional as F
from bench_utils import HBM_BYTES_PER_S, machine
from sweep_skinny_gemm import CALLS, SHAPES, graph_us, rotated

LIBRARIES = ("cublas", "cublaslt")
"""torch.backends.cuda.preferred_blas_library's names of the two back-ends timed."""


@contextlib.contextmanager
def on_library(library: str) -> Iterator[None]:
    """torch's CUDA matmuls inside the block run on `library` (the process-wide preference, put
    back after)."""
    before = torch.backends.cuda.preferred_blas_library()
    torch.backends.cuda.preferred_blas_library(library)
    try:
        yield
    finally:
        torch.backends.cuda.preferred_blas_library(before)


WIN = 1.03
"""A back-end counts as faster at a shape when it takes at most 1/WIN of the other's time."""


def time_library(
    library: str, x: torch.Tensor, weights: list[torch.Tensor], ref: torch.Tensor
) -> float:
    """us a call of F.linear(x, w) on `library`, after checking one call against `ref`."""
    with on_library(library):
        out = F.linear(x, weights[0]).float()
        scale = ref.abs().amax().item()
        if not torch.allclose(out, ref, rtol=2e-2, atol=2e-2 * scale):
            err = (out - ref).abs().max().item()
            raise SystemExit(f"{library}: wrong result (max error {err:.3g} of {scale:.3g})")
        return graph_us(functools.partial(F.linear, x), weights)


def faster(us: dict[str, float]) -> str | None:
    """The back-end at least WIN times faster than the other, or None for a tie."""
    a, b = LIBRARIES
    if us[b] * WIN <= us[a]:
        return b
    if us[a] * WIN <= us[b]:
        return a
    return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--m", default="1,16,32,64,128,512,4096", help="comma-separated rows")
    parser.add_argument("--shapes", default="qkv,o_proj,gate_up,down,lm_head")
    args = parser.parse_args()
    ms = [int(v) for v in args.m.split(",") if v]
    torch.manual_seed(0)
    print(f"{machine()}; {CALLS} calls a graph; HBM = weight bytes / {HBM_BYTES_PER_S / 1e12:.2f}")
    print(f"TB/s / time; faster = at least {WIN:.2f}x\n")
    print("| shape | M | cuBLAS us | cuBLASLt us | cuBLAS / cuBLASLt | HBM cuBLAS | HBM cuBLASLt "
          "| TFLOP/s cuBLAS | TFLOP/s cuBLASLt |")  # fmt: skip
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    wins: dict[str, list[str]] = {name: [] for name in LIBRARIES}
    for name in args.shapes.split(","):
        n, k = SHAPES[name]
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
        weights = rotated(w)
        weight_us = 2 * n * k / HBM_BYTES_PER_S * 1e6
        for m in ms:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            ref = x.float() @ w.float().T
            us = {lib: time_library(lib, x, weights, ref) for lib in LIBRARIES}
            tflops = {lib: 2 * m * n * k / t / 1e6 for lib, t in us.items()}
            a, b = LIBRARIES
            print(
                f"| {name} | {m} | {us[a]:.1f} | {us[b]:.1f} | {us[a] / us[b]:.2f} | "
                f"{weight_us / us[a]:.2f} | {weight_us / us[b]:.2f} | {tflops[a]:.0f} | "
                f"{tflops[b]:.0f} |",
                flush=True,
            )
            winner = faster(us)
            if winner is not None:
                wins[winner].append(f"{name} M={m}")
        del weights, w
        torch.cuda.empty_cache()
    for lib in LIBRARIES:
        print(f"- {lib} faster: {', '.join(wins[lib]) or 'nowhere'}")


if __name__ == "__main__":
    main()
