"""Does pulling the next GEMM's weight into L2 during a decode step's short kernels pay?

A chain shaped like batch-1 decode layers, captured in one CUDA graph (PDL on as in the engine):
qkv GEMM -> paged attention over a short context -> o_proj GEMM -> add + RMSNorm, 32 layers of
distinct weights. Variants add `l2_prefetch` of o_proj's weight after the qkv GEMM (it runs
during the attention) and of the next layer's qkv weight after o_proj (during the norm), with a
cap on the bytes each asks for. bf16 uses the skinny GEMM; `--fp8` the per-token x per-channel
FP8 GEMM with its activation quant. Prints us per layer for each (attention cap, norm cap).

    python benchmarks/l2_prefetch_probe.py --caps-mb 0,8,16,24,32 --norm-caps-mb 0,4,8
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from v1_engine.kernels.fp8 import per_token_fp8_quant, scaled_mm
from v1_engine.kernels.l2_prefetch import l2_prefetch
from v1_engine.kernels.triton_attention import paged_attention
from v1_engine.kernels.triton_fused import add_rms_norm
from v1_engine.kernels.triton_gemv import skinny_gemm

MB = 1 << 20


def build(layers: int, fp8: bool, context: int, block: int = 16):
    dev = torch.device("cuda")
    hidden, heads, kv_heads, head = 4096, 32, 8, 128
    qkv_n = (heads + 2 * kv_heads) * head

    def weight(n, k):
        w = torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02
        if not fp8:
            return w, None
        scale = w.abs().amax(dim=1, keepdim=True).float() / 448.0
        return (w / scale).to(torch.float8_e4m3fn), scale

    wqkv = [weight(qkv_n, hidden) for _ in range(layers)]
    wo = [weight(hidden, heads * head) for _ in range(layers)]
    blocks = -(-context // block)
    caches = [
        torch.randn(2, blocks, block, kv_heads, head, device=dev, dtype=torch.bfloat16)
        for _ in range(layers)
    ]
    table = torch.arange(blocks, device=dev, dtype=torch.int32).view(1, -1)
    seq_lens = torch.tensor([context], device=dev, dtype=torch.int32)
    qsl = torch.tensor([0, 1], device=dev, dtype=torch.int32)
    norm_w = torch.ones(hidden, device=dev, dtype=torch.bfloat16)
    h0 = torch.randn(1, hidden, device=dev, dtype=torch.bfloat16)
    res0 = torch.randn(1, hidden, device=dev, dtype=torch.bfloat16)

    def linear(x, w):
        if not fp8:
            return skinny_gemm(x, w[0])
        q, s = per_token_fp8_quant(x)
        return scaled_mm(q, w[0], s, w[1], torch.bfloat16)

    def step(cap_attn: int, cap_norm: int):
        h, res = h0, res0
        for i in range(layers):
            qkv = linear(h, wqkv[i])
            if cap_attn:
                l2_prefetch(wo[i][0], cap_attn)
            q = qkv[:, : heads * head].view(1, heads, head)
            out = torch.empty(1, heads, head, device=dev, dtype=torch.bfloat16)
            paged_attention(q, caches[i], table, seq_lens, qsl, 1, context, head**-0.5, out)
            o = linear(out.view(1, -1), wo[i])
            if cap_norm and i + 1 < layers:
                l2_prefetch(wqkv[i + 1][0], cap_norm)
            h, res = add_rms_norm(o, res, norm_w, 1e-5)
        return h

    return step


def time_graph(fn, iters: int) -> float:
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = float("inf")
    for _ in range(5):
        start.record()
        for _ in range(iters):
            graph.replay()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / iters)
    return best * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--caps-mb", default="0,8,16,24,32")
    parser.add_argument("--norm-caps-mb", default="0,4,8")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--fp8", action="store_true")
    args = parser.parse_args()
    step = build(args.layers, args.fp8, args.context)
    kind = "FP8" if args.fp8 else "bf16"
    print(f"{kind}, {args.layers} layers, context {args.context}: us per layer")
    print("| attention cap MB | norm cap MB | us/layer |")
    print("| ---: | ---: | ---: |")
    for cap in [int(c) for c in args.caps_mb.split(",")]:
        for ncap in [int(c) for c in args.norm_caps_mb.split(",")]:
            us = time_graph(lambda: step(cap * MB, ncap * MB), args.iters) / args.layers
            print(f"| {cap} | {ncap} | {us:.2f} |", flush=True)


if __name__ == "__main__":
    main()
