"""Hugging Face transformers as the reference implementation in tests."""

from __future__ import annotations

import torch

TINY_CONFIGS = {
    "llama": {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
        "tie_word_embeddings": False,
    },
    "qwen2": {
        "model_type": "qwen2",
        "architectures": ["Qwen2ForCausalLM"],
        "tie_word_embeddings": True,
    },
    "qwen3": {
        "model_type": "qwen3",
        "architectures": ["Qwen3ForCausalLM"],
        "head_dim": 32,
        "tie_word_embeddings": True,
    },
}


def make_tiny_model(kind: str, path, tokenizer) -> None:
    """Save a random-weight HF model of `kind` (with the default model's tokenizer) to path."""
    from transformers import AutoConfig, AutoModelForCausalLM

    spec = dict(TINY_CONFIGS[kind])
    model_type = spec.pop("model_type")
    config = AutoConfig.for_model(
        model_type,
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        **spec,
    )
    torch.manual_seed(1234)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.2)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)


def hf_greedy(model, prompt_token_ids: list[int], max_new_tokens: int, exact: bool) -> list[int]:
    """Hugging Face greedy tokens; `exact` forces max_new_tokens (EOS suppressed until then)."""
    input_ids = torch.tensor([prompt_token_ids])
    with torch.no_grad():
        out = model.generate(
            input_ids,
            attention_mask=torch.ones_like(input_ids),
            do_sample=False,
            max_new_tokens=max_new_tokens,
            min_new_tokens=max_new_tokens if exact else 0,
            pad_token_id=model.config.eos_token_id,
        )
    return out[0, len(prompt_token_ids) :].tolist()
