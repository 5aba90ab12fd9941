"""Greedy sampling's argmax: torch.argmax against the one-launch Triton kernel
(kernels/triton_argmax.py) over [rows, vocab] logits, each timed inside a CUDA graph of 10 calls
(host launch work excluded, as the sampler's kernels run back to back on the device).

    python benchmarks/benchmark_argmax.py --rows 1,8,32,64,256 --vocab 128256

The sampler (sample/sampler.py `row_argmax`) takes the Triton kernel for the row counts where it
is faster; this prints the figures that choice rests on.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from v1_engine.kernels.triton_argmax import row_argmax


def graph_us(fn) -> float:
    fn()  # compile and allocate outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(10):
            fn()
    return triton.testing.do_bench(graph.replay, warmup=5, rep=50) * 1e3 / 10


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="1,2,4,8,16,32,64,128,256")
    parser.add_argument("--vocab", type=int, default=128256)
    parser.add_argument("--dtypes", default="bfloat16,float32")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("benchmark_argmax.py needs a CUDA GPU")
    torch.manual_seed(0)
    print("| dtype | rows | torch.argmax us | Triton row_argmax us | torch / Triton |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for dtype_name in args.dtypes.split(","):
        dtype = getattr(torch, dtype_name)
        for rows in (int(r) for r in args.rows.split(",") if r):
            x = torch.randn(rows, args.vocab, device="cuda").to(dtype)
            if not torch.equal(row_argmax(x), x.argmax(dim=-1)):
                raise SystemExit(f"row_argmax differs from torch.argmax at {rows} x {dtype}")
            ours = graph_us(lambda x=x: row_argmax(x))
            ref = graph_us(lambda x=x: x.argmax(dim=-1))
            print(f"| {dtype_name} | {rows} | {ref:.1f} | {ours:.1f} | {ref / ours:.2f} |")


if __name__ == "__main__":
    main()
