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
import pstats
import sys
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench_utils import ModelShape, model_dir
from latency import random_prompts, timed_generate

from v1_engine import LLM


def gpu_kernel_ms(prof: profile) -> float:
    """Total device time of the kernels (and copies) the profiler saw, in ms."""
    events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    return sum(e.device_time for e in events) / 1e3


def profile_batch(llm: LLM, batch: int, args, vocab: int, out_dir: Path) -> None:
    steps = args.steps
    timed_generate(llm, random_prompts(batch, args.input_len, vocab, 1), 8)  # warm-up
    short = timed_generate(llm, random_prompts(batch, args.input_len, vocab, 2), 1)
    long = timed_generate(llm, random_prompts(batch, args.input_len, vocab, 3), 1 + steps)
    wall_ms = (long - short) / steps * 1e3

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        timed_generate(llm, random_prompts(batch, args.input_len, vocab, 4), 1 + steps)
    # The trace holds one prefill step too; per-step GPU time is read off the decode share.
    table = prof.key_averages().table(
        sort_by="self_device_time_total", row_limit=30, max_name_column_width=70
    )
    (out_dir / f"kernels_b{batch}.txt").write_text(table)
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
    parser.add_argument("--max-model-len", type=int, default=None, help="default: just enough")
    parser.add_argument("--prefill-len", type=int, default=0, help="also profile this prefill")
    parser.add_argument("--out-dir", default="benchmarks/logs/profile")
    parser.add_argument(
        "--trace", action="store_true", help="also write a Chrome trace per batch (tens of MB)"
    )
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("profile_decode.py needs a CUDA GPU")
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    batch_sizes = [int(b) for b in args.batch_sizes.split(",") if b]
    shape = ModelShape.from_config(args.model)
    max_len = args.max_model_len or max(args.input_len + args.steps, args.prefill_len) + 64
    path, _ = model_dir(args.model, min_positions=max_len)
    llm = LLM(
        model=path,
        load_format="dummy",
        dtype="bfloat16",
        quantization=args.quantization,
        max_model_len=max_len,
        max_num_batched_tokens=max(max_len, 8192),
        max_num_seqs=max(batch_sizes),
        enable_prefix_caching=False,
        compilation_config=args.compilation_level,
    )
    for batch in batch_sizes:
        profile_batch(llm, batch, args, shape.vocab, out_dir)
    if args.prefill_len:
        profile_prefill(llm, args.prefill_len, shape.vocab, out_dir)


if __name__ == "__main__":
    main()
