"""Shared fixtures: the default model's HF directory, tiny random-weight models, HF references."""

from __future__ import annotations

import pytest
import torch

try:
    _HAS_CUDA = torch.cuda.is_available()
except Exception:  # pragma: no cover
    _HAS_CUDA = False


def pytest_collection_modifyitems(config, items):
    if _HAS_CUDA:
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(scope="session")
def default_model_dir():
    """The embedded default model, converted once to a cached HF directory."""
    from v1_engine.models.loader import resolve_model_path

    return resolve_model_path(None)


@pytest.fixture(scope="session")
def default_tokenizer(default_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(default_model_dir)


@pytest.fixture(scope="session")
def hf_default_model(default_model_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32)
    return model.eval()


TINY_CONFIGS = {
    "llama": dict(
        model_type="llama",
        architectures=["LlamaForCausalLM"],
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
        tie_word_embeddings=False,
    ),
    "qwen2": dict(model_type="qwen2", architectures=["Qwen2ForCausalLM"], tie_word_embeddings=True),
    "qwen3": dict(
        model_type="qwen3", architectures=["Qwen3ForCausalLM"], head_dim=32, tie_word_embeddings=True
    ),
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


@pytest.fixture(scope="session", params=sorted(TINY_CONFIGS))
def tiny_model_dir(request, tmp_path_factory, default_tokenizer):
    path = tmp_path_factory.mktemp(f"tiny-{request.param}")
    make_tiny_model(request.param, path, default_tokenizer)
    return path
