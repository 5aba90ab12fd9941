"""FP8 accuracy: logits and greedy tokens of an FP8 variant of the model against the model dtype.

Variants (`--variant`): `kv` an e4m3 KV cache with the layers' scales (1.0 unless set), the
weights as stored; `weights` the linear layers quantized to FP8 at load (quantization="fp8"),
the LM head in the model dtype; `head` those and the LM head too (lm_head_quantization="fp8");
`head_weight_only` the FP8 linears and an LM head whose weight only is e4m3 (per vocabulary row,
as the FP8 head scales it) while its input stays in the model dtype, emulated by the
dequantized weight (exact in float32 on the CPU; one more rounding in bf16): how much of the FP8
head's error is its activation's quantization; `head_rescored` the FP8 linears and the rescored
FP8 head (lm_head_quantization="fp8_rescored"): FP8 scores, each strided 1024-token slice's top 4
recomputed in the model dtype; its argmax figures should equal `weights`'.

For each prompt the reference model (model-dtype weights and cache: bf16 on a GPU, float32 on
the CPU) runs over its own paged cache, decoding greedily: that sequence is the reference. Then
the variant runs the same prompt and the same tokens (teacher forcing). Per generated position
it compares the logits (max and mean |difference|) and the argmax (top-1 agreement). The
variant decoding greedily on its own would produce the reference tokens exactly up to the first
position whose argmax differs, so the common greedy prefix is read off the same run.

    python benchmarks/fp8_accuracy.py                    # kv, default model, 8 prompts x 64 tokens
    python benchmarks/fp8_accuracy.py --variant head --model DIR --max-tokens 128 --append

The last line printed is a markdown table row for benchmarks/RESULTS.md (--append writes a dated
section there).
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_utils import append_results

from v1_engine.attention.backend import AttentionMetadata
from v1_engine.attention.selector import get_attn_backend
from v1_engine.forward_context import set_forward_context
from v1_engine.models.loader import (
    get_model,
    get_tokenizer,
    load_hf_config,
    resolve_model_path,
)
from v1_engine.worker.model_runner import resolve_dtype

PROMPTS = [
    "The capital of France is",
    "Write a haiku about the sea.",
    "1, 2, 3, 4,",
    "def fibonacci(n):",
    (
        "Once upon a time, in a small village nestled between two mountains, there lived an old "
        "clockmaker who"
    ),
    "Q: What is the boiling point of water in Celsius?\nA:",
    "Explain in one paragraph why the sky is blue.",
    "List three primary colors:",
]
BLOCK_SIZE = 16


class PagedRequest:
    """One request stepped through the model over its own paged cache (blocks in order)."""

    def __init__(self, model: torch.nn.Module, backend, cache_dtype: torch.dtype, max_len: int):
        self.model, self.backend = model, backend
        self.layers = model.attention_layers()
        device = next(model.parameters()).device
        self.device = device
        num_blocks = -(-max_len // BLOCK_SIZE)
        self.caches = [
            torch.zeros(
                layer.kv_cache_shape(num_blocks, BLOCK_SIZE), dtype=cache_dtype, device=device
            )
            for layer in self.layers
        ]
        self.block_table = torch.arange(num_blocks, dtype=torch.int32, device=device)[None]

    @torch.inference_mode()
    def logits(self, token_ids: list[int], start: int) -> torch.Tensor:
        """float32 logits [V] after feeding token_ids at positions start.. (K/V cached)."""
        for layer, cache in zip(self.layers, self.caches):
            layer.kv_cache = cache
        n, d = len(token_ids), self.device
        positions = torch.arange(start, start + n, device=d)
        qsl_cpu = torch.tensor([0, n], dtype=torch.int32)
        seq_lens_cpu = torch.tensor([start + n], dtype=torch.int32)
        metadata = AttentionMetadata(
            num_actual_tokens=n,
            query_start_loc=qsl_cpu.to(d),
            seq_lens=seq_lens_cpu.to(d),
            block_table=self.block_table,
            slot_mapping=positions.clone(),  # blocks in order: slot == position
            max_query_len=n,
            max_seq_len=start + n,
            query_start_loc_cpu=qsl_cpu,
            seq_lens_cpu=seq_lens_cpu,
        )
        input_ids = torch.tensor(token_ids, device=d)
        with set_forward_context(metadata, self.backend, self.layers):
            hidden = self.model(input_ids, positions)
        return self.model.compute_logits(hidden[-1:])[0].float()


def run_sequence(
    request: PagedRequest, prompt: list[int], max_tokens: int, forced: list[int] | None
) -> tuple[list[int], torch.Tensor]:
    """(tokens, logits [max_tokens, V]): greedy when `forced` is None, else teacher-forced."""
    logits = [request.logits(prompt, 0)]
    tokens: list[int] = []
    for step in range(max_tokens):
        token = forced[step] if forced is not None else int(logits[-1].argmax())
        tokens.append(token)
        if step + 1 < max_tokens:
            logits.append(request.logits([token], len(prompt) + step))
    return tokens, torch.stack(logits).cpu()


@dataclass
class PromptResult:
    max_abs_diff: float
    sum_abs_diff: float
    num_elements: int
    top1_agree: int
    common_prefix: int
    num_tokens: int


VARIANTS = {
    "kv": "fp8 vs {dtype} KV cache",
    "weights": "FP8 vs {dtype} weights (LM head {dtype})",
    "head": "FP8 vs {dtype} weights and LM head",
    "head_weight_only": "FP8 vs {dtype} weights, LM head weight-only FP8",
    "head_rescored": "FP8 vs {dtype} weights, LM head FP8 rescored",
}
"""--variant: the row's label."""


def compare_prompt(
    reference_model: torch.nn.Module,
    model: torch.nn.Module,
    backend,
    model_dtype: torch.dtype,
    cache_dtype: torch.dtype,
    prompt: list[int],
    max_tokens: int,
) -> PromptResult:
    """`model` over a `cache_dtype` cache, teacher-forced on the greedy tokens of
    `reference_model` over a model-dtype cache."""
    max_len = len(prompt) + max_tokens
    reference = PagedRequest(reference_model, backend, model_dtype, max_len)
    tokens, ref_logits = run_sequence(reference, prompt, max_tokens, forced=None)
    fp8 = PagedRequest(model, backend, cache_dtype, max_len)
    _, fp8_logits = run_sequence(fp8, prompt, max_tokens, forced=tokens)
    diff = (fp8_logits - ref_logits).abs()
    agree = (fp8_logits.argmax(-1) == ref_logits.argmax(-1)).tolist()
    common = agree.index(False) if False in agree else len(agree)
    return PromptResult(
        max_abs_diff=float(diff.max()),
        sum_abs_diff=float(diff.sum()),
        num_elements=diff.numel(),
        top1_agree=sum(agree),
        common_prefix=common,
        num_tokens=len(agree),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--variant", default="kv", choices=tuple(VARIANTS))
    parser.add_argument("--model", default=None, help="HF model directory (default model)")
    parser.add_argument("--dtype", default="auto", help="model dtype (auto: bf16 CUDA, fp32 CPU)")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--num-prompts", type=int, default=len(PROMPTS))
    parser.add_argument("--append", action="store_true", help="append to benchmarks/RESULTS.md")
    args = parser.parse_args()

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = resolve_dtype(args.dtype, device)
    path = resolve_model_path(args.model)

    def build(quantization: str | None = None, lm_head: str = "none"):
        return get_model(load_hf_config(path), path, dtype=dtype, device=device,
                         load_format="auto", seed=0, quantization=quantization,
                         lm_head_quantization=lm_head)  # fmt: skip

    reference = build()
    model, cache_dtype = reference, dtype
    if args.variant == "kv":
        cache_dtype = torch.float8_e4m3fn
    elif args.variant == "head_weight_only":
        model = build("fp8", "fp8")
        head = model.lm_head
        dequantized = head.quant_method.dequantized_weight(head).to(dtype)
        head.quant_method = None
        del head.weight_scale
        head.weight = torch.nn.Parameter(dequantized, requires_grad=False)
    else:
        model = build(
            "fp8", {"head": "fp8", "head_rescored": "fp8_rescored"}.get(args.variant, "none")
        )
    backend = get_attn_backend(device)
    tokenizer = get_tokenizer(path)
    prompts = [tokenizer.encode(p) for p in PROMPTS[: args.num_prompts]]

    results = []
    print("| prompt | max abs diff | mean abs diff | top-1 agreement | common greedy prefix |")
    print("|---|---|---|---|---|")
    for index, prompt in enumerate(prompts):
        r = compare_prompt(reference, model, backend, dtype, cache_dtype, prompt, args.max_tokens)
        results.append(r)
        print(
            f"| {index} | {r.max_abs_diff:.3f} | {r.sum_abs_diff / r.num_elements:.4f} | "
            f"{r.top1_agree}/{r.num_tokens} | {r.common_prefix}/{r.num_tokens} |"
        )
    total = sum(r.num_tokens for r in results)
    max_diff = max(r.max_abs_diff for r in results)
    mean_diff = sum(r.sum_abs_diff for r in results) / sum(r.num_elements for r in results)
    top1 = sum(r.top1_agree for r in results) / total
    prefix = sum(r.common_prefix for r in results) / total
    model_name = Path(path).name if args.model else "default model (SmolLM2-135M-Instruct)"
    label = VARIANTS[args.variant].format(dtype=str(dtype).removeprefix("torch."))
    row = (
        f"| {label}, {model_name}, {device.type}, "
        f"{len(prompts)} prompts x {args.max_tokens} tokens | max abs logit diff {max_diff:.3f}, "
        f"mean abs logit diff {mean_diff:.4f}, teacher-forced top-1 agreement {top1:.3f}, common "
        f"greedy prefix {prefix:.3f} | `python benchmarks/fp8_accuracy.py --variant {args.variant}` |"
    )
    if args.append:
        append_results(f"FP8 accuracy ({args.variant})", " ".join(sys.argv), row)
    print()
    print(row)


if __name__ == "__main__":
    main()
