"""Launch-configuration sweep of the Triton MLA decode kernel (kernels/triton_mla.py).

For each head count, times every combination of heads per program, cached tokens per loop
step, pipeline stages, warps and split-KV factor at batch x context (default 64 x 4096, block
size 64, bf16) and prints the fastest, as achieved bandwidth on the latent bytes the kernel must
read. `launch_config` in triton_mla.py is set from this. Each head count gets a time budget
(compiling a configuration takes about a second); the most promising ranges come first.

    python benchmarks/sweep_mla.py --heads 16,128 --seconds 70
"""

from __future__ import annotations

import argparse
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

from v1_engine.kernels.triton_mla import launch_config, mla_decode, mla_decode_bytes

RANK, ROPE = 512, 64


def sweep(heads: int, batch: int, context: int, block_size: int, seconds: float) -> None:
    num_blocks = batch * context // block_size
    cache = torch.randn(num_blocks, block_size, RANK + ROPE, device="cuda", dtype=torch.bfloat16)
    table = torch.randperm(num_blocks, device="cuda", dtype=torch.int32).reshape(batch, -1)
    lens = torch.full((batch,), context, device="cuda", dtype=torch.int32)
    starts = torch.arange(batch + 1, device="cuda", dtype=torch.int32)
    q_nope = torch.randn(batch, heads, RANK, device="cuda", dtype=torch.bfloat16)
    q_pe = torch.randn(batch, heads, ROPE, device="cuda", dtype=torch.bfloat16)
    out = torch.empty(batch, heads, RANK, device="cuda", dtype=torch.bfloat16)
    nbytes = mla_decode_bytes([context] * batch, RANK, ROPE, 2)

    def rate(**launch) -> float:
        def run() -> None:
            mla_decode(q_nope, q_pe, cache, table, lens, starts, context, 0.1, out, **launch)

        return nbytes / (triton.testing.do_bench(run, warmup=5, rep=20) * 1e-3)

    default = launch_config(heads, dot_f32=False)
    results = [(rate(), "default", default)]
    head_tiles = (16,) if heads <= 16 else (64, 32, 16)
    space = itertools.product(head_tiles, (64, 32, 128), (2, 1, 3), (8, 4), (None, 4, 16))
    start = time.perf_counter()
    for block_h, tile, stages, warps, splits in space:
        if time.perf_counter() - start > seconds:
            break
        launch = {"block_h": block_h, "tile": tile, "num_stages": stages}
        launch |= {"num_warps": warps, "num_splits": splits}
        try:
            results.append((rate(**launch), "", launch))
        except OutOfResources:  # shared memory or registers of this tile: skip it
            print(f"  skipped {launch}: out of resources", flush=True)
    results.sort(key=lambda r: r[0], reverse=True)
    print(f"heads {heads}, batch {batch} x {context}, block size {block_size}:", flush=True)
    for value, tag, launch in results[:8]:
        print(
            f"  {value / 1e12:.2f} TB/s ({value / HBM_BYTES_PER_S:.0%}) {tag} {launch}",
            flush=True,
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--heads", default="16,128")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--block-size", type=int, default=64)
    parser.add_argument("--seconds", type=float, default=70.0, help="budget per head count")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("sweep_mla.py needs a CUDA GPU")
    torch.manual_seed(0)
    for heads in (int(h) for h in args.heads.split(",") if h):
        sweep(heads, args.batch, args.context, args.block_size, args.seconds)


if __name__ == "__main__":
    main()
