"""Speculative decoding with n-gram drafts: what it gains, and what it costs where drafts miss.

The offline LLM on the default model (or --model), greedy, two workloads of chat prompts:
- "edit": rewrite / fix / annotate a given piece of code or text, where the answer copies long
  runs of the prompt (prompt lookup's case);
- "open": open questions, where little repeats.
Each workload runs without drafts and with ngram drafts of each --k, alternating --rounds times
(the best round is reported): output tokens/s, its ratio to no drafts measured in the same run,
draft tokens kept (acceptance rate), tokens per verify step, and whether every output equals the
output without drafts (it must: greedy output is unchanged).

    python benchmarks/benchmark_spec_decode.py --rounds 2
    python benchmarks/benchmark_spec_decode.py --batch 1 --num-prompts 4 --rounds 2

On a GPU without real weights, `--config llama3-8b` (benchmarks/configs, dummy weights, bf16)
runs the "repeat" workload instead: logit_bias forces one token over and over, so every draft
is kept and the table shows what a verify step of k + 1 positions costs against a decode step
(the best case: k + 1 tokens a verify step), and "reject", where a second forced token makes
every draft wrong (the worst case: drafts that are never kept).

    python benchmarks/benchmark_spec_decode.py --config llama3-8b --batch 1 --num-prompts 2 \
        --gpu-memory-utilization 0.3

Copy the table into benchmarks/RESULTS.md with the date, commit and machine.
"""

from __future__ import annotations

import argparse
import time

import msgspec

from v1_engine import LLM, SamplingParams
from v1_engine.spec_decode.draft_counter import DraftCounter

SNIPPETS = [
    "def mean(xs):\n    total = 0\n    for x in xs:\n        total += x\n    return total / len(xs)\n",
    (
        "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n"
        "        self.items.append(item)\n\n    def pop(self):\n        return self.items.pop()\n"
    ),
    (
        "def is_prime(n):\n    if n < 2:\n        return False\n    for d in range(2, int(n ** 0.5) + 1):\n"
        "        if n % d == 0:\n            return False\n    return True\n"
    ),
    (
        "def fizzbuzz(n):\n    for i in range(1, n + 1):\n        if i % 15 == 0:\n            print('FizzBuzz')\n"
        "        elif i % 3 == 0:\n            print('Fizz')\n        elif i % 5 == 0:\n"
        "            print('Buzz')\n        else:\n            print(i)\n"
    ),
]
TEXTS = [
    (
        "The meeting is moved to Thursday at 3 pm in room 204. Please bring the quarterly report, "
        "the budget draft and your laptop. Lunch will be provided for everyone who confirms by Monday."
    ),
    (
        "Our store opens at 9 am and closes at 6 pm from Monday to Friday. On Saturday we open at "
        "10 am and close at 4 pm. We are closed on Sunday and on public holidays."
    ),
]
EDIT_TASKS = [
    "Add type hints to this Python code and return the whole code:\n\n{}",
    "Add a docstring to every function in this code and return the whole code:\n\n{}",
    "Rename the variables in this code to longer names and return the whole code:\n\n{}",
    "Fix the style of this code and return it:\n\n{}",
]
TEXT_TASKS = [
    "Correct the grammar of this text and return it in full:\n\n{}",
    "Repeat this text exactly, then translate it into French:\n\n{}",
]
OPEN = [
    "Why is the sky blue?",
    "Give me three tips for a job interview.",
    "What is the difference between a list and a tuple in Python?",
    "Write a short poem about autumn.",
    "How do vaccines work?",
    "Explain recursion to a child.",
    "What should I pack for a weekend hike?",
    "Describe the water cycle.",
]


def forced_workloads(count: int, max_tokens: int) -> dict[str, tuple[list, list]]:
    """(conversations, params) per workload whose output logit_bias forces: "repeat" one token
    (every draft kept), "reject" random draws among 16 equally biased tokens (drafts copied from
    earlier bigrams, right one time in 16)."""
    conversations = [f"Say something {i}." for i in range(count)]  # plain prompts
    repeat = SamplingParams(
        temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logit_bias={1000: 100.0}
    )
    noise = {t: 100.0 for t in range(1000, 1016)}
    reject = [
        SamplingParams(
            temperature=1.0, seed=i, max_tokens=max_tokens, ignore_eos=True, logit_bias=noise
        )
        for i in range(count)
    ]
    return {"repeat": (conversations, [repeat] * count), "reject": (conversations, reject)}


def workloads(batch: int) -> dict[str, list[list[dict[str, str]]]]:
    edit = [t.format(s) for t in EDIT_TASKS for s in SNIPPETS]
    edit += [t.format(s) for t in TEXT_TASKS for s in TEXTS]
    return {
        "edit": [[{"role": "user", "content": p}] for p in (edit * batch)[:batch]],
        "open": [[{"role": "user", "content": p}] for p in (OPEN * batch)[:batch]],
    }


def run(llm: LLM, conversations, params, batch: int) -> tuple[float, list[list[int]], DraftCounter]:
    """The conversations `batch` at a time (one generate call each)."""
    counter = DraftCounter(llm)
    tokens = []
    start = time.perf_counter()
    for i in range(0, len(conversations), batch):
        chunk_params = params[i : i + batch] if isinstance(params, list) else params
        chunk = conversations[i : i + batch]
        if isinstance(chunk[0], str):
            outputs = llm.generate(chunk, chunk_params, use_tqdm=False)
        else:
            outputs = llm.chat(chunk, chunk_params, use_tqdm=False)
        tokens += [o.outputs[0].token_ids for o in outputs]
    elapsed = time.perf_counter() - start
    return elapsed, tokens, counter


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="model (default: the embedded default)")
    parser.add_argument("--k", type=int, nargs="+", default=[2, 4], help="draft tokens per step")
    parser.add_argument("--batch", type=int, default=16, help="conversations per generate call")
    parser.add_argument(
        "--num-prompts", type=int, default=None, help="conversations per workload (default: batch)"
    )
    parser.add_argument(
        "--draft-backoff",
        type=int,
        nargs="+",
        default=[8],
        help="speculative_config.draft_backoff values (an engine for each k and value; 0: none)",
    )
    parser.add_argument(
        "--piecewise-verify",
        action="store_true",
        help="compilation_config verify_cudagraphs false: verify steps through the piecewise "
        "graphs (the default captures full CUDA graphs for them)",
    )
    parser.add_argument("--max-tokens", type=int, default=160)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=None,
        help="the GPU share of each engine (one per k and one without drafts share the GPU): "
        "e.g. 0.3",
    )
    parser.add_argument(
        "--config",
        default=None,
        help="a config of benchmarks/configs with dummy weights (bf16): the forced workloads",
    )
    args = parser.parse_args()

    common: dict = {"model": args.model, "max_model_len": args.max_model_len}
    if args.piecewise_verify:
        common["compilation_config"] = {"verify_cudagraphs": False}
    if args.config is not None:
        from bench_utils import model_dir

        common.update(model=model_dir(args.config)[0], load_format="dummy", dtype="bfloat16")
    engines: dict[str, LLM] = {}
    variants = [("none", None)]
    for k in args.k:
        for b in args.draft_backoff:
            label = str(k) if len(args.draft_backoff) == 1 else f"{k}, back-off {b}"
            variants.append((label, {"method": "ngram", "num_speculative_tokens": k,
                                     "draft_backoff": b}))  # fmt: skip
    for i, (label, spec) in enumerate(variants):
        if args.gpu_memory_utilization is not None:
            # The profile counts the engines built before this one as used memory.
            common["gpu_memory_utilization"] = args.gpu_memory_utilization * (i + 1)
        engines[label] = LLM(speculative_config=spec, **common)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)

    print(
        f"\n{args.num_prompts or args.batch} conversations, {args.batch} at a time, greedy, up to "
        f"{args.max_tokens} tokens, best of {args.rounds}"
    )
    print("| workload | drafts (k) | output tok/s | vs none | kept drafts | tokens / verify "
          "| outputs equal |")  # fmt: skip
    print("| --- | ---: | ---: | ---: | ---: | ---: | --- |")
    count = args.num_prompts or args.batch
    if args.config is not None:
        cases = forced_workloads(count, args.max_tokens)
    else:
        cases = {name: (convs, params) for name, convs in workloads(count).items()}
    for name, (conversations, case_params) in cases.items():
        best: dict[str, float] = {}
        tokens: dict[str, list[list[int]]] = {}
        counters: dict[str, DraftCounter] = {}
        # Untimed: the first requests of each engine and sampling mode pay one-time costs
        # (kernels compiled on first use), which would count against whichever runs first.
        warm_up = msgspec.structs.replace(case_params, max_tokens=min(16, args.max_tokens))
        for llm in engines.values():
            run(llm, conversations[: args.batch], warm_up, args.batch)
        for _ in range(args.rounds):
            for k, llm in engines.items():
                elapsed, out, counter = run(llm, conversations, case_params, args.batch)
                rate = sum(map(len, out)) / elapsed
                if rate > best.get(k, 0.0):
                    best[k], tokens[k], counters[k] = rate, out, counter
        for k in engines:
            c = counters[k]
            kept = f"{c.accepted / c.draft_tokens:.0%}" if c.draft_tokens else "-"
            # Every step of a drafted request yields kept + 1 tokens.
            per_verify = f"{(c.accepted + c.drafts) / c.drafts:.2f}" if c.drafts else "-"
            equal = "yes" if tokens[k] == tokens["none"] else "NO"
            if name == "reject":
                equal = "random"  # seeded, but drafts change which draw a position takes
            print(
                f"| {name} | {k} | {best[k]:.1f} | {best[k] / best['none']:.2f}x | {kept} "
                f"| {per_verify} | {equal} |"
            )


if __name__ == "__main__":
    main()
