"""Offline throughput: LLM.generate vs Hugging Face transformers generate, same prompts, same run.

Every request generates exactly --output-len tokens greedily (EOS suppressed until then on both
sides) so both engines do the same work. Prints a short table; appends nothing by itself —
copy the table into benchmarks/RESULTS.md with the date, commit and machine.

    python benchmarks/benchmark_offline.py --num-prompts 32 --output-len 128
"""

from __future__ import annotations

import argparse
import time

import torch
from transformers import AutoModelForCausalLM

from v1_engine import LLM, SamplingParams

TOPICS = [
    "the history of the printing press",
    "how rainbows form",
    "a recipe for bread",
    "the rules of chess",
    "why the sky is blue",
    "the life of honey bees",
    "how vaccines work",
    "the water cycle",
    "a short story about a lighthouse keeper",
    "the basics of Python",
    "the causes of the seasons",
    "a poem about autumn",
    "how airplanes fly",
    "the structure of an atom",
    "tips for learning a language",
    "the invention of the telephone",
]


def make_prompts(n: int) -> list[str]:
    return [f"Write a detailed explanation of {TOPICS[i % len(TOPICS)]}. (#{i})" for i in range(n)]


def bench_v1engine(prompts: list[str], output_len: int, args) -> tuple[float, int, LLM]:
    llm = LLM(model=args.model, max_model_len=1024)
    params = SamplingParams(temperature=0.0, max_tokens=output_len, min_tokens=output_len)
    llm.generate(prompts[:2], SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    return elapsed, sum(len(o.outputs[0].token_ids) for o in outputs), llm


def bench_hf(model_dir: str, tokenizer, prompts: list[str], output_len: int) -> tuple[float, int]:
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    tokenizer.padding_side = "left"
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    batch = tokenizer(prompts, return_tensors="pt", padding=True)
    with torch.no_grad():
        model.generate(**{k: v[:2] for k, v in batch.items()}, max_new_tokens=4, do_sample=False)
        start = time.perf_counter()
        out = model.generate(
            **batch,
            max_new_tokens=output_len,
            min_new_tokens=output_len,
            do_sample=False,
            pad_token_id=tokenizer.pad_token_id,
        )
        elapsed = time.perf_counter() - start
    return elapsed, (out.shape[1] - batch["input_ids"].shape[1]) * len(prompts)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default=None, help="default: the embedded default model")
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    prompts = make_prompts(args.num_prompts)

    v1_time, v1_tokens, llm = bench_v1engine(prompts, args.output_len, args)
    model_dir = llm.config.model_config.model
    hf_time, hf_tokens = bench_hf(model_dir, llm.get_tokenizer(), prompts, args.output_len)

    device = llm.config.resolve_device()
    print(
        f"\nmodel {llm.config.model_config.served_model_name} on {device}, "
        f"{args.num_prompts} prompts x {args.output_len} new tokens, greedy, "
        f"torch threads {torch.get_num_threads()}"
    )
    print(f"{'engine':<28}{'time (s)':>10}{'tokens':>9}{'tok/s':>10}")
    print(
        f"{'v1engine LLM.generate':<28}{v1_time:>10.2f}{v1_tokens:>9}{v1_tokens / v1_time:>10.1f}"
    )
    print(
        f"{'HF transformers generate':<28}{hf_time:>10.2f}{hf_tokens:>9}{hf_tokens / hf_time:>10.1f}"
    )
    print(f"ratio v1engine / HF: {(v1_tokens / v1_time) / (hf_tokens / hf_time):.2f}x")


if __name__ == "__main__":
    main()
