"""Helpers for model tests: a hand-built paged batch driver standing in for the model runner,
and seeded tiny random-weight Hugging Face models.

`PagedModelDriver` owns a KV cache per attention layer, hands out blocks from a shuffled pool
(so block tables are non-contiguous), builds AttentionMetadata for a step over several requests
and runs the model inside a forward context, returning the logits of every new token.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from pathlib import Path

import torch

from v1_engine.attention.backend import AttentionMetadata
from v1_engine.attention.cpu import CPUAttentionBackend
from v1_engine.forward_context import set_forward_context
from v1_engine.models import get_model, load_hf_config


class PagedModelDriver:
    def __init__(self, model: torch.nn.Module, block_size: int = 4, num_blocks: int = 64) -> None:
        self.model = model
        self.block_size = block_size
        self.backend = CPUAttentionBackend()
        self.layers = model.attention_layers()
        for layer in self.layers:
            layer.kv_cache = torch.full(
                (2, num_blocks, block_size, layer.num_kv_heads, layer.head_size), float("nan")
            )
        self.free_blocks = list(range(num_blocks))
        random.Random(0).shuffle(self.free_blocks)
        self.block_tables: dict[str, list[int]] = {}
        self.num_computed: dict[str, int] = {}

    def _grow(self, req_id: str, seq_len: int) -> None:
        table = self.block_tables.setdefault(req_id, [])
        while len(table) * self.block_size < seq_len:
            table.append(self.free_blocks.pop())

    def _metadata(self, steps: Sequence[tuple[str, Sequence[int]]]) -> AttentionMetadata:
        query_lens = [len(tokens) for _, tokens in steps]
        seq_lens = [self.num_computed.get(rid, 0) + n for (rid, _), n in zip(steps, query_lens)]
        max_blocks = max(len(self.block_tables[rid]) for rid, _ in steps)
        block_table = torch.zeros(len(steps), max_blocks, dtype=torch.int32)
        slots = []
        for i, ((rid, _), seq_len, q_len) in enumerate(zip(steps, seq_lens, query_lens)):
            table = self.block_tables[rid]
            block_table[i, : len(table)] = torch.tensor(table, dtype=torch.int32)
            for pos in range(seq_len - q_len, seq_len):
                slots.append(
                    table[pos // self.block_size] * self.block_size + pos % self.block_size
                )
        query_start_loc = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()])
        return AttentionMetadata(
            num_actual_tokens=sum(query_lens),
            query_start_loc=query_start_loc.to(torch.int32),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
            block_table=block_table,
            slot_mapping=torch.tensor(slots, dtype=torch.int64),
            max_query_len=max(query_lens),
            max_seq_len=max(seq_lens),
            query_start_loc_cpu=query_start_loc.to(torch.int32),
            seq_lens_cpu=torch.tensor(seq_lens, dtype=torch.int32),
        )

    @torch.no_grad()
    def step(self, steps: Sequence[tuple[str, Sequence[int]]]) -> list[torch.Tensor]:
        """Run one step where request `rid` feeds `tokens` after its already-computed ones;
        returns each request's logits [len(tokens), vocab]."""
        for rid, tokens in steps:
            self._grow(rid, self.num_computed.get(rid, 0) + len(tokens))
        metadata = self._metadata(steps)
        input_ids = torch.tensor([t for _, tokens in steps for t in tokens], dtype=torch.long)
        positions = torch.tensor(
            [
                self.num_computed.get(rid, 0) + j
                for rid, tokens in steps
                for j in range(len(tokens))
            ],
            dtype=torch.long,
        )
        with set_forward_context(metadata, attn_backend=self.backend, attention_layers=self.layers):
            logits = self.model.compute_logits(self.model(input_ids, positions))
        for rid, tokens in steps:
            self.num_computed[rid] = self.num_computed.get(rid, 0) + len(tokens)
        return list(logits.split([len(tokens) for _, tokens in steps]))


TINY_BASE = {
    "vocab_size": 256,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 128,
}
TINY_VARIANTS: dict[str, dict] = {
    "llama": {"model_type": "llama", "tie_word_embeddings": False},
    "llama-llama3-rope-tied": {
        "model_type": "llama",
        "tie_word_embeddings": True,
        "rope_parameters": {
            "rope_type": "llama3",
            "rope_theta": 10000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32,
        },
    },
    "llama-linear-rope-bias-tied": {
        "model_type": "llama",
        "tie_word_embeddings": True,
        "attention_bias": True,
        "mlp_bias": True,
        "rope_parameters": {"rope_type": "linear", "rope_theta": 500.0, "factor": 2.0},
    },
    "mistral": {"model_type": "mistral", "tie_word_embeddings": False},
    "qwen2-tied": {"model_type": "qwen2", "tie_word_embeddings": True},
    "qwen3": {"model_type": "qwen3", "head_dim": 32, "tie_word_embeddings": False},
}


@torch.no_grad()
def save_tiny_hf_model(variant: str, path, seed: int = 0) -> torch.nn.Module:
    """Save a seeded random-weight float32 HF model of `variant` to `path`; return it (eval).

    Every parameter is redrawn (biases and norm scales too: the defaults of zeros/ones would
    let a loader that drops them pass)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    spec = dict(TINY_VARIANTS[variant])
    config = AutoConfig.for_model(spec.pop("model_type"), **TINY_BASE, **spec)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    for name, param in model.named_parameters():
        if "norm" in name:
            param.copy_(1.0 + 0.2 * torch.randn_like(param))
        else:
            param.normal_(0.0, 0.2)
    model.save_pretrained(path)
    return model.eval()


@torch.no_grad()
def scaled_init(model: torch.nn.Module) -> None:
    """Re-initialise a Hugging Face model in place from the global RNG: norms 1 + normal(0, 0.2),
    embeddings normal(0, 1), the LM head normal(0, 0.2), every other weight normal(0, 0.7 /
    sqrt(fan_in)), and MoE routers' e_score_correction_bias normal(0, 0.1)."""
    for name, param in model.named_parameters():
        if "norm" in name:
            param.copy_(1.0 + 0.2 * torch.randn_like(param))
        elif "embed_tokens" in name:
            param.normal_(0.0, 1.0)
        elif "lm_head" in name:
            param.normal_(0.0, 0.2)
        else:
            param.normal_(0.0, 0.7 / param.shape[-1] ** 0.5)
    for name, buffer in model.named_buffers():
        if name.endswith("e_score_correction_bias"):
            buffer.normal_(0.0, 0.1)


@torch.no_grad()
def save_scaled_tiny_llama(
    path: Path,
    *,
    hidden_size: int = 64,
    intermediate_size: int = 128,
    head_dim: int | None = None,
    vocab_size: int = 256,
    tokenizer=None,
    tie_word_embeddings: bool = False,
):
    """A 2-layer random Llama saved to `path` (optionally with `tokenizer`), scaled init: linear
    weights normal(0, 0.7 / sqrt(fan_in)), so each sublayer adds to the residual stream without
    swamping it, as in trained models. The 0.2-std models of save_tiny_hf_model are chaotic (a
    1e-6 change flips greedy choices): right for exact fp32 equality, no measure of a lossy format
    (FP8 weights, an FP8 KV cache)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    extra = {"head_dim": head_dim} if head_dim else {}
    if tokenizer is not None:
        extra |= {"bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id}
    config = AutoConfig.for_model(
        "llama",
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        tie_word_embeddings=tie_word_embeddings,
        **extra,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    scaled_init(model)
    model.save_pretrained(path)
    if tokenizer is not None:
        tokenizer.save_pretrained(path)
    return model.eval()


def load_ours(model_dir: Path, load_format: str = "auto", seed: int = 0) -> torch.nn.Module:
    """Our model for a saved HF directory, float32 on CPU."""
    return get_model(
        load_hf_config(model_dir),
        model_dir,
        dtype=torch.float32,
        device=torch.device("cpu"),
        load_format=load_format,
        seed=seed,
    )
