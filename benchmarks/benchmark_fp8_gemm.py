"""FP8 GEMM kernels against cuBLASLt (`torch._scaled_mm`, row-wise scales) in the same run.

For the Llama-3-8B and -70B linear layers (qkv, o, gate_up, down) and M in {1 ... 8192}: our
per-token x per-channel GEMM op (CUTLASS, or the skinny Triton GEMM on the decode shapes its
table holds: cfg "triton") vs cuBLASLt (TFLOP/s and ratio, geometric mean), and our
block-scaled GEMM vs our per-channel one. Each case is checked against cuBLASLt's output first.

Timing: every kernel runs inside a CUDA graph of `--calls` launches (so host overhead, which
graphs remove in serving, is not measured), rotating through enough weight copies to defeat the
60 MB L2; CUDA events around graph replays, median of `--repeat` after warm-up.

    python benchmarks/benchmark_fp8_gemm.py               # table, geomean, goals
    python benchmarks/benchmark_fp8_gemm.py --tune        # best tile configuration per M bucket
    python benchmarks/benchmark_fp8_gemm.py --markdown    # table for benchmarks/RESULTS.md
"""

from __future__ import annotations

import argparse
import itertools
import math
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_utils

from v1_engine.kernels import fp8, fp8_cutlass, fp8_launch

M_VALUES = (1, 16, 64, 128, 256, 512, 1024, 4096, 8192)
L2_BYTES = 60 * 2**20
MAX_WEIGHT_COPIES = 16


@dataclass(frozen=True)
class LinearShape:
    model: str
    layer: str
    n: int
    k: int


def llama_shapes(model: str, hidden: int, heads: int, kv_heads: int, inter: int):
    head_dim = hidden // heads
    return [
        LinearShape(model, "qkv", (heads + 2 * kv_heads) * head_dim, hidden),
        LinearShape(model, "o", hidden, heads * head_dim),
        LinearShape(model, "gate_up", 2 * inter, hidden),
        LinearShape(model, "down", hidden, inter),
    ]


SHAPES = llama_shapes("8B", 4096, 32, 8, 14336) + llama_shapes("70B", 8192, 64, 8, 28672)


@dataclass
class Case:
    """Operands of one (shape, M): activations, rotating weight copies, scales."""

    a: torch.Tensor
    sa: torch.Tensor
    weights: list[torch.Tensor]
    sb: torch.Tensor
    block_sa: torch.Tensor
    block_sb: torch.Tensor

    @property
    def flops(self) -> float:
        return 2.0 * self.a.shape[0] * self.weights[0].shape[0] * self.a.shape[1]


def make_case(m: int, shape: LinearShape) -> Case:
    gen = torch.Generator(device="cuda").manual_seed(m * 131 + shape.n)
    x = torch.randn(m, shape.k, device="cuda", generator=gen, dtype=torch.bfloat16)
    a, sa = fp8.per_token_fp8_quant(x)
    weight_bytes = shape.n * shape.k
    copies = min(MAX_WEIGHT_COPIES, max(1, math.ceil(2 * L2_BYTES / weight_bytes)))
    w = torch.randn(shape.n, shape.k, device="cuda", generator=gen, dtype=torch.bfloat16)
    qw, sb = fp8.per_token_fp8_quant(w * 0.02)
    weights = [qw] + [qw.clone() for _ in range(copies - 1)]
    kb, nb = math.ceil(shape.k / 128), math.ceil(shape.n / 128)
    block_sa = torch.rand(m, kb, device="cuda", generator=gen) * 1e-2 + 1e-3
    block_sb = torch.rand(nb, kb, device="cuda", generator=gen) * 1e-2 + 1e-3
    return Case(a, sa, weights, sb, block_sa, block_sb)


def cublas_fn(case: Case, fast_accum: bool) -> Callable[[torch.Tensor], torch.Tensor]:
    sb_row = case.sb.reshape(1, -1)
    return lambda w: torch._scaled_mm(
        case.a,
        w.t(),
        scale_a=case.sa,
        scale_b=sb_row,
        out_dtype=torch.bfloat16,
        use_fast_accum=fast_accum,
    )


def ours_fn(case: Case, config: int | None = None) -> Callable[[torch.Tensor], torch.Tensor]:
    """The `scaled_mm` op as the engine calls it (the skinny Triton GEMM on the decode shapes
    its table holds, CUTLASS elsewhere); a CUTLASS tile config when `config` is given (tuning)."""
    if config is None:
        return lambda w: fp8.scaled_mm(case.a, w, case.sa, case.sb, torch.bfloat16)
    return lambda w: fp8_cutlass.scaled_mm_cutlass(
        case.a, w, case.sa, case.sb, torch.bfloat16, config=config
    )


def block_fn(case: Case) -> Callable[[torch.Tensor], torch.Tensor]:
    """The `block_scaled_mm` op as the engine calls it."""
    return lambda w: fp8.block_scaled_mm(case.a, w, case.block_sa, case.block_sb, torch.bfloat16)


def graph_time_ms(fn: Callable, weights: list[torch.Tensor], calls: int, repeat: int) -> float:
    """Median ms per call of fn over `calls` launches captured in one CUDA graph, each launch on
    the next of the weight copies (so no launch finds its weight in L2)."""
    turn = itertools.count()
    return bench_utils.graph_time_ms(
        lambda: fn(weights[next(turn) % len(weights)]), calls=calls, repeat=repeat
    )


def check_against_cublas(case: Case, cublas: Callable, fns: dict[str, Callable]) -> None:
    want = cublas(case.weights[0]).float()
    for name, fn in fns.items():
        got = fn(case.weights[0]).float()
        err = ((got - want).norm() / want.norm().clamp(min=1e-30)).item()
        if not err < 2e-2:
            raise AssertionError(f"{name} differs from cuBLASLt: relative error {err:.3g}")


def cublas_supports_fast_accum() -> bool:
    case = make_case(16, LinearShape("probe", "probe", 256, 256))
    try:
        cublas_fn(case, fast_accum=True)(case.weights[0])
        return True
    except RuntimeError:
        return False


def geomean(values: list[float]) -> float:
    return math.exp(sum(math.log(v) for v in values) / len(values))


def run_comparison(args: argparse.Namespace) -> list[dict]:
    fast_accum = cublas_supports_fast_accum()
    print(f"cuBLASLt use_fast_accum={fast_accum}", file=sys.stderr)
    rows = []
    for shape in SHAPES:
        for m in args.m:
            case = make_case(m, shape)
            cublas = cublas_fn(case, fast_accum)
            ours, block = ours_fn(case), block_fn(case)
            check_against_cublas(case, cublas, {"ours": ours})
            t_ours = graph_time_ms(ours, case.weights, args.calls, args.repeat)
            t_cublas = graph_time_ms(cublas, case.weights, args.calls, args.repeat)
            t_block = graph_time_ms(block, case.weights, args.calls, args.repeat)
            row = {
                "model": shape.model,
                "layer": shape.layer,
                "m": m,
                "n": shape.n,
                "k": shape.k,
                "config": (
                    "triton"
                    if fp8_launch.prefers_fp8_skinny("channel", m, shape.n, shape.k)
                    else fp8_cutlass.scaled_mm_config(m, shape.n, shape.k)
                ),
                "ours": case.flops / (t_ours * 1e-3) / 1e12,
                "cublas": case.flops / (t_cublas * 1e-3) / 1e12,
                "block": case.flops / (t_block * 1e-3) / 1e12,
                "us": t_ours * 1e3,
            }
            row["ratio"] = row["ours"] / row["cublas"]
            row["block_ratio"] = row["block"] / row["ours"]
            rows.append(row)
            print(format_row(row), file=sys.stderr, flush=True)
            del case
            torch.cuda.empty_cache()
    return rows


HEADER = (
    "| model | layer | M | N | K | cfg | ours TFLOP/s | cuBLASLt TFLOP/s | ours/cuBLASLt "
    "| block TFLOP/s | block/ours | ours us |"
)


def format_row(r: dict) -> str:
    return (
        f"| {r['model']} | {r['layer']} | {r['m']} | {r['n']} | {r['k']} | {r['config']} "
        f"| {r['ours']:.1f} | {r['cublas']:.1f} | {r['ratio']:.3f} | {r['block']:.1f} "
        f"| {r['block_ratio']:.3f} | {r['us']:.1f} |"
    )


def summary(rows: list[dict]) -> str:
    ratios = [r["ratio"] for r in rows]
    block_ratios = [r["block_ratio"] for r in rows]
    worst = min(rows, key=lambda r: r["ratio"])
    lines = [
        (
            f"- ours/cuBLASLt geometric mean: {geomean(ratios):.3f} (goal >= 1.0); worst "
            f"{worst['ratio']:.3f} at {worst['model']} {worst['layer']} M={worst['m']} "
            "(goal >= 0.9)"
        ),
        (
            f"- block-scaled/ours geometric mean: {geomean(block_ratios):.3f} (goal >= 0.8); "
            f"worst {min(block_ratios):.3f}"
        ),
    ]
    by_m = {}
    for r in rows:
        by_m.setdefault(r["m"], []).append(r["ratio"])
    lines.append(
        "- ours/cuBLASLt by M: "
        + ", ".join(f"{m}: {geomean(v):.3f}" for m, v in sorted(by_m.items()))
    )
    return "\n".join(lines)


def run_tune(args: argparse.Namespace) -> None:
    """Times every tile configuration for each M over all shapes; prints the best per M."""
    num_configs = fp8_cutlass.NUM_SCALED_MM_CONFIGS
    best_table = []
    print("| M | " + " | ".join(f"cfg {c}" for c in range(num_configs)) + " | best |")
    print("|---" * (num_configs + 2) + "|")
    per_shape_lines = []
    shape_entries: dict[tuple[float, int, int], int] = {}
    for m in args.m:
        per_config: dict[int, list[float]] = {c: [] for c in range(num_configs)}
        for shape in SHAPES:
            case = make_case(m, shape)
            for config in range(num_configs):
                t = graph_time_ms(ours_fn(case, config), case.weights, args.calls, args.repeat)
                per_config[config].append(case.flops / (t * 1e-3) / 1e12)
            del case
            torch.cuda.empty_cache()
        means = {c: geomean(v) for c, v in per_config.items()}
        best = max(means, key=means.get)
        best_table.append((m, best))
        cells = " | ".join(f"{means[c]:.1f}" for c in range(num_configs))
        print(f"| {m} | {cells} | {best} |", flush=True)
        # Shapes the current table serves worst: where another config wins by more than 5%.
        for i, shape in enumerate(SHAPES):
            current = fp8_cutlass.scaled_mm_config(m, shape.n, shape.k)
            rates = {c: per_config[c][i] for c in range(num_configs)}
            top = max(rates, key=rates.get)
            if rates[top] > 1.05 * rates[current]:
                bound = next(b for b, _ in fp8_cutlass.SCALED_MM_DISPATCH if m <= b)
                shape_entries.setdefault((bound, shape.n, shape.k), top)
                per_shape_lines.append(
                    f"  {shape.model} {shape.layer} M={m} (N={shape.n}, K={shape.k}): cfg {top} "
                    f"{rates[top]:.1f} TFLOP/s vs the table's cfg {current} {rates[current]:.1f}"
                )
    print("\nGeometric-mean TFLOP/s over the Llama-3-8B/70B shapes. Best configuration by M:")
    print("SCALED_MM_DISPATCH = (")
    for m, best in best_table:
        print(f"    ({m}, {best}),")
    print(")  # the last bucket's bound becomes math.inf")
    print("\nShapes where another configuration beats the current table's by > 5%:")
    print("\n".join(per_shape_lines) or "  none")
    if args.json:  # the first M measured in a bucket decides its entry
        rows = [["inf" if math.isinf(b) else b, n, k, c] for (b, n, k), c in shape_entries.items()]
        bench_utils.write_gemm_tables(args.json, "fp8", rows)
        print(f"wrote {len(rows)} SCALED_MM_SHAPE_CONFIGS entries to {args.json}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--m", type=int, nargs="+", default=list(M_VALUES))
    parser.add_argument("--calls", type=int, default=20, help="launches per CUDA graph")
    parser.add_argument("--repeat", type=int, default=10)
    parser.add_argument("--tune", action="store_true", help="time every tile configuration")
    parser.add_argument(
        "--json",
        help="with --tune: write the per-shape entries that beat the table by > 5%% to this file "
        "(latency.py --gemm-tables reads it)",
    )
    parser.add_argument("--markdown", action="store_true", help="print a RESULTS.md table")
    parser.add_argument(
        "--gemm-tables",
        help="a write_gemm_tables file (sweep_skinny_gemm.py --json, --tune --json) whose "
        "entries the ops take in this run: the comparison before they are committed",
    )
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU (sm_90)")
    if args.gemm_tables:
        print(bench_utils.apply_gemm_tables(args.gemm_tables), flush=True)
    torch.backends.cuda.matmul.allow_tf32 = False
    if args.tune:
        run_tune(args)
        return
    rows = run_comparison(args)
    table = "\n".join([HEADER, "|---" * 12 + "|"] + [format_row(r) for r in rows])
    text = f"{table}\n\n{summary(rows)}"
    if args.markdown:
        print(
            "Per-token x per-channel FP8 GEMM (bf16 out) vs `torch._scaled_mm` (cuBLASLt, "
            "row-wise scales), timed inside CUDA graphs with rotating weights; block = "
            "block-scaled (1x128 / 128x128) GEMM.\n"
        )
    print(text)


if __name__ == "__main__":
    main()
