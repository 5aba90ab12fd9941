"""The decode-sized FP8 GEMV (csrc/fp8_gemv.cu) against the CUTLASS per-channel GEMM it replaces.

For each Llama-3-8B / 70B linear shape and M in 1..8: CUTLASS (the dispatch table's tile) and
every GEMV launch configuration, each as 10 calls captured in one CUDA graph over enough weight
copies that none is served from L2, replayed under do_bench (sweep_skinny_gemm.py's timing).
Every output is checked against the float32 reference first. Prints a markdown table (us, the
weight bandwidth as a fraction of the HBM roofline, GEMV / CUTLASS speed-up) and the
GEMV_SHAPE_CONFIGS table (kernels/fp8_cutlass.py): the shapes where one configuration beat
CUTLASS by at least 3% at every M swept.

    python benchmarks/benchmark_fp8_gemv.py
    V1ENGINE_PDL=0 python benchmarks/benchmark_fp8_gemv.py --m 1 --shapes qkv,o_proj
"""

from __future__ import annotations

import argparse
import functools
import math
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
from bench_utils import HBM_BYTES_PER_S
from sweep_skinny_gemm import CALLS, SHAPES, graph_us, rotated

from v1_engine.kernels import fp8, fp8_cutlass

GEMV_SHAPES = (
    "qkv",
    "o_proj",
    "gate_up",
    "down",
    "qkv_70b",
    "o_proj_70b",
    "gate_up_70b",
    "down_70b",
)


def cutlass(qx: torch.Tensor, sx: torch.Tensor, sw: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return fp8_cutlass.scaled_mm_cutlass(qx, w, sx, sw, torch.bfloat16)


def gemv(
    qx: torch.Tensor, sx: torch.Tensor, sw: torch.Tensor, config: int, w: torch.Tensor
) -> torch.Tensor:
    return fp8_cutlass.scaled_mm_gemv(qx, w, sx, sw, torch.bfloat16, config=config)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--m", default="1,2,4,8", help="comma-separated rows")
    parser.add_argument("--shapes", default=",".join(GEMV_SHAPES))
    args = parser.parse_args()
    ms = [int(v) for v in args.m.split(",")]
    torch.manual_seed(0)
    print(
        f"PDL {'on' if os.environ.get('V1ENGINE_PDL', '1') != '0' else 'off'}; {CALLS} calls a graph"
    )
    print(
        "| shape | M | N | K | CUTLASS us | GEMV us (cfg) | GEMV HBM | CUTLASS HBM | GEMV / CUTLASS |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    best_configs: dict[tuple[int, int], tuple[list[float], list[list[float]]]] = {}
    speedups = []
    for name in args.shapes.split(","):
        n, k = SHAPES[name]
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
        qw, sw = fp8.per_token_fp8_quant(w)
        weights = rotated(qw)
        for m in ms:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            qx, sx = fp8.per_token_fp8_quant(x)
            ref = fp8.scaled_mm_ref(qx, qw, sx, sw, torch.bfloat16).float()
            scale = ref.abs().amax().item()

            base_us = graph_us(functools.partial(cutlass, qx, sx, sw), weights)
            times = []
            for config in range(fp8_cutlass.NUM_GEMV_CONFIGS):
                call = functools.partial(gemv, qx, sx, sw, config)
                out = call(qw).float()
                if not torch.allclose(out, ref, rtol=1e-2, atol=1e-2 * scale):
                    raise SystemExit(f"GEMV config {config} wrong at {name} M={m}")
                times.append(graph_us(call, weights))
            best = min(range(len(times)), key=times.__getitem__)
            base_list, time_lists = best_configs.setdefault((n, k), ([], []))
            base_list.append(base_us)
            time_lists.append(times)
            weight_s = n * k / HBM_BYTES_PER_S * 1e6
            speedups.append(base_us / times[best])
            print(
                f"| {name} | {m} | {n} | {k} | {base_us:.1f} | {times[best]:.1f} ({best}) | "
                f"{weight_s / times[best]:.2f} | {weight_s / base_us:.2f} | "
                f"{base_us / times[best]:.2f} |"
            )
            print(
                "    configs: " + ", ".join(f"{c}: {t:.1f}" for c, t in enumerate(times)),
                flush=True,
            )
    geo = math.exp(sum(math.log(s) for s in speedups) / len(speedups))
    print(f"\nGEMV / CUTLASS geometric mean {geo:.3f}, worst {min(speedups):.3f}")
    print("GEMV_SHAPE_CONFIGS = {")
    for (n, k), rows in best_configs.items():
        totals = [sum(r[c] for r in rows[1]) for c in range(fp8_cutlass.NUM_GEMV_CONFIGS)]
        best = min(range(len(totals)), key=totals.__getitem__)
        if all(t[best] * 1.03 <= base for base, t in zip(rows[0], rows[1], strict=True)):
            print(f"    ({n}, {k}): {best},")
    print("}")


if __name__ == "__main__":
    main()
