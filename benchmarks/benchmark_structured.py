"""Structured outputs: what a grammar costs a step.

Two parts, both on this machine's CPU unless --device cuda:
1. The per-step grammar work alone, for B constrained rows: accepting each row's newest token
   and filling its bitmask row (xgrammar, host), then masking the [B, V] logits
   (`apply_token_bitmask`, on --device), over a JSON schema whose rows sit at different points
   of their objects. Reports microseconds per step and per row.
2. End to end on the default model (offline LLM, greedy, --num-prompts x --output-len tokens,
   EOS ignored so every request generates the same count): output tokens/s unconstrained
   and with every request held to a JSON schema, alternating --rounds times.

Prints tables; copy them into benchmarks/RESULTS.md with the date, commit and machine.

    python benchmarks/benchmark_structured.py --rounds 3
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from v1_engine import LLM, SamplingParams, StructuredOutputsParams
from v1_engine.structured_output import (
    GrammarCompilerService,
    RequestGrammar,
    allocate_bitmask,
    apply_token_bitmask,
)

SCHEMA = {
    "type": "object",
    "properties": {
        "title": {"type": "string"},
        "year": {"type": "integer"},
        "tags": {"type": "array", "items": {"type": "string"}},
        "rating": {"type": "number"},
    },
    "required": ["title", "year", "tags", "rating"],
}
SAMPLE = {"title": "The Lighthouse", "year": 1927, "tags": ["novel", "sea", "time"], "rating": 4.5}


def grammar_step_cost(args, model_dir, vocab: int, tokenizer) -> None:
    compiler = GrammarCompilerService(model_dir, vocab)
    spec = StructuredOutputsParams(json=SCHEMA)
    compiler.submit(spec).result()
    text_ids = tokenizer.encode(json.dumps(SAMPLE), add_special_tokens=False)
    device = torch.device(args.device)
    print(f"\n| rows | host: accept + fill (us a step) | per row | mask apply on {device} (us) |")
    print("| ---: | ---: | ---: | ---: |")
    for rows in args.rows:
        # Row r starts r tokens into the sample, so the rows' matchers are in different states.
        grammars = [
            RequestGrammar(compiler.submit(spec), tokenizer.eos_token_id) for _ in range(rows)
        ]
        outputs = [list(text_ids[: r % (len(text_ids) - 4)]) for r in range(rows)]
        bitmask = allocate_bitmask(rows, vocab)
        for g, out in zip(grammars, outputs):
            g.fill_bitmask(out, bitmask, 0)
        fills = []
        for step in range(args.steps):
            for r, out in enumerate(outputs):  # one more token each, as a decode step adds
                nxt = (len(out)) % (len(text_ids) - 4)
                if nxt == 0:
                    grammars[r] = RequestGrammar(compiler.submit(spec), tokenizer.eos_token_id)
                    out.clear()
                    grammars[r].fill_bitmask(out, bitmask, r)
                out.append(text_ids[len(out)])
            start = time.perf_counter()
            bitmask = allocate_bitmask(rows, vocab)
            for r, (g, out) in enumerate(zip(grammars, outputs)):
                g.fill_bitmask(out, bitmask, r)
            fills.append(time.perf_counter() - start)
        logits = torch.randn(rows, vocab, device=device)
        mask = bitmask.to(device)
        applies = []
        for _ in range(args.steps):
            if device.type == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            apply_token_bitmask(logits, mask)
            if device.type == "cuda":
                torch.cuda.synchronize()
            applies.append(time.perf_counter() - start)
        fill_us = statistics.median(fills) * 1e6
        apply_us = statistics.median(applies) * 1e6
        print(f"| {rows} | {fill_us:.0f} | {fill_us / rows:.1f} | {apply_us:.0f} |")


def end_to_end(args) -> None:
    llm = LLM(max_model_len=1024, compilation_config=args.compilation_level)
    prompts = [f"Describe book number {i} as JSON with title, year, tags and rating:" for i in
               range(args.num_prompts)]  # fmt: skip
    free = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    constrained = SamplingParams(
        temperature=0.0, max_tokens=args.output_len, ignore_eos=True,
        structured_outputs=StructuredOutputsParams(json=SCHEMA),
    )  # fmt: skip
    llm.generate(prompts[:2], constrained, use_tqdm=False)  # compile + warm up
    rates: dict[str, list[float]] = {"unconstrained": [], "JSON schema": []}
    for _ in range(args.rounds):
        for name, params in (("unconstrained", free), ("JSON schema", constrained)):
            start = time.perf_counter()
            outs = llm.generate(prompts, params, use_tqdm=False)
            elapsed = time.perf_counter() - start
            rates[name].append(sum(len(o.outputs[0].token_ids) for o in outs) / elapsed)
    print(f"\n| requests ({args.num_prompts} x {args.output_len} tokens) | output tok/s, median "
          "| range |")  # fmt: skip
    print("| --- | ---: | --- |")
    for name, values in rates.items():
        print(f"| {name} | {statistics.median(values):.1f} | {min(values):.1f}-{max(values):.1f} |")
    ratio = statistics.median(rates["JSON schema"]) / statistics.median(rates["unconstrained"])
    print(f"\nconstrained / unconstrained: {ratio:.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32, 128])
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--compilation-level", type=int, default=0)
    parser.add_argument("--skip-end-to-end", action="store_true")
    args = parser.parse_args()

    from transformers import AutoConfig

    from v1_engine.models.loader import get_tokenizer, resolve_model_path

    model_dir = resolve_model_path(None)
    vocab = AutoConfig.from_pretrained(model_dir).vocab_size
    tokenizer = get_tokenizer(model_dir)
    print(f"default model: vocabulary {vocab}; torch {torch.__version__}")
    grammar_step_cost(args, model_dir, vocab, tokenizer)
    if not args.skip_end_to_end:
        end_to_end(args)


if __name__ == "__main__":
    main()
