"""The bf16 stream-K CUTLASS GEMM (csrc/gemm_sm90.cu) against cuBLAS and the engine's current
choice, at decode batch sizes.

For each Llama-3-8B (and, with --shapes, 70B) linear shape and M in --m: cuBLAS (F.linear), the
engine's op with the CUTLASS GEMM turned off (the skinny Triton kernel where its table says,
else cuBLAS), and every CUTLASS tile configuration near M under each decomposition (CUTLASS's
heuristic, stream-K, split-K 2-4, data-parallel). Each is timed as 10 calls captured in one CUDA
graph over enough weight copies that none is served from L2, replayed under do_bench
(sweep_skinny_gemm.py's timing), after its output was checked against the float32 product, also
after a graph replay (the split tiles' locks must be left zero for the next call). Prints a
markdown table (us, fraction of the HBM roofline for the weight bytes) and the GEMM_TUNED entries
(kernels/gemm_cutlass.py) where CUTLASS beat the engine's current kernel by at least 3%.

    python benchmarks/benchmark_gemm_bf16.py
    python benchmarks/benchmark_gemm_bf16.py --m 64 --shapes qkv,o_proj
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
import torch.nn.functional as F
from bench_utils import HBM_BYTES_PER_S, write_gemm_tables
from sweep_skinny_gemm import CALLS, SHAPES, graph_us, rotated

from v1_engine.kernels import gemm_cutlass, skinny_linear_op

LAUNCHES = (
    ("heuristic", 1),
    ("stream_k", 1),
    ("split_k", 2),
    ("split_k", 3),
    ("split_k", 4),
    ("data_parallel", 1),
    ("stream_k_unordered", 1),
    ("split_k_unordered", 2),
    ("split_k_unordered", 4),
)


CONFIGS_BY_M = {16: (0, 1), 32: (1, 0), 64: (2, 3, 1), 128: (4, 2, 3)}
"""Tile configurations timed at each M bucket (kernels/gemm_cutlass.CONFIG_ROWS): the tiles that
hold M, and one narrower (two M tiles: the weight tile is read twice, from L2 the second time)."""


def configs_for(m: int) -> tuple[int, ...]:
    return CONFIGS_BY_M[gemm_cutlass.m_bucket(m)]


def current_op(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The engine's op as it was before the CUTLASS GEMM: skinny kernel or cuBLAS."""
    enabled = gemm_cutlass.ENABLED
    gemm_cutlass.ENABLED = False
    try:
        return skinny_linear_op.skinny_linear_cuda(x, w)
    finally:
        gemm_cutlass.ENABLED = enabled


def cutlass(
    x: torch.Tensor, config: int, decomposition: str, splits: int, w: torch.Tensor
) -> torch.Tensor:
    return gemm_cutlass.gemm(x, w, config=config, decomposition=decomposition, splits=splits)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--m", default="16,32,64,128", help="comma-separated rows")
    parser.add_argument("--shapes", default="qkv,o_proj,gate_up,down,lm_head")
    parser.add_argument(
        "--json",
        help="also write the GEMM_TUNED entries to this file (latency.py --gemm-tables reads it)",
    )
    args = parser.parse_args()
    ms = [int(v) for v in args.m.split(",")]
    torch.manual_seed(0)
    pdl = os.environ.get("V1ENGINE_PDL", "1") != "0"
    print(
        f"PDL {'on' if pdl else 'off'}; {CALLS} calls a graph; HBM = weight bytes / "
        f"{HBM_BYTES_PER_S / 1e12:.2f} TB/s / time"
    )
    print(
        "| shape | M | cuBLAS us | current us | CUTLASS us (launch) | CUTLASS HBM | "
        "current HBM | current / CUTLASS |"
    )
    print("|---|---:|---:|---:|---|---:|---:|---:|")
    tuned: dict[tuple[int, int, int], tuple[int, str, int]] = {}
    for name in args.shapes.split(","):
        n, k = SHAPES[name]
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
        weights = rotated(w)
        for m in ms:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            ref = x.float() @ w.float().T
            scale = ref.abs().amax().item()
            cublas_us = graph_us(functools.partial(F.linear, x), weights)
            current_us = graph_us(functools.partial(current_op, x), weights)
            results = []
            for config in configs_for(m):
                for decomposition, splits in LAUNCHES:
                    call = functools.partial(cutlass, x, config, decomposition, splits)
                    try:
                        out = call(w).float()
                    except RuntimeError as error:
                        print(f"    {name} M={m} config {config} {decomposition} {splits}: {error}")
                        continue
                    if not torch.allclose(out, ref, rtol=2e-2, atol=2e-2 * scale):
                        raise SystemExit(
                            f"CUTLASS config {config} {decomposition}/{splits} wrong at {name} "
                            f"M={m}: max err {(out - ref).abs().max().item():.3g} of {scale:.3g}"
                        )
                    us = graph_us(call, weights)
                    again = call(w).float()  # after graph replays: the locks were left zero
                    if not torch.allclose(again, ref, rtol=2e-2, atol=2e-2 * scale):
                        raise SystemExit(
                            f"CUTLASS config {config} {decomposition}/{splits} wrong after "
                            f"replays at {name} M={m}"
                        )
                    results.append((us, config, decomposition, splits))
            torch.cuda.synchronize()
            results.sort()
            best_us, config, decomposition, splits = results[0]
            weight_us = 2 * n * k / HBM_BYTES_PER_S * 1e6
            label = f"{config} {decomposition}" + (
                f" {splits}" if decomposition == "split_k" else ""
            )
            print(
                f"| {name} | {m} | {cublas_us:.1f} | {current_us:.1f} | {best_us:.1f} ({label}) | "
                f"{weight_us / best_us:.2f} | {weight_us / current_us:.2f} | "
                f"{current_us / best_us:.2f} |"
            )
            print(
                "    " + ", ".join(f"{c} {d} {s}: {t:.1f}" for t, c, d, s in results[:8]),
                flush=True,
            )
            if best_us * 1.03 <= current_us:
                tuned[(gemm_cutlass.m_bucket(m), n, k)] = (config, decomposition, splits)
    print("\nGEMM_TUNED = {")
    for key, value in tuned.items():
        print(f"    {key}: {value},")
    print("}")
    if args.json:
        write_gemm_tables(args.json, "bf16", [[*key, *value] for key, value in tuned.items()])


if __name__ == "__main__":
    main()
