"""Launch-configuration sweep of the paged decode attention kernel (kernels/triton_attention.py).

Times one decode step of attention (one query token per request) over a paged bf16 cache for
every combination of cached tokens per loop step, warps, pipeline stages and split-KV factor, and
prints the fastest as achieved bandwidth on the K/V bytes the kernel must read. The shape is the
Llama-3-8B one by default (32 query heads, 8 KV heads, head size 128, block size 16).
`launch_config` and the split rules in kernels/attention_launch.py are set from this.

    python benchmarks/sweep_attention.py --cases 64x1024,1x128,1x4096,256x1024 --seconds 40
    python benchmarks/sweep_attention.py --cases "" --prefill 4096 --seconds 60

`--baseline FILE` also times the default launch of another version of the kernel module in the
same run (an A/B of a kernel change), e.g. the committed one (the file imports the launch rules
of kernels/attention_launch.py from this tree, so a baseline from before a change to those
rules' names will not load):

    git show HEAD:v1_engine/kernels/triton_attention.py > /tmp/attention_head.py
    python benchmarks/sweep_attention.py --cases 1x128,64x1024 --seconds 0 \
        --baseline /tmp/attention_head.py

`--graph-len 4224` picks the decode launch (split-KV factor) for that context, as the engine's
CUDA graphs do for max_model_len, while the requests hold `context` tokens.
"""

from __future__ import annotations

import argparse
import importlib.util
import itertools
import sys
import time
from pathlib import Path

import torch
import triton
from triton.runtime.errors import OutOfResources

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench_utils import HBM_BYTES_PER_S

from v1_engine.kernels.triton_attention import paged_attention


def sweep_prefill(tokens: int, heads: int, kv_heads: int, head: int, block: int, seconds: float):
    """One causal prefill of `tokens` tokens (no cached context), as TFLOP/s."""
    num_blocks = -(-tokens // block)
    cache = torch.randn(2, num_blocks, block, kv_heads, head, device="cuda", dtype=torch.bfloat16)
    table = torch.arange(num_blocks, device="cuda", dtype=torch.int32).reshape(1, -1)
    lens = torch.tensor([tokens], device="cuda", dtype=torch.int32)
    starts = torch.tensor([0, tokens], device="cuda", dtype=torch.int32)
    query = torch.randn(tokens, heads, head, device="cuda", dtype=torch.bfloat16)
    out = torch.empty_like(query)
    flops = 4 * heads * head * tokens * (tokens + 1) / 2

    def time_us(**kwargs) -> float:
        def run() -> None:
            paged_attention(
                query, cache, table, lens, starts, tokens, tokens, head**-0.5, out, **kwargs
            )

        return triton.testing.do_bench(run, warmup=3, rep=30) * 1e3

    results = [(time_us(), "default", {})]
    space = itertools.product((128, 64), (64, 32, 128), (8, 4), (2, 3, 1, 4))
    start = time.perf_counter()
    for block_m, tile, warps, stages in space:
        if time.perf_counter() - start > seconds:
            break
        launch = {"block_m": block_m, "tile": tile, "num_warps": warps, "num_stages": stages}
        try:
            results.append((time_us(launch=launch), "", launch))
        except OutOfResources:
            continue
    results.sort(key=lambda r: r[0])
    print(f"prefill {tokens} tokens ({flops / 1e9:.0f} GFLOP):", flush=True)
    for us, tag, launch in results[:6]:
        print(f"  {us:8.1f} us {flops / us / 1e6:.0f} TFLOP/s {tag} {launch}", flush=True)


def load_baseline(path: str):
    """`paged_attention` of another version of triton_attention.py (a file path)."""
    spec = importlib.util.spec_from_file_location("baseline_triton_attention", path)
    if spec is None or spec.loader is None:
        raise SystemExit(f"--baseline {path!r} is not a Python file")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.paged_attention


def sweep(
    batch: int,
    context: int,
    heads: int,
    kv_heads: int,
    head: int,
    block: int,
    seconds: float,
    baseline=None,
    graph_len: int = 0,
    layout: str = "nhd",
    layers: int = 1,
) -> None:
    blocks_per_req = -(-context // block)
    num_blocks = batch * blocks_per_req
    caches = []
    for _ in range(layers):  # one cache per layer, as a forward reads them in turn
        if layout == "hnd":  # each kv head's page contiguous; the kernel reads it through strides
            cache = torch.randn(2, num_blocks, kv_heads, block, head, device="cuda").bfloat16()
            caches.append(cache.transpose(2, 3))
        else:
            caches.append(
                torch.randn(2, num_blocks, block, kv_heads, head, device="cuda").bfloat16()
            )
    cache = caches[0]
    table = torch.randperm(num_blocks, device="cuda", dtype=torch.int32).reshape(batch, -1)
    lens = torch.full((batch,), context, device="cuda", dtype=torch.int32)
    starts = torch.arange(batch + 1, device="cuda", dtype=torch.int32)
    query = torch.randn(batch, heads, head, device="cuda", dtype=torch.bfloat16)
    out = torch.empty_like(query)
    nbytes = batch * context * kv_heads * head * 2 * 2
    # A CUDA graph's launch is chosen for the longest context the graph serves (graph_len).
    max_seq_len = max(context, graph_len)

    def time_us(kernel=paged_attention, **kwargs) -> float:
        def run(cache: torch.Tensor = cache) -> None:
            kernel(query, cache, table, lens, starts, 1, max_seq_len, head**-0.5, out, **kwargs)

        # Inside a CUDA graph, as in serving (host launch work excluded).
        run()
        calls = max(10, layers)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for i in range(calls):
                run(caches[i % layers])
        return triton.testing.do_bench(graph.replay, warmup=5, rep=30) * 1e3 / calls

    default_us = time_us()
    results = [(default_us, "default", {})]
    if baseline is not None:
        results.append((time_us(kernel=baseline), "baseline", {}))
    # The default launch with its registers capped: a program's registers can decide how many
    # fit an SM (under Triton 3.6, 120 vs 145 a thread was 4 vs 3 programs: 70 vs 88 us at
    # 64 x 1k; benchmarks/RESULTS.md).
    for maxnreg in (96, 80):
        results.append((time_us(launch={"maxnreg": maxnreg}), "", {"maxnreg": maxnreg}))
    # Split-KV pieces merged in the launch or by a second kernel, whichever the default is not.
    for fused in (0, 1):
        launch = {"fused_merge": fused}
        results.append((time_us(launch=launch), "merge", launch))
    space = itertools.product((64, 32, 128, 16), (4, 8, 2), (2, 3, 1, 4), (None, 1, 2, 4, 8))
    start = time.perf_counter()
    for tile, warps, stages, splits in space:
        if time.perf_counter() - start > seconds:
            break
        launch = {"tile": tile, "num_warps": warps, "num_stages": stages}
        try:
            results.append((time_us(num_splits=splits, launch=launch), "", launch | {"s": splits}))
        except OutOfResources:
            continue
    results.sort(key=lambda r: r[0])
    graph = f", launch for {max_seq_len}" if max_seq_len > context else ""
    print(
        f"batch {batch} x context {context}{graph}, block {block}, {layout} cache x {layers} "
        f"({nbytes / 1e6:.0f} MB of K/V):",
        flush=True,
    )
    shown = results[:6] + [r for r in results[6:] if r[1]]  # the default and baseline always
    for us, tag, launch in shown:
        rate = nbytes / (us * 1e-6)
        print(
            f"  {us:8.1f} us {rate / 1e12:.2f} TB/s ({rate / HBM_BYTES_PER_S:.0%}) {tag} {launch}",
            flush=True,
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default="64x1024,1x128,1x4096,256x1024", help="batch x context")
    parser.add_argument("--prefill", default="", help="comma-separated prefill lengths")
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-size", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--seconds", type=float, default=40.0, help="budget per case")
    parser.add_argument(
        "--baseline", default=None, help="another triton_attention.py whose default is timed too"
    )
    parser.add_argument(
        "--graph-len",
        type=int,
        default=0,
        help="choose the decode launch for this context (a CUDA graph captured for max_model_len)",
    )
    parser.add_argument(
        "--layout",
        default="nhd",
        choices=("nhd", "hnd"),
        help="decode cache layout: [block, token, head, dim] (the engine's) or each kv head's "
        "page contiguous, [block, head, token, dim], read through strides",
    )
    parser.add_argument(
        "--layers",
        type=int,
        default=1,
        help="a cache per layer, each call of the graph reading the next (as a forward does)",
    )
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("sweep_attention.py needs a CUDA GPU")
    torch.manual_seed(0)
    for tokens in (int(t) for t in args.prefill.split(",") if t):
        sweep_prefill(
            tokens, args.heads, args.kv_heads, args.head_size, args.block_size, args.seconds
        )
    for case in (c for c in args.cases.split(",") if c):
        batch, context = (int(x) for x in case.split("x"))
        sweep(
            batch,
            context,
            args.heads,
            args.kv_heads,
            args.head_size,
            args.block_size,
            args.seconds,
            load_baseline(args.baseline) if args.baseline else None,
            args.graph_len,
            args.layout,
            args.layers,
        )


if __name__ == "__main__":
    main()
