"""DeepSeek-V2-Lite on the H200: the latent KV cache, the MLA decode kernel, the fused MoE kernel
and the engine's decode step, each next to its ceiling.

(a) KV bytes per token, latent vs per-head K/V (by arithmetic, V2-Lite and V3 shapes), and how
    many concurrent 4k-token contexts fit the KV pool the engine sizes itself at
    --gpu-memory-utilization (0.9), next to how many per-head K/V would allow in the same pool.
(b) The Triton MLA decode kernel at batch 64 x 4k context: achieved bandwidth on the latent bytes
    it must read (every cached entry once), as a fraction of 4.29 TB/s; 16 (V2-Lite) and 128
    (V3) heads. Timed inside a CUDA graph of 20 calls, as the decode graphs run it (no host
    launch work between kernels).
(c) The fused MoE Triton kernels (timed inside a CUDA graph, like (b)) vs the PyTorch
    reference (per-expert loop with host syncs, timed call by call) at several token counts,
    V2-Lite experts (64, top-6, hidden 2048, intermediate 1408, bf16).
(d) Decode ms/step through the engine (LLM, dummy weights, bf16) at batch 1, 32, 128 next to its
    roofline: (bytes of the parameters a step touches + latent cache bytes read) / 4.29 TB/s.
    A step touches every non-expert weight but the input embedding, and of each MoE layer's
    routed experts the expected number of distinct ones the batch picks under uniform routing
    (E * (1 - (1 - k/E)^B)): random dummy weights route close to uniformly.
    --compilation-level picks how the engine runs the model: 2 (the default: Inductor pieces
    around the MLA ops and whole-forward CUDA graphs of decode steps), 1 (compiled, no graphs)
    or 0 (eager); the table's header names it.

    python benchmarks/benchmark_deepseek.py --markdown
    python benchmarks/benchmark_deepseek.py --compilation-level 0 --markdown  # eager decode
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_utils import (
    CONFIG_ROOT,
    HBM_BYTES_PER_S,
    append_results,
    cuda_time_ms,
    graph_time_ms,
    model_dir,
)
from latency import decode_ms_per_step

from v1_engine.layers.mla import latent_kv_bytes_per_token, per_head_kv_bytes_per_token

MODEL = "deepseek-v2-lite"
CONTEXT = 4096
BF16 = 2
COMPILATION_MODES = {
    0: "eager",
    1: "torch.compile, no CUDA graphs",
    2: "torch.compile + decode CUDA graphs",
}
"""What section (d) runs at each --compilation-level (the engine's compilation_config level)."""


@dataclass(frozen=True)
class DeepseekShape:
    """Parameter counts of a DeepSeek config (bf16 weights; the router's weight is float32)."""

    config: dict

    def __getattr__(self, name: str):
        try:
            return self.config[name]
        except KeyError as exc:
            raise AttributeError(name) from exc

    @classmethod
    def from_config(cls, name: str) -> DeepseekShape:
        return cls(json.loads((CONFIG_ROOT / name / "config.json").read_text()))

    @property
    def attention_params(self) -> int:
        h, heads = self.hidden_size, self.num_attention_heads
        qk = self.qk_nope_head_dim + self.qk_rope_head_dim
        if self.q_lora_rank is None:
            q = h * heads * qk
        else:
            q = h * self.q_lora_rank + self.q_lora_rank + self.q_lora_rank * heads * qk
        kv_a = h * (self.kv_lora_rank + self.qk_rope_head_dim) + self.kv_lora_rank
        kv_b = self.kv_lora_rank * heads * (self.qk_nope_head_dim + self.v_head_dim)
        return q + kv_a + kv_b + heads * self.v_head_dim * h + 2 * h

    @property
    def num_moe_layers(self) -> int:
        return self.num_hidden_layers - (self.first_k_dense_replace or 0)

    @property
    def expert_params(self) -> int:
        return 3 * self.hidden_size * self.moe_intermediate_size

    def expected_experts(self, batch: int) -> float:
        """Distinct routed experts a batch of `batch` tokens touches per layer, uniform routing."""
        e, k = self.n_routed_experts, self.num_experts_per_tok
        return e * (1.0 - (1.0 - k / e) ** batch)

    def decode_weight_bytes(self, batch: int) -> float:
        """Bytes of the weights one decode step at `batch` reads (all but the input embedding)."""
        h = self.hidden_size
        dense_mlp = 3 * h * self.intermediate_size
        shared = (self.n_shared_experts or 0) * self.expert_params
        per_moe = shared + self.expected_experts(batch) * self.expert_params
        params = (
            self.num_hidden_layers * self.attention_params
            + (self.first_k_dense_replace or 0) * dense_mlp
            + self.num_moe_layers * per_moe
            + self.vocab_size * h
            + h
        )
        router = self.num_moe_layers * self.n_routed_experts * h * 4
        return params * BF16 + router

    def latent_bytes_per_token(self) -> int:
        return latent_kv_bytes_per_token(
            self.num_hidden_layers, self.kv_lora_rank, self.qk_rope_head_dim, torch.bfloat16
        )

    def per_head_bytes_per_token(self, heads: int | None = None) -> int:
        return per_head_kv_bytes_per_token(
            self.num_hidden_layers,
            heads or self.num_attention_heads,
            self.qk_nope_head_dim,
            self.qk_rope_head_dim,
            self.v_head_dim,
            torch.bfloat16,
        )


# ---- (a) KV bytes ----------------------------------------------------------------------------


def kv_bytes_rows(shape: DeepseekShape) -> list[str]:
    v3 = (61, 128)  # DeepSeek-V3: 61 layers, 128 heads, same latent and head sizes
    rows = []
    for name, layers, heads in (
        ("V2-Lite", shape.num_hidden_layers, shape.num_attention_heads),
        ("V3", *v3),
    ):
        latent = latent_kv_bytes_per_token(layers, 512, 64, torch.bfloat16)
        per_head = per_head_kv_bytes_per_token(layers, heads, 128, 64, 128, torch.bfloat16)
        rows.append(
            f"| {name} ({layers} layers, {heads} heads) | {latent:,} | {per_head:,} | "
            f"{per_head / latent:.1f}x | {1 - latent / per_head:.1%} |"
        )
    return rows


def pool_rows(llm, shape: DeepseekShape, utilization: float) -> list[str]:
    runner = llm.engine_core.model_runner
    num_blocks = runner.kv_caches[0].shape[0]
    tokens = num_blocks * runner.block_size
    pool_bytes = sum(c.numel() * c.element_size() for c in runner.kv_caches)
    per_head_tokens = pool_bytes // shape.per_head_bytes_per_token()
    return [
        (
            f"| {utilization} | {pool_bytes / 2**30:.1f} GiB | {tokens:,} | "
            f"{tokens // CONTEXT} | {per_head_tokens // CONTEXT} |"
        )
    ]


# ---- (b) MLA decode kernel -------------------------------------------------------------------


def mla_kernel_rows(batch: int, context: int, block_sizes: list[int]) -> list[str]:
    from v1_engine.kernels.triton_mla import mla_decode, mla_decode_bytes

    rows = []
    rank, rope = 512, 64
    for heads in (16, 128):
        for block_size in block_sizes:
            blocks_per_req = context // block_size
            num_blocks = batch * blocks_per_req
            cache = torch.randn(num_blocks, block_size, rank + rope, device="cuda").bfloat16()
            table = torch.randperm(num_blocks, device="cuda", dtype=torch.int64)
            table = table.view(batch, blocks_per_req).int()
            q_nope = torch.randn(batch, heads, rank, device="cuda", dtype=torch.bfloat16)
            q_pe = torch.randn(batch, heads, rope, device="cuda", dtype=torch.bfloat16)
            out = torch.empty_like(q_nope)
            seq_lens = torch.full((batch,), context, dtype=torch.int32, device="cuda")
            starts = torch.arange(batch + 1, dtype=torch.int32, device="cuda")

            run = partial(
                mla_decode, q_nope, q_pe, cache, table, seq_lens, starts, context, 0.07, out
            )
            ms = graph_time_ms(run, calls=20, repeat=10)
            read = mla_decode_bytes([context] * batch, rank, rope, BF16)
            rate = read / (ms * 1e-3)
            rows.append(
                f"| {heads} | {block_size} | {batch} x {context} | {read / 1e6:.0f} MB | "
                f"{ms * 1e3:.0f} | {rate / 1e12:.2f} | {rate / HBM_BYTES_PER_S:.0%} |"
            )
            print(rows[-1], flush=True)
    return rows


# ---- (c) fused MoE ---------------------------------------------------------------------------


def moe_rows(shape: DeepseekShape, token_counts: list[int]) -> list[str]:
    from v1_engine.kernels.triton_moe import fused_moe_triton
    from v1_engine.layers.moe import fused_experts_reference

    e, k = shape.n_routed_experts, shape.num_experts_per_tok
    h, inter = shape.hidden_size, shape.moe_intermediate_size
    w13 = (torch.randn(e, 2 * inter, h, device="cuda") * 0.02).bfloat16()
    w2 = (torch.randn(e, h, inter, device="cuda") * 0.02).bfloat16()
    rows = []
    for num_tokens in token_counts:
        x = torch.randn(num_tokens, h, device="cuda", dtype=torch.bfloat16)
        logits = torch.randn(num_tokens, e, device="cuda")
        weights, ids = logits.softmax(-1).topk(k, dim=-1)
        fused = partial(fused_moe_triton, x, w13, w2, weights, ids)
        reference = partial(fused_experts_reference, x, w13, w2, weights, ids)
        fused_ms = graph_time_ms(fused, calls=10, repeat=10)
        ref_ms = cuda_time_ms(reference, warmup=2, repeat=10)
        error = (fused().float() - reference().float()).abs().max().item()
        touched = ids.unique().numel() * shape.expert_params * BF16
        rate = touched / (fused_ms * 1e-3)
        rows.append(
            f"| {num_tokens} | {fused_ms * 1e3:.0f} | {ref_ms * 1e3:.0f} | "
            f"{ref_ms / fused_ms:.1f}x | {rate / 1e12:.2f} ({rate / HBM_BYTES_PER_S:.0%}) | "
            f"{error:.3f} |"
        )
        print(rows[-1], flush=True)
    return rows


# ---- (d) decode step through the engine ------------------------------------------------------


def build_llm(args, max_seqs: int):
    from v1_engine import LLM

    longest = args.input_len + args.decode_steps + 64
    path, _ = model_dir(MODEL, min_positions=longest)
    return LLM(
        model=path,
        load_format="dummy",
        dtype="bfloat16",
        max_model_len=max(longest, CONTEXT),
        max_num_batched_tokens=max(longest, 8192),
        max_num_seqs=max_seqs,
        enable_prefix_caching=False,
        compilation_config=args.compilation_level,
        gpu_memory_utilization=args.gpu_memory_utilization,
        block_size=args.block_size,
    )


def decode_rows(llm, shape: DeepseekShape, args, batch_sizes: list[int]) -> list[str]:
    rows = []
    for batch in batch_sizes:
        ms = decode_ms_per_step(
            llm, batch, args.input_len, args.decode_steps, shape.vocab_size, args.repeats
        )
        mean_context = args.input_len + 1 + args.decode_steps / 2
        weight_bytes = shape.decode_weight_bytes(batch)
        kv_bytes = batch * mean_context * shape.latent_bytes_per_token()
        roof_ms = (weight_bytes + kv_bytes) / HBM_BYTES_PER_S * 1e3
        rows.append(
            f"| {batch} | {ms:.2f} | {weight_bytes / 1e9:.2f} | {kv_bytes / 1e9:.3f} | "
            f"{roof_ms:.2f} | {roof_ms / ms:.2f} | {batch / ms * 1e3:.0f} |"
        )
        print(rows[-1], flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--batch-sizes", default="1,32,128")
    parser.add_argument("--input-len", type=int, default=1024)
    parser.add_argument("--decode-steps", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--moe-tokens", default="1,16,128,1024,4096")
    parser.add_argument("--mla-block-sizes", default="16,64")
    parser.add_argument(
        "--block-size", type=int, default=None, help="the engine's KV block size (default: its own)"
    )
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    parser.add_argument(
        "--compilation-level",
        type=int,
        choices=sorted(COMPILATION_MODES),
        default=2,
        help="(d): " + "; ".join(f"{k} {v}" for k, v in sorted(COMPILATION_MODES.items())),
    )
    parser.add_argument("--skip-engine", action="store_true", help="only (a) arithmetic, (b), (c)")
    parser.add_argument("--markdown", action="store_true", help="print rows for RESULTS.md")
    parser.add_argument("--append", action="store_true", help="append to benchmarks/RESULTS.md")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("benchmark_deepseek.py needs a CUDA GPU")
    shape = DeepseekShape.from_config(MODEL)
    batch_sizes = [int(b) for b in args.batch_sizes.split(",") if b]

    lines = [
        f"model {MODEL} (dummy weights, bf16); HBM roofline {HBM_BYTES_PER_S / 1e12:.2f} TB/s",
        "",
        "(a) KV-cache bytes per token (bf16, all layers):",
        "",
        "| model | latent (MLA) | per-head K/V | ratio | saved |",
        "| --- | ---: | ---: | ---: | ---: |",
        *kv_bytes_rows(shape),
        "",
        "(b) Triton MLA decode kernel (kv_lora_rank 512 + rope 64, bf16; inside a CUDA graph):",
        "",
        "| heads | block size | batch x context | latent bytes | us | TB/s | of 4.29 TB/s |",
        "| ---: | ---: | --- | ---: | ---: | ---: | ---: |",
        *mla_kernel_rows(64, CONTEXT, [int(b) for b in args.mla_block_sizes.split(",") if b]),
        "",
        (
            "(c) fused MoE (64 experts, top-6, hidden 2048, intermediate 1408, bf16; fused inside a "
            "CUDA graph):"
        ),
        "",
        "| tokens | fused us | reference us | speed-up | expert-weight TB/s | max abs diff |",
        "| ---: | ---: | ---: | ---: | ---: | ---: |",
        *moe_rows(shape, [int(n) for n in args.moe_tokens.split(",") if n]),
    ]
    gc.collect()
    torch.cuda.empty_cache()
    if not args.skip_engine:
        llm = build_llm(args, max(batch_sizes))
        level = args.compilation_level
        mode = f"compilation level {level}: {COMPILATION_MODES[level]}"
        mode += f", KV blocks of {llm.config.cache_config.block_size} tokens"
        rows = decode_rows(llm, shape, args, batch_sizes)
        graphs = llm.engine_core.model_runner.graphs.decode
        if graphs is not None:
            mode += f", {graphs.num_replays} steps replayed from graphs"
        lines += [
            "",
            (
                f"KV pool sized by the engine at gpu_memory_utilization "
                f"{args.gpu_memory_utilization} (concurrent {CONTEXT}-token contexts):"
            ),
            "",
            "| utilization | KV pool | tokens | 4k contexts (latent) | 4k contexts (per-head) |",
            "| ---: | ---: | ---: | ---: | ---: |",
            *pool_rows(llm, shape, args.gpu_memory_utilization),
            "",
            (
                f"(d) decode step through the engine ({mode}, {args.input_len}-token prompts, "
                f"{args.decode_steps} steps measured):"
            ),
            "",
            "| batch | ms/step | weight GB | KV GB | roofline ms | roofline/measured | tok/s |",
            "| ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
            *rows,
        ]
    table = "\n".join(lines)
    if args.markdown:
        print("\n" + table)
    if args.append:
        append_results(f"DeepSeek: {MODEL}", "python " + " ".join(sys.argv), table)


if __name__ == "__main__":
    main()
