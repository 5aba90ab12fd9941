"""Launch-configuration sweep of the skinny Triton GEMMs (kernels/triton_gemv.py, bf16, and
kernels/triton_gemv_fp8.py, FP8) against the kernels they replace.

For each Llama-3-8B linear shape and decode batch M, times the baseline (bf16: F.linear, i.e.
cuBLAS; `--fp8 channel`: the CUTLASS per-token x per-channel scaled_mm; `--fp8 block`: the
CUTLASS 1x128 / 128x128 block-scaled GEMM) and every launch config of the skinny kernel (body,
column tile, K step, warps, stages), each as 10 calls captured in one CUDA graph (how decode runs
them) and replayed under triton.testing.do_bench. The calls cycle over enough copies of the
weight that none is served from L2 (as consecutive layers are not). Every config's output is
checked before it is timed (against cuBLAS for bf16, the float32 reference for FP8). Prints the
baseline and the best config per shape and M as achieved weight bandwidth against the HBM
roofline, then the `TUNED_LAUNCH` table for kernels/skinny_tuned.py (`FP8_TUNED_LAUNCH[kind]`
for kernels/skinny_tuned_fp8.py; None where the baseline stays faster): the module's current
table with the swept (M bucket, N, K) entries replaced or added, so a sweep of some buckets (`--m 32,64`)
prints a table that keeps the others. `--shapes` takes the Llama-3-70B shapes by name too.

All configs are compiled first, in parallel processes (Triton's on-disk cache carries them over);
then each shape gets a time budget, most promising configs first.

    python benchmarks/sweep_skinny_gemm.py --seconds 20
    python benchmarks/sweep_skinny_gemm.py --fp8 channel --shapes qkv,o_proj,gate_up,down
    python benchmarks/sweep_skinny_gemm.py --m 32,64 --seconds 10
    python benchmarks/sweep_skinny_gemm.py --m 32,64 --split-k 2,4,8 --shapes qkv,o_proj,down
    python benchmarks/sweep_skinny_gemm.py --fp8 block --m 1,16,64 --split-k 2,4,8 \
        --shapes o_proj,down,o_proj_70b,down_70b

The FP8 decode kinds (fma body, M <= 4; `--json` gathers the entries of several sweeps in one
file for `latency.py --gemm-tables`):

    python benchmarks/sweep_skinny_gemm.py --fp8 channel --modes fma,wgmma --split-k 2,4 \
        --m 1,2,4 --shapes qkv,o_proj,gate_up,down --json fp8_decode.json
    python benchmarks/sweep_skinny_gemm.py --fp8 weight_only --m 1,2,4 \
        --shapes o_proj,down --json fp8_decode.json
    python benchmarks/sweep_skinny_gemm.py --fp8 gated --m 1,2,4 --shapes gate_up \
        --json fp8_decode.json

The "norm" kinds (the add + RMSNorm before the GEMM folded in; against the norm-quant kernel and
the GEMM the engine runs today):

    python benchmarks/sweep_skinny_gemm.py --fp8 norm --m 1 --shapes qkv --json fp8_decode.json
    python benchmarks/sweep_skinny_gemm.py --fp8 norm_gated --m 1 --shapes gate_up \
        --json fp8_decode.json

The block kind has an fma body too (M <= 4). Its table already holds dot_swap entries at those
M, so sweep both bodies (no --modes), or an fma-only sweep could replace a faster entry:

    python benchmarks/sweep_skinny_gemm.py --fp8 block --m 1,2,4 --split-k 2,4,8 \
        --shapes qkv,o_proj,gate_up,down,o_proj_70b,down_70b
"""

from __future__ import annotations

import argparse
import math
import multiprocessing
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path

import torch
import torch.nn.functional as F
import triton

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench_utils import HBM_BYTES_PER_S, read_gemm_tables, write_gemm_tables
from skinny_configs import (
    KINDS,
    NORM_KINDS,
    applies,
    element_bytes,
    sweep_configs,
)

from compile.passes.fused_ops import silu_and_mul_ref
from compile.passes.fused_quant_ops import add_rms_norm_quant_ref
from v1_engine.kernels import (
    fp8,
    fp8_cutlass,
    fp8_launch,
    skinny_launch,
    triton_fused_quant,
    triton_gemv,
)
from v1_engine.kernels import triton_gemv_fp8 as fp8_skinny
from v1_engine.kernels import triton_gemv_fp8_decode as fp8_decode
from v1_engine.layers.quantization.fp8_moe import quantize_matrix_block_fp8

SHAPES = {  # name: (N, K) of Llama-3-8B's linears, then Llama-3-70B's (at one GPU's width)
    "qkv": (6144, 4096),
    "o_proj": (4096, 4096),
    "gate_up": (28672, 4096),
    "down": (4096, 14336),
    "lm_head": (128256, 4096),
    "qkv_70b": (10240, 8192),
    "o_proj_70b": (8192, 8192),
    "gate_up_70b": (57344, 8192),
    "down_70b": (8192, 28672),
}
DEFAULT_SHAPES = ("qkv", "o_proj", "gate_up", "down", "lm_head")
CALLS = 10
"""Calls per CUDA graph."""
L2_BYTES = 60e6
NORM_EPS = 1e-5


def rotated(weight: torch.Tensor) -> list[torch.Tensor]:
    """`weight` and its clones, for CALLS calls to cycle over so that none is served from L2
    (as consecutive layers are not): enough copies for four L2s, at most one per call."""
    copies = min(CALLS, max(1, math.ceil(4 * L2_BYTES / (weight.numel() * weight.element_size()))))
    return [weight] + [weight.clone() for _ in range(copies - 1)]


def _compile_one(job: tuple[str, int, dict]) -> str | None:
    """Worker: compile one (kind, M, config) into Triton's cache; the error text if it fails."""
    kind, m, launch = job
    try:
        if kind == "bf16":
            triton_gemv.precompile(torch.bfloat16, m, 4096, 4096, **launch)
        else:
            fp8_skinny.precompile_fp8(kind, torch.bfloat16, m, 4096, 4096, **launch)
    except Exception as error:  # noqa: BLE001 - any compiler rejection just drops this config
        return f"{launch}: {type(error).__name__}: {str(error).splitlines()[0][:120]}"
    return None


def precompile_all(kind: str, configs: list[dict], ms: list[int], workers: int) -> None:
    """Compile every config for every distinct BLOCK_M of the Ms it applies to (`block_m`). M
    itself is not specialized, and N and K only matter to the kernel through their divisibility
    by 16, which every swept shape shares, so one compile serves all shapes and Ms of a BLOCK_M."""
    jobs = []
    for launch in configs:
        rows = {}
        for m in sorted(ms):
            if applies(kind, launch, m):
                rows.setdefault(skinny_launch.block_rows(launch["mode"], m), m)
        jobs += [(kind, m, launch) for m in rows.values()]
    start = time.perf_counter()
    if workers > 0:
        context = multiprocessing.get_context("spawn")
        try:
            with ProcessPoolExecutor(workers, mp_context=context) as pool:
                errors = [e for e in pool.map(_compile_one, jobs) if e]
        except BrokenProcessPool as error:  # the timing loop then compiles as it goes
            errors = [f"compile workers died ({error}); compiling on first use instead"]
    else:
        errors = [e for e in map(_compile_one, jobs) if e]
    print(f"compiled {len(jobs)} kernels in {time.perf_counter() - start:.1f} s", flush=True)
    for error in errors[:5]:
        print(f"  compile failed: {error}", flush=True)


def graph_us(call, weights: list[torch.Tensor]) -> float:
    """Device microseconds per call of `call(weight)`, CALLS calls over the weight copies
    captured in one CUDA graph and replayed under do_bench."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for w in weights[:2]:
            call(w)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(CALLS):
            call(weights[i % len(weights)])
    ms = triton.testing.do_bench(graph.replay, warmup=5, rep=15)
    del graph
    return ms * 1e3 / CALLS


def rate(kind: str, us: float, m: int, n: int, k: int) -> float:
    """Bytes per second: the weight plus x (both e4m3 in the FP8 kinds) and the bf16 output,
    once each."""
    return (element_bytes(kind) * (n * k + m * k) + 2 * m * n) / (us * 1e-6)


class Problem:
    """One shape's operands: rotating weight copies, activations per M, and the two calls timed
    (the baseline and the skinny kernel with a launch config) on a given weight copy."""

    def __init__(self, kind: str, n: int, k: int, ms: list[int]) -> None:
        self.kind = kind
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
        xs = {m: torch.randn(m, k, device="cuda", dtype=torch.bfloat16) for m in ms}
        if kind == "bf16":
            self.weights = rotated(w)
            self.xs = xs
            return
        if kind in NORM_KINDS:
            self.residuals = {m: torch.randn_like(x) for m, x in xs.items()}
            self.norm_w = 1.0 + 0.1 * torch.randn(k, device="cuda", dtype=torch.bfloat16)
        if kind in ("channel", "weight_only", "gated", *NORM_KINDS):
            qw, self.scale_w = fp8.per_token_fp8_quant(w)
            self.xs = {m: fp8.per_token_fp8_quant(x) for m, x in xs.items()}
            self.bf16_xs = xs
        else:
            qw, self.scale_w = quantize_matrix_block_fp8(w)
            self.xs = {m: fp8.per_token_group_fp8_quant(x, 128) for m, x in xs.items()}
        self.weights = rotated(qw)

    def baseline(self, m: int, w: torch.Tensor) -> torch.Tensor:
        if self.kind == "bf16":
            return F.linear(self.xs[m], w)
        if self.kind in NORM_KINDS:
            x, residual = self.bf16_xs[m], self.residuals[m]
            a, scale_a, _ = triton_fused_quant.rms_norm_quant(
                x, residual, self.norm_w, NORM_EPS, None
            )
            if self.kind == "norm":
                return fp8._scaled_mm_cuda(a, w, scale_a, self.scale_w, torch.bfloat16)
            return fp8_decode.fp8_gated_gemm(a, w, scale_a, self.scale_w, torch.bfloat16)
        a, scale_a = self.xs[m]
        if self.kind in ("channel", "weight_only"):
            return fp8_cutlass.scaled_mm_cutlass(a, w, scale_a, self.scale_w, torch.bfloat16)
        if self.kind == "gated":
            gate_up = fp8_cutlass.scaled_mm_cutlass(a, w, scale_a, self.scale_w, torch.bfloat16)
            return triton_fused_quant.silu_and_mul_quant(gate_up, None)
        return fp8_cutlass.block_scaled_mm_cutlass(a, w, scale_a, self.scale_w, torch.bfloat16)

    def reference(self, m: int, w: torch.Tensor, mode: str = "") -> torch.Tensor:
        """What every config's output is checked against: cuBLAS for bf16; for FP8 the float32
        PyTorch reference on the same e4m3 operands, not CUTLASS, whose FP8 accumulator drifts
        over long K (Llama-3-70B down, K = 28672: 9e-3 of the output's range at M = 1). The norm
        kinds: the folded formula in float32 for the fma body, the quantized chain's reference
        (norm-quant, then the e4m3 product) for the wgmma body, which quantizes as it does."""
        if self.kind == "bf16":
            return self.baseline(m, w)
        if self.kind in NORM_KINDS and mode == "wgmma":
            x, residual = self.bf16_xs[m], self.residuals[m]
            a, scale_a, _ = add_rms_norm_quant_ref(x, residual, self.norm_w, NORM_EPS)
            out = fp8.scaled_mm_ref(a, w, scale_a, self.scale_w, torch.bfloat16)
            return silu_and_mul_ref(out) if self.kind == "norm_gated" else out
        if self.kind in NORM_KINDS:  # the norm folded in, in float32
            x, residual = self.bf16_xs[m], self.residuals[m]
            h = (x.float() + residual.float()).to(x.dtype).float()
            normed = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + NORM_EPS)
            out = ((normed * self.norm_w.float()) @ w.float().t()) * self.scale_w.reshape(1, -1)
            return (
                silu_and_mul_ref(out.to(x.dtype)) if self.kind == "norm_gated" else out.to(x.dtype)
            )
        a, scale_a = self.xs[m]
        if self.kind == "channel":
            return fp8.scaled_mm_ref(a, w, scale_a, self.scale_w, torch.bfloat16)
        if self.kind == "weight_only":  # the activation not quantized
            x = self.bf16_xs[m]
            return ((x.float() @ w.float().t()) * self.scale_w.reshape(1, -1)).to(x.dtype)
        if self.kind == "gated":
            return silu_and_mul_ref(fp8.scaled_mm_ref(a, w, scale_a, self.scale_w, torch.bfloat16))
        return fp8.block_scaled_mm_ref(a, w, scale_a, self.scale_w, torch.bfloat16)

    def skinny(self, m: int, w: torch.Tensor, launch: dict) -> torch.Tensor:
        if self.kind == "bf16":
            return triton_gemv.skinny_gemm(self.xs[m], w, **launch)
        if self.kind in NORM_KINDS:
            x, residual = self.bf16_xs[m], self.residuals[m]
            gated = self.kind == "norm_gated"
            args = (x, residual, self.norm_w, NORM_EPS, w, self.scale_w)
            return fp8_decode.fp8_add_norm_gemm(*args, gated=gated, **launch)[0]
        a, scale_a = self.xs[m]
        if self.kind == "channel":
            return fp8_skinny.fp8_skinny_gemm(a, w, scale_a, self.scale_w, torch.bfloat16, **launch)
        if self.kind == "weight_only":
            return fp8_decode.fp8_weight_only_gemm(self.bf16_xs[m], w, self.scale_w, **launch)
        if self.kind == "gated":
            return fp8_decode.fp8_gated_gemm(a, w, scale_a, self.scale_w, torch.bfloat16, **launch)
        return fp8_skinny.fp8_block_skinny_gemm(
            a, w, scale_a, self.scale_w, torch.bfloat16, **launch
        )

    def default_launch(self, m: int, n: int, k: int) -> dict:
        if self.kind == "bf16":
            return skinny_launch.launch_config(m, n, k)
        return fp8_launch.fp8_launch_config(self.kind, m, n, k)


def matches(problem: Problem, m: int, launch: dict, ref: torch.Tensor) -> bool:
    out = problem.skinny(m, problem.weights[0], launch)
    scale = ref.float().abs().amax().item()
    return torch.allclose(out.float(), ref.float(), rtol=2**-7, atol=scale * 2**-7)


def sweep_shape(
    kind: str, name: str, n: int, k: int, ms: list[int], configs: list[dict], seconds: float
):
    """Per M: (baseline us, [(us, tag, launch) of the skinny configs]) within `seconds`."""
    problem = Problem(kind, n, k, ms)
    weights = problem.weights
    refs = {m: problem.reference(m, weights[0]) for m in ms}
    if kind in NORM_KINDS:  # the wgmma body quantizes the activation: the chain's reference
        refs |= {(m, "wgmma"): problem.reference(m, weights[0], "wgmma") for m in ms}
    results = {m: (graph_us(lambda w, m=m: problem.baseline(m, w), weights), []) for m in ms}
    default = {m: problem.default_launch(m, n, k) for m in ms}
    start, tried = time.perf_counter(), 0
    for launch in [None, *configs]:
        if time.perf_counter() - start > seconds:
            break
        tried += 1
        for m in ms:
            chosen = default[m] if launch is None else launch
            if not applies(kind, chosen, m):
                continue
            try:
                ref = refs.get((m, chosen["mode"]), refs[m])
                if not matches(problem, m, chosen, ref):
                    print(f"  {name} M={m}: WRONG RESULT from {chosen}", flush=True)
                    continue
                us = graph_us(lambda w, m=m, c=chosen: problem.skinny(m, w, c), weights)
            except Exception as error:  # noqa: BLE001 - out of resources, compiler errors: skip
                print(f"  {name} M={m}: skipped {chosen}: {type(error).__name__}", flush=True)
                continue
            results[m][1].append((us, "default" if launch is None else "", chosen))
    print(f"{name} (N={n}, K={k}): {tried} of {len(configs) + 1} configs timed", flush=True)
    weights.clear()  # the copies go before the next shape allocates its own
    torch.cuda.empty_cache()
    return results


def report(kind: str, name: str, n: int, k: int, results: dict) -> dict:
    """Prints the baseline vs the skinny kernel per M; returns the table entries of the shape."""
    table = {}
    base_name = "cuBLAS" if kind == "bf16" else "CUTLASS"
    for m, (cublas, timed) in results.items():
        timed.sort(key=lambda r: r[0])
        line = (
            f"  {name:8s} M={m:2d}  {base_name} {cublas:7.1f} us "
            f"{rate(kind, cublas, m, n, k) / 1e12:.2f} TB/s"
        )
        if not timed:
            print(line + "  (no skinny config ran)", flush=True)
            table[(skinny_launch.m_bucket(m), n, k)] = None
            continue
        us, tag, launch = timed[0]
        default = next((t for t in timed if t[1] == "default"), None)
        achieved = rate(kind, us, m, n, k)
        line += f" | skinny {us:7.1f} us {achieved / 1e12:.2f} TB/s"
        line += f" ({achieved / HBM_BYTES_PER_S:.0%}) x{cublas / us:.2f} {tag} {launch}"
        if default is not None:
            line += f" | default {default[0]:.1f} us"
        print(line, flush=True)
        bodies = {}  # the fastest launch of each body (mode), fastest first
        for t in timed:
            bodies.setdefault(str(t[2]["mode"]), t)
        for body, (body_us, _, body_launch) in list(bodies.items())[1:]:
            print(f"    fastest {body}: {body_us:7.1f} us {body_launch}", flush=True)
        table[(skinny_launch.m_bucket(m), n, k)] = launch if us < cublas else None
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default=",".join(DEFAULT_SHAPES), help=f"any of {list(SHAPES)}")
    parser.add_argument(
        "--m", default="1,2,4,8,16", help=f"batch sizes (1..{skinny_launch.SKINNY_MAX_M})"
    )
    parser.add_argument("--seconds", type=float, default=20.0, help="timing budget per shape")
    parser.add_argument(
        "--modes", default=None, help="bodies to sweep (default: every body the kind has)"
    )
    parser.add_argument("--workers", type=int, default=min(12, os.cpu_count() or 1))
    parser.add_argument(
        "--split-k",
        default="",
        help="also sweep split-K launches, split this many ways (e.g. 2,4,8), one split config "
        "after each unsplit one",
    )
    parser.add_argument(
        "--write-table",
        action="store_true",
        help="bf16: rewrite kernels/skinny_tuned.py with the suggested table",
    )
    parser.add_argument(
        "--json",
        default=None,
        help="FP8 kinds: also write the swept entries (launch or None) to this GEMM table file "
        "(bench_utils.write_gemm_tables, kind 'fp8_skinny'), for `latency.py --gemm-tables`",
    )
    parser.add_argument(
        "--fp8",
        choices=KINDS[1:],
        default=None,
        help="sweep the FP8 skinny GEMM of this kind against CUTLASS (default: bf16 vs cuBLAS)",
    )
    args = parser.parse_args()
    kind = args.fp8 or "bf16"
    if args.write_table and kind != "bf16":
        raise SystemExit("--write-table rewrites the bf16 table only (kernels/skinny_tuned.py)")
    if not torch.cuda.is_available():
        raise SystemExit("sweep_skinny_gemm.py needs a CUDA GPU")
    names = [s for s in args.shapes.split(",") if s]
    for s in names:
        if s not in SHAPES:
            raise SystemExit(f"--shapes: {s!r} is not one of {list(SHAPES)}")
    ms = [int(m) for m in args.m.split(",") if m]
    if not all(1 <= m <= skinny_launch.SKINNY_MAX_M for m in ms):
        raise SystemExit(f"--m: batch sizes must be in 1..{skinny_launch.SKINNY_MAX_M}")
    buckets = [skinny_launch.m_bucket(m) for m in ms]
    if len(set(buckets)) != len(buckets):
        raise SystemExit(
            f"--m: {ms} holds two batch sizes of one M bucket ({buckets}); the table keeps one "
            "entry per bucket, so give one size per power of two"
        )
    if args.json and kind == "bf16":
        raise SystemExit("--json writes the FP8 skinny entries only (with --fp8)")
    modes = args.modes.split(",") if args.modes else None
    configs = sweep_configs(kind, [int(s) for s in args.split_k.split(",") if s], modes)
    torch.manual_seed(0)
    begin = time.perf_counter()
    precompile_all(kind, configs, ms, args.workers)
    table = dict(
        skinny_launch.TUNED_LAUNCH if kind == "bf16" else fp8_launch.FP8_TUNED_LAUNCH[kind]
    )
    swept = {}
    for name in names:
        n, k = SHAPES[name]
        results = sweep_shape(kind, name, n, k, ms, configs, args.seconds)
        swept |= report(kind, name, n, k, results)
    table |= swept
    if args.json:
        rows = [[kind, *key, launch] for key, launch in swept.items()]
        kept = [
            row
            for row in read_gemm_tables(args.json).get("fp8_skinny", [])
            if (row[0], *row[1:4]) not in {(kind, *key) for key in swept}
        ]
        write_gemm_tables(args.json, "fp8_skinny", kept + rows)
        print(f"wrote {len(rows)} FP8 skinny entries to {args.json} ({len(kept)} others kept)")
    print(f"\nsuggested table ({time.perf_counter() - begin:.0f} s in all; the current one with")
    print("the swept entries replaced or added):")
    print("TUNED_LAUNCH = {" if kind == "bf16" else f"FP8_TUNED_LAUNCH[{kind!r}] = {{")
    shape_order = list(dict.fromkeys(key[1:] for key in table))
    for key in sorted(table, key=lambda key: (shape_order.index(key[1:]), key[0])):
        print(f"    {key}: {table[key]},")
    print("}")
    if args.write_table:
        write_table(table, shape_order)


def write_table(table: dict, shape_order: list) -> None:
    """Replace the TUNED_LAUNCH literal of kernels/skinny_tuned.py by `table` (the bf16 table;
    run `ruff format` on the file afterwards), keeping the module's text around it."""
    path = Path(triton_gemv.__file__).with_name("skinny_tuned.py")
    text = path.read_text()
    head = "TUNED_LAUNCH: dict[tuple[int, int, int], dict[str, int | str] | None] = {\n"
    start = text.index(head) + len(head)
    end = text.index("\n}\n", start) + 1
    keys = sorted(table, key=lambda key: (shape_order.index(key[1:]), key[0]))

    def entry(launch: dict | None) -> dict | None:  # split_k 1 is every launch's default
        return (
            launch
            if launch is None
            else {k: v for k, v in launch.items() if k != "split_k" or v != 1}
        )

    body = "".join(f"    {key}: {entry(table[key])!r},\n" for key in keys)
    path.write_text(text[:start] + body + text[end:])
    print(f"wrote {len(keys)} entries to {path}")


if __name__ == "__main__":
    main()
