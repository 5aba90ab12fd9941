"""Does a decode GEMV run faster on weights fetched into L2 while the GPU waits on something else?

At batch 1 a decoder layer's attention and split-KV merge take several microseconds in which HBM
is idle; the o_proj GEMV after them streams its whole weight from HBM. This probe replays, in one
CUDA graph over LAYERS distinct weight sets (so L2 holds nothing from the previous replay), the
layer's shape of work:

    gate_up (the FP8 gated GEMV: streams 117 MB, flushing L2) -> [prefetch o_proj's weight]
    -> spin (stands for attention + merge) -> o_proj

and the same without o_proj, and reports us a layer. o_proj cold = A - C, warm = B - D; the
engine-relevant figure is A - B (what the prefetch would save a layer). `--prefetch bulk`
issues `cp.async.bulk.prefetch.L2` (no SM work), `touch` loads the weight once with an L2
evict_last hint (the SMs read it).

    python benchmarks/benchmark_l2_prefetch.py [--spin-us 6] [--dtype fp8|bf16]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench_utils import graph_time_ms

from v1_engine.kernels import fp8
from v1_engine.kernels import triton_gemv_fp8_decode as decode
from v1_engine.kernels.triton_gemv import skinny_gemm

LANES = 32
"""Addresses a prefetch program issues (one a thread of its one warp)."""


@triton.jit
def _bulk_prefetch_kernel(ptr, nbytes, LANE_BYTES: tl.constexpr, LANES: tl.constexpr):
    lane = tl.arange(0, LANES)
    start = (tl.program_id(0) * LANES + lane).to(tl.int64) * LANE_BYTES
    size = tl.minimum(tl.maximum(nbytes - start, 0), LANE_BYTES).to(tl.int32)
    tl.inline_asm_elementwise(
        "{ .reg .pred p; setp.gt.s32 p, $2, 0; "
        "@p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
        "=r,l,r",
        [ptr + start, size],
        dtype=tl.int32,
        is_pure=False,
        pack=1,
    )


@triton.jit
def _touch_kernel(ptr, sink_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    v = tl.load(ptr + offs, mask=offs < n, other=0, eviction_policy="evict_last")
    # Nothing of the values matters; one store the compiler cannot drop.
    tl.store(sink_ptr + tl.program_id(0), tl.sum(v.to(tl.int32), axis=0))


def prefetch(weight: torch.Tensor, how: str, sink: torch.Tensor, lane_bytes: int) -> None:
    raw = weight.view(torch.uint8).reshape(-1)
    if how == "bulk":
        grid = triton.cdiv(raw.numel(), LANES * lane_bytes)
        _bulk_prefetch_kernel[(grid,)](raw, raw.numel(), LANE_BYTES=lane_bytes, LANES=LANES,
                                       num_warps=1)  # fmt: skip
    else:
        block = 16384
        words = raw.view(torch.int32)
        _touch_kernel[(triton.cdiv(words.numel(), block),)](words, sink, words.numel(),
                                                            BLOCK=block, num_warps=8)  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--spin-us", type=float, default=6.0)
    parser.add_argument("--dtype", choices=["fp8", "bf16"], default="fp8")
    parser.add_argument("--prefetch", choices=["bulk", "touch"], nargs="+", default=["bulk"])
    parser.add_argument("--lane-kb", type=int, nargs="+", default=[64])
    args = parser.parse_args()
    dev = torch.device("cuda")
    clock_mhz = torch.cuda.get_device_properties(dev).clock_rate / 1000
    cycles = int(args.spin_us * clock_mhz)
    hidden, inter = 4096, 14336
    torch.manual_seed(0)
    x = torch.randn(1, hidden, device=dev, dtype=torch.bfloat16)
    a8, scale_a = fp8.per_token_fp8_quant_ref(x)
    layers = []
    for _ in range(args.layers):
        gu, gu_scale = fp8.per_token_fp8_quant_ref(
            torch.randn(2 * inter, hidden, device=dev, dtype=torch.bfloat16) * 0.05
        )
        o_bf16 = torch.randn(hidden, hidden, device=dev, dtype=torch.bfloat16) * 0.05
        o8, o_scale = fp8.per_token_fp8_quant_ref(o_bf16)
        layers.append((gu, gu_scale, o8, o_scale, o_bf16))
    sink = torch.zeros(1 << 16, dtype=torch.int32, device=dev)

    def o_proj(layer):
        if args.dtype == "fp8":
            decode.fp8_weight_only_gemm(x, layer[2], layer[3])
        else:
            skinny_gemm(x, layer[4])

    def run(with_prefetch: str | None, lane_bytes: int, with_o: bool):
        def fn():
            for layer in layers:
                decode.fp8_gated_gemm(a8, layer[0], scale_a, layer[1], torch.bfloat16)
                if with_prefetch:
                    w = layer[2] if args.dtype == "fp8" else layer[4]
                    prefetch(w, with_prefetch, sink, lane_bytes)
                torch.cuda._sleep(cycles)
                if with_o:
                    o_proj(layer)

        return graph_time_ms(fn, calls=4, repeat=20) * 1000 / args.layers

    print(f"{torch.cuda.get_device_name(dev)}; o_proj {args.dtype}, spin {args.spin_us} us "
          f"({cycles} cycles); us a layer")  # fmt: skip
    print("| prefetch | lane KB | A: gu, spin, o | B: gu, pf, spin, o | C: gu, spin | D: gu, pf, spin "
          "| o cold (A-C) | o warm (B-D) | A - B |")  # fmt: skip
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for how in args.prefetch:
        for kb in args.lane_kb if how == "bulk" else [0]:
            a = run(None, 0, True)
            b = run(how, kb * 1024, True)
            c = run(None, 0, False)
            d = run(how, kb * 1024, False)
            print(f"| {how} | {kb} | {a:.2f} | {b:.2f} | {c:.2f} | {d:.2f} | {a - c:.2f} | "
                  f"{b - d:.2f} | {a - b:.2f} |")  # fmt: skip


if __name__ == "__main__":
    main()
