"""Where a decode step's time goes: GPU kernels (torch.profiler) and host work (cProfile).

Builds the engine on a benchmark config with dummy weights, then for each batch size: the wall
ms/step (as latency.py measures it), the GPU kernel time per step from a profiler trace of
`--steps` decode steps (a gap between the two is time the GPU waits for the host), the top
kernels by GPU time, and the top host functions by self time. Tables (a Chrome trace too with
--trace) per batch size go to --out-dir. `--prefill-len N` also profiles one N-token prefill step.

    python benchmarks/profile_decode.py --model llama3-8b --batch-sizes 1,64 --out-dir /tmp/prof
    python benchmarks/profile_decode.py --quantization fp8 --batch-sizes 1 --prefill-len 4096
"""

from __future__ import annotations

import argparse
import cProfile
import io
import itertools
import pstats
import sys
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench_utils import ModelShape, apply_gemm_tables, benchmark_max_model_len, model_dir
from latency import compilation_config, decode_ms_per_step, random_prompts, timed_generate

from v1_engine import LLM
from v1_engine.config import LM_HEAD_QUANTIZATION_CHOICES


def _device_events(prof: profile) -> list:
    """The trace's kernels and copies, in the order they started on the GPU."""
    events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    return sorted(events, key=lambda e: e.time_range.start)


def gpu_kernel_ms(prof: profile) -> float:
    """Total device time of the kernels (and copies) the profiler saw, in ms."""
    return sum(e.device_time for e in _device_events(prof)) / 1e3


def _step_ends(prof: profile, steps: int) -> tuple[list, list[int]]:
    """The trace's device events and the indices of its argmax kernels, one a step: the prefill
    step's, then `steps` decode steps' (see decode_kernels_per_step)."""
    events = _device_events(prof)
    ends = [i for i, e in enumerate(events) if "ArgMax" in e.name or "_row_argmax" in e.name]
    if len(ends) != steps + 1:
        raise SystemExit(
            f"expected {steps + 1} argmax kernels (one a step), found {len(ends)}: the trace "
            "cannot be cut into steps"
        )
    return events, ends


def decode_kernels_per_step(prof: profile, steps: int) -> str:
    """Per decode step: each kernel's device time and launches over the trace's last `steps`
    steps, largest first. Every step ends with its greedy sampling's argmax kernel (torch's
    ArgMax reduce, or kernels/triton_argmax.py's `_row_argmax_kernel` up to 256 rows), so the
    kernels after the first argmax (the prefill step's) and up to the last are the decode
    steps'. (Subtracting a separate prefill-only trace instead failed for long prompts: at 64
    x 1k tokens the prefill's run-to-run spread, ~12 ms, swamped a few decode steps.)"""
    events, ends = _step_ends(prof, steps)
    totals: dict[str, tuple[float, int]] = {}
    for event in events[ends[0] + 1 : ends[-1] + 1]:
        us, calls = totals.get(event.name, (0.0, 0))
        totals[event.name] = (us + event.device_time, calls + 1)
    rows = sorted(((us / steps, calls / steps, name) for name, (us, calls) in totals.items()),
                  reverse=True)  # fmt: skip
    total = sum(r[0] for r in rows)
    lines = [f"decode step: {total:.1f} us of kernels per step (the trace cut at the argmaxes)"]
    lines += [f"{us:9.1f} us {calls:7.1f} x  {name[:90]}" for us, calls, name in rows[:30]]
    return "\n".join(lines)


def decode_timeline(prof: profile, steps: int) -> str:
    """Per decode step, from the trace's timestamps: the span (one argmax's end to the next's),
    the time some kernel or copy ran (the union of their intervals: PDL overlaps a kernel with
    the one before it, so the sum of device times overstates a step), and the rest, when the GPU
    ran nothing. Idle time inside the step's graph is launch latency or a dependency bubble;
    idle time before the step's first kernel is the GPU waiting for the host. The largest gaps
    are listed by the pair of kernels around them."""
    events, ends = _step_ends(prof, steps)
    span = busy = before_first = 0.0
    gaps: dict[tuple[str, str], list[float]] = {}
    for a, b in itertools.pairwise(ends):
        start = events[a].time_range.end
        span += events[b].time_range.end - start
        covered_to = start
        prev = events[a].name
        for event in events[a + 1 : b + 1]:
            begin, end = event.time_range.start, event.time_range.end
            if begin > covered_to:
                gap = begin - covered_to
                if covered_to == start:
                    before_first += gap
                gaps.setdefault((prev[:40], event.name[:40]), []).append(gap)
            if end > covered_to:
                busy += end - max(begin, covered_to)
                covered_to = end
                prev = event.name
    idle = span - busy
    head = (
        f"decode step timeline: span {span / steps:.1f} us, GPU busy {busy / steps:.1f} us, "
        f"idle {idle / steps:.1f} us a step ({before_first / steps:.1f} before its first kernel)"
    )
    lines = [head]
    top = sorted(gaps.items(), key=lambda kv: -sum(kv[1]))[:12]
    for (left, right), values in top:
        lines.append(
            f"{sum(values) / steps:9.1f} us a step {len(values) / steps:6.1f} x  {left} -> {right}"
        )
    return "\n".join(lines)


def profile_batch(llm: LLM, batch: int, args, vocab: int, out_dir: Path) -> None:
    steps = args.steps
    wall_ms = decode_ms_per_step(llm, batch, args.input_len, steps, vocab, repeats=1)  # warms up

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        timed_generate(llm, random_prompts(batch, args.input_len, vocab, 4), 1 + steps)
    # The trace holds the prefill step too: the per-step table cuts it off.
    table = prof.key_averages().table(
        sort_by="self_device_time_total", row_limit=30, max_name_column_width=70
    )
    per_step = decode_kernels_per_step(prof, steps)
    timeline = decode_timeline(prof, steps)
    (out_dir / f"kernels_b{batch}.txt").write_text(per_step + "\n\n" + timeline + "\n\n" + table)
    if args.trace:
        prof.export_chrome_trace(str(out_dir / f"trace_b{batch}.json"))

    host = cProfile.Profile()
    host.enable()
    timed_generate(llm, random_prompts(batch, args.input_len, vocab, 5), 1 + steps)
    host.disable()
    text = io.StringIO()
    pstats.Stats(host, stream=text).sort_stats("tottime").print_stats(30)
    (out_dir / f"host_b{batch}.txt").write_text(text.getvalue())

    print(
        f"batch {batch}: wall {wall_ms:.2f} ms/step; GPU kernels {gpu_kernel_ms(prof):.1f} ms over "
        f"1 prefill + {steps} decode steps (see kernels_b{batch}.txt, host_b{batch}.txt)",
        flush=True,
    )
    print("\n".join(per_step.splitlines()[:16]), flush=True)
    print(timeline, flush=True)


def profile_prefill(llm: LLM, tokens: int, vocab: int, out_dir: Path) -> None:
    timed_generate(llm, random_prompts(1, tokens, vocab, 6), 1)  # warm-up
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        wall_s = timed_generate(llm, random_prompts(1, tokens, vocab, 7), 1)
    table = prof.key_averages().table(
        sort_by="self_device_time_total", row_limit=40, max_name_column_width=70
    )
    (out_dir / f"kernels_prefill{tokens}.txt").write_text(table)
    print(
        f"prefill {tokens}: wall {wall_s * 1e3:.1f} ms; GPU kernels {gpu_kernel_ms(prof):.1f} ms "
        f"(see kernels_prefill{tokens}.txt)",
        flush=True,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama3-8b", help="a folder of benchmarks/configs")
    parser.add_argument("--batch-sizes", default="1,64")
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--compilation-level", type=int, default=2)
    parser.add_argument("--quantization", default=None, choices=("fp8",))
    parser.add_argument(
        "--lm-head-quantization",
        default="auto",
        choices=LM_HEAD_QUANTIZATION_CHOICES,
        help="the LM head under --quantization fp8 (as latency.py)",
    )
    parser.add_argument(
        "--max-model-len",
        type=int,
        default=None,
        help="default: the model's own context, raised to what the run needs (as latency.py)",
    )
    parser.add_argument("--prefill-len", type=int, default=0, help="also profile this prefill")
    parser.add_argument("--out-dir", default="benchmarks/logs/profile")
    parser.add_argument(
        "--trace", action="store_true", help="also write a Chrome trace per batch (tens of MB)"
    )
    parser.add_argument(
        "--add-fusion-passes",
        default=None,
        help="comma-separated fusion passes on top of the default set (as latency.py)",
    )
    parser.add_argument(
        "--drop-fusion-passes",
        default=None,
        help="comma-separated fusion passes left out of the default set (as latency.py)",
    )
    parser.add_argument(
        "--gemm-tables", default=None, help="a GEMM dispatch entry file to add (as latency.py)"
    )
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("profile_decode.py needs a CUDA GPU")
    if args.gemm_tables:
        print(apply_gemm_tables(args.gemm_tables), flush=True)
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    batch_sizes = [int(b) for b in args.batch_sizes.split(",") if b]
    shape = ModelShape.from_config(args.model)
    needed = max(args.input_len + args.steps, args.prefill_len) + 64
    path, _ = model_dir(args.model, min_positions=needed)
    max_len = benchmark_max_model_len(path, needed, args.max_model_len)
    llm = LLM(
        model=path,
        load_format="dummy",
        dtype="bfloat16",
        quantization=args.quantization,
        lm_head_quantization=args.lm_head_quantization,
        max_model_len=max_len,
        # Every batch's prompts prefill in one step (one argmax), so the per-decode-step table
        # can cut the trace after it: chunked prompts would overlap the first decode steps.
        max_num_batched_tokens=max(max_len, 8192, max(batch_sizes) * args.input_len),
        max_num_seqs=max(batch_sizes),
        enable_prefix_caching=False,
        compilation_config=compilation_config(
            args.compilation_level, None, args.add_fusion_passes, args.drop_fusion_passes
        ),
    )
    for batch in batch_sizes:
        profile_batch(llm, batch, args, shape.vocab, out_dir)
    if args.prefill_len:
        profile_prefill(llm, args.prefill_len, shape.vocab, out_dir)


if __name__ == "__main__":
    main()
