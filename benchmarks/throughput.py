"""Offline throughput on a benchmark config with dummy weights, against the workload's bound.

Workload (fixed seed): --num-requests requests with input lengths uniform in
[--min-input, --max-input] of random token ids and --output-len output tokens each (EOS ignored).
The lower bound is the prefill FLOPs at the bf16 GEMM rate measured in the same run plus the
decode bytes at 4.29 TB/s (every decode step reads the weights except the input embedding and the
KV of every running request, all requests running together).

With --peer, Hugging Face transformers runs the same workload in the same process, through its
continuous batching (`generate_batch`, attn_implementation "paged|sdpa") when it has it, else
`generate` in padded batches.

    python benchmarks/throughput.py --model llama3-8b --peer --append
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_utils import (
    HBM_BYTES_PER_S,
    ModelShape,
    append_results,
    measure_gemm_tflops,
    model_dir,
)

from v1_engine import LLM, SamplingParams


def make_workload(
    num: int, min_input: int, max_input: int, vocab: int, seed: int
) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(min_input, max_input + 1, (num,), generator=gen).tolist()
    return [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in lengths]


def lower_bound_s(
    shape: ModelShape, prompts: list[list[int]], output_len: int, gemm_tflops: float
) -> tuple[float, float]:
    """(prefill seconds at the GEMM rate, decode seconds at HBM bandwidth)."""
    prefill_flops = sum(shape.prefill_flops(len(p)) for p in prompts)
    decode_bytes = 0.0
    for step in range(output_len - 1):  # the first output token comes out of the prefill
        kv_tokens = sum(len(p) + 1 + step for p in prompts)
        decode_bytes += shape.decode_weight_bytes() + kv_tokens * shape.kv_bytes_per_token()
    return prefill_flops / (gemm_tflops * 1e12), decode_bytes / HBM_BYTES_PER_S


def run_v1engine(path: str, prompts: list[list[int]], output_len: int, args) -> tuple[float, int]:
    llm = LLM(
        model=path,
        load_format="dummy",
        dtype="bfloat16",
        max_model_len=args.max_input + output_len + 16,
        max_num_seqs=args.max_num_seqs,
        compilation_config=args.compilation_level,
        gpu_memory_utilization=args.gpu_memory_utilization,
    )
    # Warm-up over a slice of the workload's shapes (batch sizes, prefill + decode mixes), so that
    # kernel compilation stays out of the timing.
    warm = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    llm.generate([p[:256] for p in prompts[:32]], warm, use_tqdm=False)
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    torch.cuda.synchronize()
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    generated = sum(len(o.outputs[0].token_ids) for o in outputs)
    del llm
    gc.collect()
    torch.cuda.empty_cache()
    return elapsed, generated


def run_hf_peer(path: str, prompts: list[list[int]], output_len: int) -> tuple[float, int, str]:
    """(seconds, generated tokens, how) for transformers on the same workload, random weights."""
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    config = AutoConfig.from_pretrained(path)
    try:
        import transformers.generation.continuous_batching  # noqa: F401

        continuous = True
    except ImportError:
        continuous = False
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(
            config,
            dtype=torch.bfloat16,
            attn_implementation="paged|sdpa" if continuous else "sdpa",
        ).eval()
    gen_config = GenerationConfig(
        max_new_tokens=output_len, do_sample=False, eos_token_id=None, pad_token_id=0
    )
    if continuous:
        model.generate_batch(inputs=[p[:64] for p in prompts[:4]], generation_config=gen_config)
        torch.cuda.synchronize()
        start = time.perf_counter()
        results = model.generate_batch(inputs=prompts, generation_config=gen_config)
        torch.cuda.synchronize()
        elapsed = time.perf_counter() - start
        generated = sum(len(r.generated_tokens) for r in results.values())
        return elapsed, generated, "generate_batch (paged|sdpa)"
    start = time.perf_counter()
    generated = 0
    for i in range(0, len(prompts), 64):
        batch = prompts[i : i + 64]
        width = max(len(p) for p in batch)
        ids = torch.tensor([[0] * (width - len(p)) + p for p in batch], device="cuda")
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch], device="cuda")
        with torch.no_grad():
            out = model.generate(
                input_ids=ids,
                attention_mask=mask,
                generation_config=gen_config,
                min_new_tokens=output_len,
            )
        generated += (out.shape[1] - width) * len(batch)
    torch.cuda.synchronize()
    return time.perf_counter() - start, generated, "generate in padded batches of 64"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="llama3-8b", help="a folder of benchmarks/configs")
    parser.add_argument("--num-requests", type=int, default=256)
    parser.add_argument("--min-input", type=int, default=64)
    parser.add_argument("--max-input", type=int, default=1024)
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.85)
    parser.add_argument(
        "--compilation-level",
        type=int,
        default=2,
        help="0 eager, 1 torch.compile, 2 also full decode CUDA graphs (default)",
    )
    parser.add_argument("--peer", action="store_true", help="also run HF transformers")
    parser.add_argument("--append", action="store_true", help="append to benchmarks/RESULTS.md")
    args = parser.parse_args()

    shape = ModelShape.from_config(args.model)
    path, _ = model_dir(args.model)
    prompts = make_workload(
        args.num_requests, args.min_input, args.max_input, shape.vocab, args.seed
    )
    input_tokens = sum(len(p) for p in prompts)
    gemm_tflops = measure_gemm_tflops()
    prefill_s, decode_s = lower_bound_s(shape, prompts, args.output_len, gemm_tflops)
    bound = prefill_s + decode_s

    elapsed, generated = run_v1engine(path, prompts, args.output_len, args)
    rows = [(f"v1engine -O{args.compilation_level}", elapsed, generated)]
    how = ""
    if args.peer:
        peer_s, peer_generated, how = run_hf_peer(path, prompts, args.output_len)
        rows.append((f"transformers {how}", peer_s, peer_generated))

    lines = [
        (
            f"model {args.model} (dummy weights, bf16); {args.num_requests} requests, input "
            f"{args.min_input}..{args.max_input} (total {input_tokens} tokens, seed {args.seed}), "
            f"{args.output_len} output tokens each, ignore_eos"
        ),
        (
            f"lower bound {bound:.2f} s = prefill {prefill_s:.2f} s at {gemm_tflops:.0f} TFLOP/s "
            f"(measured bf16 GEMM) + decode {decode_s:.2f} s at 4.29 TB/s"
        ),
        "",
        "| engine | seconds | output tok/s | total tok/s | lower bound / seconds |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    for name, seconds, gen_tokens in rows:
        lines.append(
            f"| {name} | {seconds:.2f} | {gen_tokens / seconds:.0f} | "
            f"{(gen_tokens + input_tokens) / seconds:.0f} | {bound / seconds:.3f} |"
        )
    if args.peer:
        lines.append("")
        lines.append(f"speed-up over transformers: {rows[1][1] / rows[0][1]:.1f}x")
    table = "\n".join(lines)
    print("\n" + table)
    if args.append:
        append_results(f"throughput: {args.model}", "python " + " ".join(sys.argv), table)


if __name__ == "__main__":
    main()
