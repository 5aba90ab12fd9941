"""Launch-configuration sweep of the Triton MLA decode kernel (kernels/triton_mla.py).

For each head count, times launch configurations at batch x context (default 64 x 4096, block
size 64, bf16): heads per program, cached tokens per loop step, warps, pipeline stages, the
transposed dots (swap), latent dims of the output per program (block_v), one cache block per
loop step (page_tile) and the split-KV factor. It prints the fastest, as achieved bandwidth on
the latent bytes the kernel must read, and the LaunchConfig to put in `launch_config`.

The candidates of a head count come most promising first. They are compiled up front by worker
processes (a configuration takes seconds to compile, a timing a fraction of one), which also
drop those that do not fit the device; then they are timed in order until the head count's
budget (compiling included) runs out.

    python benchmarks/sweep_mla.py --heads 16,128 --seconds 60

`--baseline FILE` first times the default launch of another version of the kernel module next to
this one's, each inside a CUDA graph of 10 calls (as the decode graphs run it), best of three
interleaved rounds, with the largest difference between their outputs (an A/B of a kernel
change); `--seconds 0` then skips the sweep:

    git show HEAD:v1_engine/kernels/triton_mla.py > /tmp/mla_head.py
    python benchmarks/sweep_mla.py --heads 16,128 --seconds 0 --baseline /tmp/mla_head.py
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import multiprocessing
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench_utils import HBM_BYTES_PER_S

from v1_engine.kernels.triton_mla import (
    LaunchConfig,
    launch_config,
    mla_decode,
    mla_decode_bytes,
)

RANK, ROPE = 512, 64
CONFIG_KEYS = ("block_h", "tile", "num_warps", "num_stages", "swap", "block_v", "page_tile")

# (block_h, tile, num_warps, num_stages, swap, block_v), most promising first. Shared memory
# decides much of what fits: a program keeps its head tile's queries (block_h x 576) and the
# pipeline's buffers of tile x 576 latents (plus tile x block_v with value slices) in it, at
# most 227 KiB on the H200, so the tile shrinks as heads and slices grow.
_CANDIDATES_16 = [
    # the plain form: a step's full tiles load unmasked, and with page_tile (tried right after
    # each of the first rows) from one block id and loop-invariant offsets.
    (16, 32, 4, 3, False, None),
    (16, 32, 4, 2, False, None),
    (16, 64, 8, 2, False, None),
    (16, 32, 8, 3, False, None),
    (16, 16, 4, 4, False, None),
    (16, 64, 4, 2, False, None),
    (16, 32, 4, 4, False, None),
    (16, 64, 8, 3, False, None),
    (16, 16, 4, 3, False, None),
    (16, 128, 8, 2, False, None),
    # swap: the [tile, 512] latents are the M of wgmma, read from shared memory, not registers.
    # The cache rows of a step are looked up a step early, so every stage is a latent buffer
    # (the tile-32 swap form: 2 stages ~55 KiB and one buffer, 3 stages ~91 KiB and two).
    (16, 32, 4, 3, True, None),
    (16, 32, 4, 2, True, None),
    (16, 16, 4, 2, True, None),
    (16, 32, 8, 2, True, None),
    (16, 64, 4, 2, True, None),
    (16, 16, 4, 4, True, None),
    (16, 64, 8, 2, True, None),
    # swap with value slices: more, smaller programs.
    (16, 32, 4, 2, True, 256),
    (16, 32, 4, 3, True, 256),
]
_CANDIDATES_MANY = [
    # the 64-head tile: with the rows looked up a step early, 2 stages are two 64 x 576 buffers
    (64, 64, 8, 2, False, None),
    (64, 32, 8, 3, False, None),
    (64, 32, 8, 4, False, None),
    (64, 16, 8, 4, False, None),
    # value slices of a 64-head tile: the [64, block_v] accumulator fits the registers.
    (64, 32, 8, 3, False, 256),
    (64, 32, 8, 3, False, 128),
    (64, 32, 8, 2, False, 256),
    (64, 32, 8, 2, False, 128),
    (64, 32, 16, 3, False, 128),
    # transposed value slices; 128 heads in one program read each latent once.
    (64, 32, 8, 3, True, 128),
    (64, 32, 8, 3, True, 256),
    (128, 32, 16, 2, True, 128),
    (128, 32, 8, 3, True, 256),
    (128, 32, 8, 2, True, 128),
    (64, 32, 16, 3, True, 256),
    # the whole accumulator over four warp groups, or a smaller tile
    (64, 64, 16, 2, False, None),
    (64, 32, 16, 3, False, None),
    (64, 32, 8, 2, False, None),
    (64, 16, 8, 4, False, 256),
    # 32-head tiles: more programs, each latent read from L2 once per tile
    (32, 64, 8, 3, False, None),
    (32, 32, 4, 3, False, None),
    (32, 64, 8, 2, True, None),
    (32, 32, 8, 3, True, 256),
]
REGISTER_CAPS = {
    True: (
        {"maxnreg": 168},
        {"maxnreg": 128},
        {"tile": 16, "num_stages": 3, "maxnreg": 128},
        {"tile": 32, "num_stages": 2, "maxnreg": 168},
    ),
    False: ({"maxnreg": 224}, {"maxnreg": 192}),
}
"""Launch overrides timed right after the default (keyed by heads <= 16): register caps; a
capped launch that wins is reported with its `maxnreg` (LaunchConfig has no such field yet)."""
_PAGE_TILE_TRIES = 12
"""The first candidates also run with page_tile (one block id per step) right after."""


def candidates(heads: int, block_size: int) -> list[dict]:
    """Launch overrides to time for `heads`, most promising first, each with every split factor
    of the head count (None = the kernel's own choice; splits do not recompile the kernel)."""
    table = _CANDIDATES_16 if heads <= 16 else _CANDIDATES_MANY
    splits = (None, 2, 8, 16) if heads <= 16 else (None, 1, 2, 4)
    configs = []
    for i, (block_h, tile, warps, stages, swap, block_v) in enumerate(table):
        base = {"block_h": block_h, "tile": tile, "num_warps": warps, "num_stages": stages}
        base |= {"swap": swap, "block_v": block_v}
        configs.append(base | {"page_tile": False})
        if i < _PAGE_TILE_TRIES and block_size % tile == 0:
            configs.append(base | {"page_tile": True})
    return [config | {"num_splits": s} for config in configs for s in splits]


def make_inputs(heads: int, batch: int, context: int, block_size: int) -> tuple:
    """(q_nope, q_pe, cache, block table, seq_lens, query_start_loc, output) of a decode step:
    every request `context` tokens long, its cache blocks spread at random."""
    num_blocks = batch * context // block_size
    cache = torch.randn(num_blocks, block_size, RANK + ROPE, device="cuda", dtype=torch.bfloat16)
    table = torch.randperm(num_blocks, device="cuda", dtype=torch.int32).reshape(batch, -1)
    lens = torch.full((batch,), context, device="cuda", dtype=torch.int32)
    starts = torch.arange(batch + 1, device="cuda", dtype=torch.int32)
    q_nope = torch.randn(batch, heads, RANK, device="cuda", dtype=torch.bfloat16)
    q_pe = torch.randn(batch, heads, ROPE, device="cuda", dtype=torch.bfloat16)
    out = torch.empty(batch, heads, RANK, device="cuda", dtype=torch.bfloat16)
    return q_nope, q_pe, cache, table, lens, starts, out


def _call(inputs: tuple, context: int, launch: dict) -> None:
    q_nope, q_pe, cache, table, lens, starts, out = inputs
    mla_decode(q_nope, q_pe, cache, table, lens, starts, context, 0.1, out, **launch)


_WORKER_INPUTS: dict[tuple, tuple] = {}


def _compile_job(job: tuple[tuple[int, int, int, int], list[dict]]) -> list[str | None]:
    """Worker: run each launch once on inputs of the same shapes as the timing (so the kernel
    lands in Triton's cache under the key the timing looks up); per launch its error text."""
    shape, launches = job
    if shape not in _WORKER_INPUTS:
        _WORKER_INPUTS.clear()
        _WORKER_INPUTS[shape] = make_inputs(*shape)
    errors: list[str | None] = []
    for launch in launches:
        try:
            _call(_WORKER_INPUTS[shape], shape[2], launch)
            torch.cuda.synchronize()
            errors.append(None)
        except Exception as error:  # noqa: BLE001 - out of resources, compiler errors: skip
            errors.append(f"{type(error).__name__}: {str(error).splitlines()[0][:100]}")
    return errors


def precompile(
    pool: ProcessPoolExecutor | None,
    shape: tuple[int, int, int, int],
    launches: list[dict],
    timeout: float,
) -> dict[int, str]:
    """Compiles the launches' kernels in the pool, one job per compiled configuration (its split
    factors together), within `timeout` seconds; returns {index in launches: error} of those
    that failed."""
    if pool is None:
        return {}
    groups: dict[tuple, list[int]] = {}
    for i, launch in enumerate(launches):
        groups.setdefault(tuple(launch[k] for k in CONFIG_KEYS), []).append(i)
    jobs = [(shape, [launches[i] for i in indices]) for indices in groups.values()]
    failed = {}
    for indices, errors in zip(groups.values(), pool.map(_compile_job, jobs, timeout=timeout)):
        failed |= {i: e for i, e in zip(indices, errors) if e is not None}
    return failed


def load_baseline(path: str):
    """`mla_decode` of another version of triton_mla.py (a file path)."""
    spec = importlib.util.spec_from_file_location("baseline_triton_mla", path)
    if spec is None or spec.loader is None:
        raise SystemExit(f"--baseline {path!r} is not a Python file")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module.mla_decode


def compare(heads: int, batch: int, context: int, block_size: int, baseline) -> None:
    """Default launch of this kernel vs `baseline`'s, in CUDA graphs, best of 3 rounds."""
    q_nope, q_pe, cache, table, lens, starts, out = make_inputs(heads, batch, context, block_size)
    nbytes = mla_decode_bytes([context] * batch, RANK, ROPE, 2)
    results = {}
    for name, kernel in (("baseline", baseline), ("this", mla_decode)):
        kernel(q_nope, q_pe, cache, table, lens, starts, context, 0.1, out)  # compile, allocate
        torch.cuda.synchronize()
        results[name] = [out.float().clone(), None, float("inf")]
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(10):
                kernel(q_nope, q_pe, cache, table, lens, starts, context, 0.1, out)
        results[name][1] = graph
    for _ in range(3):
        for entry in results.values():
            us = triton.testing.do_bench(entry[1].replay, warmup=10, rep=60) * 1e3 / 10
            entry[2] = min(entry[2], us)
    diff = (results["this"][0] - results["baseline"][0]).abs().max().item()
    print(f"heads {heads}, batch {batch} x {context}, block size {block_size}:", flush=True)
    for name, (_, _, us) in results.items():
        rate = nbytes / (us * 1e-6)
        print(f"  {name:8} {us:7.1f} us  {rate / 1e12:.2f} TB/s ({rate / HBM_BYTES_PER_S:.1%})")
    print(f"  largest output difference {diff:.2e}", flush=True)


def suggested(launch: dict, heads: int) -> LaunchConfig:
    """The LaunchConfig of a result row (the default row's launch is empty: the default's)."""
    default = dataclasses.asdict(launch_config(heads, False))
    return LaunchConfig(**{k: launch.get(k, default[k]) for k in CONFIG_KEYS})


def sweep(
    heads: int,
    batch: int,
    context: int,
    block_size: int,
    seconds: float,
    pool: ProcessPoolExecutor | None,
) -> None:
    start = time.perf_counter()
    shape = (heads, batch, context, block_size)
    inputs = make_inputs(*shape)
    nbytes = mla_decode_bytes([context] * batch, RANK, ROPE, 2)

    def rate(launch: dict) -> float:
        ms = triton.testing.do_bench(lambda: _call(inputs, context, launch), warmup=5, rep=20)
        return nbytes / (ms * 1e-3)

    launches = candidates(heads, block_size)
    try:
        failed = precompile(pool, shape, launches, seconds - (time.perf_counter() - start))
    except Exception as error:  # noqa: BLE001 - the timing loop then compiles as it goes
        print(f"  compile workers failed ({error!r}); compiling on first use", flush=True)
        failed = {}
    print(
        f"heads {heads}: compiled {len(launches)} launches in {time.perf_counter() - start:.0f} s,"
        f" {len(failed)} failed",
        flush=True,
    )
    for i, error in list(failed.items())[:6]:
        print(f"  skipped {launches[i]}: {error}", flush=True)

    default = launch_config(heads, dot_f32=False)
    # One untimed round first: the default's first timing, right after the idle compile phase,
    # fell out of the top 8 in two runs (2026-12-03) below launches that were the same kernel.
    rate({})
    results = [(rate({}), "default", {k: getattr(default, k) for k in CONFIG_KEYS})]
    # The default with its registers capped, so more programs fit an SM (the 16-head default
    # takes 184 registers and 91 KiB: 2 programs; <= 168 and a smaller footprint allow 3).
    for capped in REGISTER_CAPS.get(heads <= 16, ()):
        try:
            results.append((rate(capped), "", capped))
        except Exception as error:  # noqa: BLE001 - out of resources, compiler errors: skip
            print(f"  skipped {capped}: {type(error).__name__}", flush=True)
    timed = 0
    for i, launch in enumerate(launches):
        if time.perf_counter() - start > seconds:
            break
        if i in failed:
            continue
        try:
            results.append((rate(launch), "", launch))
            timed += 1
        except Exception as error:  # noqa: BLE001 - out of resources, compiler errors: skip
            print(f"  skipped {launch}: {type(error).__name__}", flush=True)
    results.sort(key=lambda r: r[0], reverse=True)
    print(
        f"heads {heads}, batch {batch} x {context}, block size {block_size}: timed {timed} of "
        f"{len(launches) - len(failed)} launches in {time.perf_counter() - start:.0f} s; top 8:",
        flush=True,
    )
    for value, tag, launch in results[:8]:
        us = nbytes / value * 1e6
        print(
            f"  {value / 1e12:.2f} TB/s ({value / HBM_BYTES_PER_S:.0%}) {us:.0f} us {tag} {launch}",
            flush=True,
        )
    best = results[0][2]
    splits = "chosen by the kernel" if best.get("num_splits") is None else best["num_splits"]
    print(
        f"  suggested launch_config({heads}): {suggested(best, heads)}, num_splits {splits}",
        flush=True,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--heads", default="16,128")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--block-size", type=int, default=64)
    parser.add_argument(
        "--seconds", type=float, default=60.0, help="budget per head count, compiling included"
    )
    parser.add_argument(
        "--workers",
        type=int,
        default=min(16, os.cpu_count() or 1),
        help="compile worker processes (0: compile on first use)",
    )
    parser.add_argument(
        "--baseline", default=None, help="another triton_mla.py whose default is timed first"
    )
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("sweep_mla.py needs a CUDA GPU")
    torch.manual_seed(0)
    head_counts = [int(h) for h in args.heads.split(",") if h]
    if args.baseline:
        baseline = load_baseline(args.baseline)
        for heads in head_counts:
            compare(heads, args.batch, args.context, args.block_size, baseline)
        if args.seconds <= 0:
            return
    pool = None
    if args.workers > 0:
        context = multiprocessing.get_context("spawn")
        pool = ProcessPoolExecutor(args.workers, mp_context=context)
    try:
        for heads in head_counts:
            sweep(heads, args.batch, args.context, args.block_size, args.seconds, pool)
    finally:
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)


if __name__ == "__main__":
    main()
