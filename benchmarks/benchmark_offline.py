"""Offline throughput: LLM.generate vs Hugging Face transformers generate, same prompts, same run.

Every request generates exactly --output-len tokens greedily (EOS suppressed until then on both
sides) so both engines do the same work. With --rounds N the engines alternate N times (each
model loaded once) and the table gives each engine's median round and its range, so a machine
whose speed drifts (a shared VM) does not favour whichever engine ran in its fast minute. Prints
a short table; appends nothing by itself: copy it into benchmarks/RESULTS.md with the date,
commit and machine.

    python benchmarks/benchmark_offline.py --num-prompts 32 --output-len 128 --rounds 3
"""

from __future__ import annotations

import argparse
import statistics
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


def make_v1engine(args):
    """The LLM and a function that runs one timed round: (seconds, generated tokens)."""
    llm = LLM(model=args.model, max_model_len=1024, compilation_config=args.compilation_level)
    llm.generate(["Hello"] * 2, SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)

    def run(prompts: list[str], output_len: int) -> tuple[float, int]:
        params = SamplingParams(temperature=0.0, max_tokens=output_len, min_tokens=output_len)
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - start
        return elapsed, sum(len(o.outputs[0].token_ids) for o in outputs)

    return llm, run


def make_hf(model_dir: str, tokenizer):
    """A function that runs one timed round of HF `generate` (left-padded batch, float32)."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    tokenizer.padding_side = "left"
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    with torch.no_grad():
        warm = tokenizer(["Hello"] * 2, return_tensors="pt", padding=True)
        model.generate(**warm, max_new_tokens=4, do_sample=False)

    def run(prompts: list[str], output_len: int) -> tuple[float, int]:
        batch = tokenizer(prompts, return_tensors="pt", padding=True)
        with torch.no_grad():
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

    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="default: the embedded default model")
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=1, help="alternating rounds per engine")
    parser.add_argument(
        "--compilation-level", type=int, default=None, help="v1engine's level (default: device's)"
    )
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error(f"--rounds must be >= 1, got {args.rounds}")
    if args.threads:
        torch.set_num_threads(args.threads)
    prompts = make_prompts(args.num_prompts)

    llm, v1_run = make_v1engine(args)
    hf_run = make_hf(llm.config.model_config.model, llm.get_tokenizer())
    rates: dict[str, list[float]] = {"v1engine": [], "hf": []}
    for _ in range(args.rounds):
        for name, run in (("v1engine", v1_run), ("hf", hf_run)):
            seconds, tokens = run(prompts, args.output_len)
            if tokens != args.num_prompts * args.output_len:
                raise SystemExit(f"{name} generated {tokens} tokens, expected "
                                 f"{args.num_prompts * args.output_len}")  # fmt: skip
            rates[name].append(tokens / seconds)

    device = llm.config.resolve_device()
    level = llm.config.compilation_config.effective_level(device)
    print(
        f"\nmodel {llm.config.model_config.served_model_name} on {device} (-O{level}), "
        f"{args.num_prompts} prompts x {args.output_len} new tokens, greedy, "
        f"torch threads {torch.get_num_threads()}, {args.rounds} alternating round(s)"
    )
    print(f"{'engine':<28}{'median tok/s':>14}{'min':>9}{'max':>9}")
    labels = {"v1engine": "v1engine LLM.generate", "hf": "HF transformers generate"}
    for name, values in rates.items():
        print(f"{labels[name]:<28}{statistics.median(values):>14.1f}"
              f"{min(values):>9.1f}{max(values):>9.1f}")  # fmt: skip
    ratios = [a / b for a, b in zip(rates["v1engine"], rates["hf"])]
    print(
        f"ratio v1engine / HF: median {statistics.median(rates['v1engine']) / statistics.median(rates['hf']):.2f}x"
        f" (per round {', '.join(f'{r:.2f}' for r in ratios)})"
    )


if __name__ == "__main__":
    main()
