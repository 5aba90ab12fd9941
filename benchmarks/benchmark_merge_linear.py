"""Decode attention's split-KV merge and the FP8 o_proj in one launch
(kernels/triton_merge_linear.py) against the two chains it would replace, on Llama-3-8B's o_proj
(32 heads of 128, N = K = 4096) at batch-1 decode, where paged attention splits a short context
into 32 pieces:

- "chain": the merge kernel, the per-token quant of the attention output, the FP8 GEMM
  (`fp8.scaled_mm`: the tuned skinny kernel at M = 1), as the engine runs o_proj by default;
- "chain, weight-only": the merge kernel, then `fp8_weight_only_gemm` on the bf16 attention
  output (the opt-in fp8_dynamic_linear pass);
- "fused": `merge_linear` (DEFAULT_LAUNCH; `--sweep` also times every chunk x block_n x stages x warps).

Each variant runs CALLS times in one CUDA graph over WEIGHT_COPIES weight copies (more bytes than
L2 holds) and as many sets of partials, PDL as in the engine; us a call, the median of 10 replays
(bench_utils.graph_time_ms).

    python benchmarks/benchmark_merge_linear.py [--tokens 1] [--splits 32] [--sweep]

Only the kernels: an engine A/B needs the op wired in behind a pass first.
"""

from __future__ import annotations

import argparse
import itertools

import torch
from bench_utils import graph_time_ms

from v1_engine.kernels import fp8, triton_merge_linear
from v1_engine.kernels.triton_gemv_fp8 import FP8_DTYPE
from v1_engine.kernels.triton_gemv_fp8_decode import fp8_weight_only_gemm
from v1_engine.kernels.triton_split_kv import merge_pieces

HEADS, HEAD_SIZE, N = 32, 128, 4096
CALLS = 16
WEIGHT_COPIES = 8


def operands(tokens: int, splits: int, seed: int) -> dict:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    part_out = torch.randn((tokens, HEADS, splits, HEAD_SIZE), generator=gen, device="cuda")
    part_max = 3.0 * torch.randn((tokens, HEADS, splits), generator=gen, device="cuda")
    part_sum = 0.5 + 4.0 * torch.rand((tokens, HEADS, splits), generator=gen, device="cuda")
    b = (64.0 * torch.randn((N, HEADS * HEAD_SIZE), generator=gen, device="cuda")).clamp(-448, 448)
    scale = (0.5 + torch.rand((N, 1), generator=gen, device="cuda")) / 256.0
    return {
        "part_out": part_out,
        "part_max": part_max,
        "part_sum": part_sum,
        "b": b.to(FP8_DTYPE),
        "scale": scale,
        "attention": torch.empty((tokens, HEADS, HEAD_SIZE), dtype=torch.bfloat16, device="cuda"),
    }


def chain(ops: dict) -> torch.Tensor:
    merge_pieces(ops["attention"], ops["part_out"], ops["part_max"], ops["part_sum"],
                 ops["part_out"].shape[2])  # fmt: skip
    a8, scale_a = fp8.per_token_fp8_quant(ops["attention"].reshape(ops["attention"].shape[0], -1))
    return fp8.scaled_mm(a8, ops["b"], scale_a, ops["scale"], torch.bfloat16)


def chain_weight_only(ops: dict) -> torch.Tensor:
    merge_pieces(ops["attention"], ops["part_out"], ops["part_max"], ops["part_sum"],
                 ops["part_out"].shape[2])  # fmt: skip
    x = ops["attention"].reshape(ops["attention"].shape[0], -1)
    return fp8_weight_only_gemm(x, ops["b"], ops["scale"].reshape(-1))


def fused(ops: dict, **launch: int) -> torch.Tensor:
    return triton_merge_linear.merge_linear(
        ops["part_out"], ops["part_max"], ops["part_sum"], HEAD_SIZE, ops["b"],
        ops["scale"].reshape(-1), torch.bfloat16, **launch,
    )  # fmt: skip


def graph_us(call, copies: list[dict]) -> float:
    """Device microseconds per call, CALLS calls over the copies in turn in one CUDA graph."""
    turn = itertools.cycle(copies)
    return 1e3 * graph_time_ms(lambda: call(next(turn)), calls=CALLS)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=1)
    parser.add_argument("--splits", type=int, default=32)
    parser.add_argument("--sweep", action="store_true", help="also every fused launch")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("benchmark_merge_linear.py needs a CUDA GPU")
    copies = [operands(args.tokens, args.splits, seed) for seed in range(WEIGHT_COPIES)]
    first = copies[0]
    got = fused(first)
    want = triton_merge_linear.merge_linear_reference(
        first["part_out"], first["part_max"], first["part_sum"], HEAD_SIZE, first["b"],
        first["scale"].reshape(-1), torch.bfloat16,
    )  # fmt: skip
    error = ((got.float() - want.float()).abs().max() / want.float().abs().max()).item()
    print(f"fused vs reference: max error {error:.2e} of the output's largest value", flush=True)

    weight_bytes = N * HEADS * HEAD_SIZE
    rows = [("chain (merge, quant, scaled_mm)", chain), ("chain, weight-only", chain_weight_only),
            ("fused, default launch", fused)]  # fmt: skip
    if args.sweep:
        grid = itertools.product((128, 256, 512, 1024), (32, 64), (2, 4), (4, 8))
        for chunk, block_n, stages, warps in grid:
            if block_n <= chunk:
                launch = {"chunk": chunk, "block_n": block_n, "stages": stages, "num_warps": warps}
                rows.append((f"fused {launch}", lambda ops, launch=launch: fused(ops, **launch)))
    print(
        f"| variant | us a call | weight bytes / s |  (tokens {args.tokens}, {args.splits} pieces)"
    )
    print("| --- | ---: | ---: |")
    for name, call in rows:
        us = graph_us(call, copies)
        print(f"| {name} | {us:.2f} | {weight_bytes / (us * 1e-6) / 1e12:.2f} TB/s |", flush=True)


if __name__ == "__main__":
    main()
