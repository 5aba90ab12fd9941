"""The persistent fused MLP kernel (kernels/triton_mlp.py) against the unfused chain a decode step
runs today (gated gate_up GEMM or GEMM + SiLU-and-mul, the down GEMM, the add + RMSNorm).

For each M in --m: --layers MLPs of the Llama-3-8B shape, each with its own weights (so none is
served from L2), chained as a decode step chains them (each layer's normed output and residual
feed the next), captured in one CUDA graph and replayed under do_bench; us a layer for the chain
and for each candidate launch of the fused kernel (outputs checked against the chain first).
"of HBM" is the layer's weight bytes over 4.29 TB/s against the time. Prints a markdown table
and the TUNED_LAUNCH entries (kernels/triton_mlp.py) where the fused kernel won by 2% or more.

    python benchmarks/benchmark_fused_mlp.py
    python benchmarks/benchmark_fused_mlp.py --m 64 --launches '[{"block_n1": 16}]'
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
import triton
from bench_utils import HBM_BYTES_PER_S, write_gemm_tables

from v1_engine.kernels import triton_mlp
from v1_engine.kernels.skinny_epilogues import silu_mul_linear_cuda
from v1_engine.kernels.skinny_linear_op import skinny_linear_cuda
from v1_engine.kernels.triton_fused import add_rms_norm

HIDDEN, INTERMEDIATE = 4096, 14336
EPS = 1e-5


def _fma(block_n: int, block_k: int, **extra: int | str) -> dict[str, int | str]:
    """A decode launch: the fma body with one tile shape for the gated items and the down
    partials, `extra` keys over it."""
    both = {"block_n1": block_n, "block_k1": block_k, "block_n2": block_n, "block_k2": block_k}
    return {"mode1": "fma", "mode2": "fma", **both, **extra}


CANDIDATES = {
    "large": [  # M 17-64
        {},
        {"per_sm": 1},
        {"per_sm": 3, "stages1": 2, "stages2": 2},
        {"split2": 2},
        {"split2": 8},
        {"block_n1": 64},
        {"stages1": 4, "stages2": 4, "per_sm": 1},
        {"num_warps": 8},
        {"mode1": "dot_swap", "block_n1": 64},
        {"block_k1": 64, "block_k2": 64, "stages1": 4, "stages2": 4},
    ],
    "decode": [  # M 1-4: the fma body in both phases, as the unfused chain runs batch 1
        _fma(8, 512, split2=4),
        _fma(16, 256, split2=4),
        _fma(16, 256, split2=8, per_sm=3),
        _fma(32, 128, split2=2),
        # No tensor-core phase here: it pads the rows to 16 for both phases, and the fma body's
        # [16, N, K] accumulator spills (an fma + dot_swap launch ran 50x slower, H100).
    ],
    "small": [  # M 5-16
        {"mode1": "dot_swap", "block_n1": 64},
        {"mode1": "dot_swap", "block_n1": 64, "per_sm": 3, "stages1": 2, "stages2": 2},
        {"mode1": "dot_swap", "block_n1": 32},
        {"mode1": "dot_swap", "block_n1": 64, "block_k1": 256, "block_k2": 256},
        {"mode1": "dot_swap", "block_n1": 64, "split2": 8},
    ],
}


def chain(x, w_gate_up, w_down, residual, norm_w):
    h = silu_mul_linear_cuda(x, w_gate_up)
    return add_rms_norm(skinny_linear_cuda(h, w_down), residual, norm_w, EPS)


def graph_us_per_layer(step, layers: int) -> float:
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    ms = triton.testing.do_bench(graph.replay, warmup=5, rep=40)
    del graph
    return ms * 1e3 / layers


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--m", default="64,32,16,8,1", help="comma-separated row counts")
    parser.add_argument("--layers", type=int, default=8, help="MLPs chained in the graph")
    parser.add_argument("--launches", default=None, help="JSON list of launch overrides")
    parser.add_argument(
        "--json",
        default=None,
        help="write the winning entries (kind fused_mlp) to this table file, for latency.py "
        "--gemm-tables",
    )
    args = parser.parse_args()

    layers = []
    for _ in range(args.layers):
        w_gate_up = torch.randn(2 * INTERMEDIATE, HIDDEN, device="cuda", dtype=torch.bfloat16)
        w_down = torch.randn(HIDDEN, INTERMEDIATE, device="cuda", dtype=torch.bfloat16)
        layers.append((w_gate_up * HIDDEN**-0.5, w_down * INTERMEDIATE**-0.5))
    norm_w = torch.ones(HIDDEN, device="cuda", dtype=torch.bfloat16)
    weight_bytes = 2 * (2 * INTERMEDIATE * HIDDEN + HIDDEN * INTERMEDIATE)
    roofline_us = weight_bytes / HBM_BYTES_PER_S * 1e6

    rows, tuned = [], {}
    for m in [int(v) for v in args.m.split(",") if v]:
        x = torch.randn(m, HIDDEN, device="cuda", dtype=torch.bfloat16)
        residual = torch.randn(m, HIDDEN, device="cuda", dtype=torch.bfloat16)

        def run(fn, x=x, residual=residual):
            h, r = x, residual
            for w_gate_up, w_down in layers:
                h, r = fn(h, w_gate_up, w_down, r, norm_w)
            return h, r

        reference = run(chain)
        chain_us = graph_us_per_layer(lambda: run(chain), args.layers)
        rows.append((m, "unfused chain", chain_us))
        print(f"M={m} chain {chain_us:.1f} us/layer", flush=True)
        if args.launches:
            candidates = json.loads(args.launches)
        else:
            candidates = CANDIDATES["large" if m > 16 else "small" if m > 4 else "decode"]
        best = None
        for launch in candidates:

            def fused(h, w_gate_up, w_down, r, nw, launch=launch):
                return triton_mlp.fused_mlp_add_rms_norm(h, w_gate_up, w_down, r, nw, EPS,
                                                         **launch)  # fmt: skip

            try:
                got = run(fused)
                torch.cuda.synchronize()
            except Exception as exc:  # noqa: BLE001 - a launch that does not compile: go on
                print(f"M={m} {launch}: failed: {exc!r}"[:300], flush=True)
                continue
            err = max((g.float() - e.float()).abs().amax().item() for g, e in zip(got, reference))
            scale = max(e.float().abs().amax().item() for e in reference)
            if err > 0.05 * max(scale, 1.0):
                print(f"M={m} {launch}: wrong (max error {err} at scale {scale})", flush=True)
                continue
            us = graph_us_per_layer(lambda: run(fused), args.layers)
            label = json.dumps(launch) if launch else "default"
            rows.append((m, label, us))
            print(f"M={m} {label} {us:.1f} us/layer (max diff to chain {err:.3g})", flush=True)
            if best is None or us < best[1]:
                best = (launch, us)
        if best is not None and best[1] <= 0.98 * chain_us:
            config = triton_mlp.resolve_launch(m, INTERMEDIATE, HIDDEN, HIDDEN, best[0])
            tuned[(triton_mlp.m_bucket(m), INTERMEDIATE, HIDDEN)] = config

    print(f"\nLlama-3-8B MLP + add + RMSNorm, {args.layers} layers chained in a CUDA graph; weight "
          f"bytes {weight_bytes / 1e6:.0f} MB a layer = {roofline_us:.1f} us at "
          f"{HBM_BYTES_PER_S / 1e12:.2f} TB/s\n")  # fmt: skip
    print("| M | kernel | us a layer | of HBM | chain / this |")
    print("| ---: | --- | ---: | ---: | ---: |")
    chain_by_m = {m: us for m, label, us in rows if label == "unfused chain"}
    for m, label, us in rows:
        print(f"| {m} | {label} | {us:.1f} | {roofline_us / us:.2f} | {chain_by_m[m] / us:.3f} |")
    print("\nTUNED_LAUNCH entries (fused at least 2% faster):")
    for key, config in tuned.items():
        print(f"    {key}: {config},")
    if args.json:
        write_gemm_tables(args.json, "fused_mlp", [[*key, config] for key, config in tuned.items()])
        print(f"wrote {len(tuned)} entries to {args.json}")


if __name__ == "__main__":
    main()
