"""Decode ms/step and prefill time on a benchmark config with dummy weights, against rooflines.

Decode: B requests of --input-len random tokens, prefilled in one step, generate 1 + N tokens; the
time from their first token to their last, over N, is one decode step at batch B (by the
requests' timestamps, so the prefill stays out). The HBM
roofline of a step is (weights except the input embedding + the KV bytes the batch reads) at
4.29 TB/s on the H200 (the goals' figure), at the copy rate measured in the run on other cards;
the table gives roofline / measured (1.0 = at the roofline).

Prefill: one prompt of L tokens in one step (max_tokens=1), against the FLOP roofline at the bf16
GEMM rate torch.mm reaches in the same run.

    python benchmarks/latency.py --model llama3-8b --append
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_utils import (
    ModelShape,
    append_results,
    apply_gemm_tables,
    benchmark_max_model_len,
    hbm_bytes_per_s,
    measure_gemm_tflops,
    model_dir,
    switches,
)

from v1_engine import LLM, SamplingParams
from v1_engine.config import LM_HEAD_QUANTIZATION_CHOICES, CompilationConfig


def random_prompts(num: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (num, length), generator=gen).tolist()


def timed_generate(llm: LLM, prompts: list[list[int]], max_tokens: int) -> float:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    torch.cuda.synchronize()
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    assert all(len(o.outputs[0].token_ids) == max_tokens for o in outputs)
    return elapsed


def compilation_config(
    level: int,
    fusion_passes: str | None,
    add_fusion_passes: str | None,
    drop_fusion_passes: str | None = None,
) -> int | dict:
    """The engine's `compilation_config` from the `--fusion-passes` (instead of the default set),
    `--add-fusion-passes` (on top of it) and `--drop-fusion-passes` (left out of it) options:
    the bare level where none is given."""
    if fusion_passes is None and not add_fusion_passes and not drop_fusion_passes:
        return level
    if fusion_passes is not None:
        passes = [p for p in fusion_passes.split(",") if p]
    else:
        passes = CompilationConfig().effective_fusion_passes("cuda")
    passes += [p for p in (add_fusion_passes or "").split(",") if p and p not in passes]
    dropped = {p for p in (drop_fusion_passes or "").split(",") if p}
    if dropped - set(passes):  # else an A/B would time the same passes twice
        raise ValueError(
            f"--drop-fusion-passes names {sorted(dropped - set(passes))}, not in the passes run: "
            f"{passes}"
        )
    return {"level": level, "fusion_passes": [p for p in passes if p not in dropped]}


def decode_ms_per_step(
    llm: LLM, batch: int, input_len: int, steps: int, vocab: int, repeats: int
) -> float:
    """Median over `repeats` of one decode step at `batch`: each repeat generates 1 + steps
    tokens for fresh prompts, and the requests' timestamps give the time from the first token
    (the prefill step's, the same step for all: main() sizes the token budget for it) to the
    last, over `steps`. The prefill's own time stays out: subtracting a 1-token run instead
    carried its run-to-run spread (~12 ms at 64 x 1k prompt tokens, 0.4 ms over 32 steps)."""
    # Warm-up at this batch size: kernels specialised for its shapes compile outside the timing.
    timed_generate(llm, random_prompts(batch, input_len, vocab, 1000 + batch), 3)
    params = SamplingParams(temperature=0.0, max_tokens=1 + steps, ignore_eos=True)
    samples = []
    for r in range(repeats):
        outputs = llm.generate(random_prompts(batch, input_len, vocab, r), params, use_tqdm=False)
        assert all(len(o.outputs[0].token_ids) == 1 + steps for o in outputs)
        first = max(o.metrics.first_token_time for o in outputs)
        last = max(o.metrics.finished_time for o in outputs)
        samples.append((last - first) / steps * 1e3)
    return sorted(samples)[len(samples) // 2]


def prefill_ms(llm: LLM, length: int, vocab: int, repeats: int) -> float:
    timed_generate(llm, random_prompts(1, length, vocab, 100), 1)  # warm-up at this shape
    samples = [
        timed_generate(llm, random_prompts(1, length, vocab, 101 + r), 1) * 1e3
        for r in range(repeats)
    ]
    return sorted(samples)[len(samples) // 2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="llama3-8b", help="a folder of benchmarks/configs")
    parser.add_argument("--batch-sizes", default="1,8,32,64,128,256")
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--decode-steps", type=int, default=32)
    parser.add_argument("--prefill-lens", default="1024,4096,16384")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.85)
    parser.add_argument(
        "--compilation-level",
        type=int,
        default=2,
        help="0 eager, 1 torch.compile, 2 also full decode CUDA graphs (default)",
    )
    parser.add_argument(
        "--quantization", default=None, choices=("fp8",), help="fp8: online FP8 weights"
    )
    parser.add_argument(
        "--lm-head-quantization",
        default="auto",
        choices=LM_HEAD_QUANTIZATION_CHOICES,
        help="the LM head under --quantization fp8 (ModelConfig.lm_head_quantization; auto: "
        "fp8_rescored on CUDA)",
    )
    parser.add_argument(
        "--kv-cache-dtype",
        default="auto",
        choices=("auto", "fp8"),
        help="fp8: an e4m3 K/V cache (the roofline columns still count a bf16 cache)",
    )
    parser.add_argument(
        "--fusion-passes",
        default=None,
        help="comma-separated fusion passes to apply instead of the default set (A/B of a pass)",
    )
    parser.add_argument(
        "--add-fusion-passes",
        default=None,
        help="comma-separated fusion passes to apply on top of the default set (A/B of an "
        "opt-in pass)",
    )
    parser.add_argument(
        "--drop-fusion-passes",
        default=None,
        help="comma-separated fusion passes to leave out of the default set (A/B of a default "
        "pass)",
    )
    parser.add_argument(
        "--max-model-len",
        type=int,
        default=None,
        help="the engine's max_model_len; default: the model's own context (its config's "
        "max_position_embeddings, as a server runs it), raised to what the run needs. Decode "
        "CUDA graphs are captured for this length, so it sets their split-KV factor",
    )
    parser.add_argument(
        "--gemm-tables",
        default=None,
        help="a JSON file of GEMM dispatch entries to add before the engine starts (written by "
        "benchmark_gemm_bf16.py --json / benchmark_fp8_gemm.py --tune --json): the engine-level "
        "A/B of a table change before it is committed",
    )
    parser.add_argument("--append", action="store_true", help="append to benchmarks/RESULTS.md")
    args = parser.parse_args()
    if args.gemm_tables:
        print(apply_gemm_tables(args.gemm_tables), flush=True)
    batch_sizes = [int(b) for b in args.batch_sizes.split(",") if b]
    prefill_lens = [int(n) for n in args.prefill_lens.split(",") if n]

    compilation = compilation_config(
        args.compilation_level, args.fusion_passes, args.add_fusion_passes, args.drop_fusion_passes
    )
    if isinstance(compilation, dict):
        args.fusion_passes = ",".join(compilation["fusion_passes"])
    shape = ModelShape.from_config(args.model)
    longest = max(prefill_lens + [args.input_len + args.decode_steps + 1]) + 128
    path, note = model_dir(args.model, min_positions=longest)
    max_model_len = benchmark_max_model_len(path, longest, args.max_model_len)
    gemm_tflops = measure_gemm_tflops()
    hbm_rate, hbm_source = hbm_bytes_per_s(torch.cuda.get_device_name())
    llm = LLM(
        model=path,
        load_format="dummy",
        dtype="bfloat16",
        max_model_len=max_model_len,
        # A batch's prompts prefill in one step, so its decode steps all run at full batch.
        max_num_batched_tokens=max(longest, 8192, max(batch_sizes) * args.input_len),
        max_num_seqs=max(batch_sizes),
        enable_prefix_caching=False,
        compilation_config=compilation,
        gpu_memory_utilization=args.gpu_memory_utilization,
        quantization=args.quantization,
        lm_head_quantization=args.lm_head_quantization,
        kv_cache_dtype=args.kv_cache_dtype,
    )
    timed_generate(llm, random_prompts(2, args.input_len, shape.vocab, 99), 4)  # warm-up
    mode = "eager -O0" if args.compilation_level == 0 else f"compiled -O{args.compilation_level}"
    if args.fusion_passes is not None:
        mode += f", fusion passes [{args.fusion_passes}]"

    lines = [
        (
            f"model {args.model} (dummy weights, bf16"
            f"{', FP8 weights (roofline columns: the bf16 model)' if args.quantization else ''}"
            f"{', LM head ' + args.lm_head_quantization if args.quantization else ''}"
            f"{', e4m3 K/V cache' if args.kv_cache_dtype == 'fp8' else ''}"
            f", {mode}, max_model_len {max_model_len}){'; ' + note if note else ''}; "
            f"bf16 GEMM measured {gemm_tflops:.0f} TFLOP/s; HBM roofline {hbm_rate / 1e12:.2f} "
            f"TB/s ({hbm_source}); {switches()}"
        ),
        "",
        f"Decode ({args.input_len}-token prompts, {args.decode_steps} steps measured):",
        "",
        "| batch | ms/step | roofline ms | roofline/measured | tok/s |",
        "| ---: | ---: | ---: | ---: | ---: |",
    ]
    for batch in batch_sizes:
        ms = decode_ms_per_step(
            llm, batch, args.input_len, args.decode_steps, shape.vocab, args.repeats
        )
        mean_context = args.input_len + 1 + args.decode_steps / 2
        kv_bytes = batch * mean_context * shape.kv_bytes_per_token()
        roof_ms = (shape.decode_weight_bytes() + kv_bytes) / hbm_rate * 1e3
        lines.append(
            f"| {batch} | {ms:.3f} | {roof_ms:.3f} | {roof_ms / ms:.3f} | {batch / ms * 1e3:.1f} |"
        )
        print(lines[-1], flush=True)
    lines += [
        "",
        "Prefill (one prompt, one step):",
        "",
        "| tokens | ms | TFLOP/s | FLOP roofline ms | fraction of GEMM rate |",
        "| ---: | ---: | ---: | ---: | ---: |",
    ]
    for length in prefill_lens:
        ms = prefill_ms(llm, length, shape.vocab, args.repeats)
        flops = shape.prefill_flops(length)
        roof_ms = flops / (gemm_tflops * 1e12) * 1e3
        lines.append(
            f"| {length} | {ms:.1f} | {flops / ms / 1e9:.0f} | {roof_ms:.1f} | {roof_ms / ms:.2f} |"
        )
        print(lines[-1], flush=True)
    table = "\n".join(lines)
    print("\n" + table)
    if args.append:
        append_results(f"latency: {args.model}", "python " + " ".join(sys.argv), table)


if __name__ == "__main__":
    main()
