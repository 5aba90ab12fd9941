"""Resolve the parts of an EngineConfig that depend on the model, once, in the front-end.

The front-end resolves the model path (converting a GGUF file to the cached HF directory at
most once), reads the model's config and fixes max_model_len, the cache block size and the
scheduler limits; the core process then receives a fully resolved config and never converts or
guesses again.
"""

from __future__ import annotations

from transformers import PretrainedConfig

from v1_engine.config import EngineConfig, default_block_size
from v1_engine.models.loader import load_hf_config, resolve_model_path


def prepare_engine_config(config: EngineConfig) -> PretrainedConfig:
    mc = config.model_config
    original = mc.model
    path = resolve_model_path(mc.model)
    mc.model = str(path)
    if mc.tokenizer is None:
        mc.tokenizer = str(path)
    if mc.served_model_name is None:
        mc.served_model_name = default_served_name(original)
    hf_config = load_hf_config(path)
    config.resolve_model_facts(_max_positions(hf_config), default_block_size(hf_config))
    return hf_config


def _max_positions(hf_config: PretrainedConfig) -> int:
    value = getattr(hf_config, "max_position_embeddings", None)
    if not value:
        raise ValueError("the model's config has no max_position_embeddings; pass max_model_len")
    return int(value)


def default_served_name(original: str | None) -> str:
    """The name clients use when none is given: the model path's last part, without .gguf."""
    if original is None:
        return "SmolLM2-135M-Instruct"
    return str(original).rstrip("/").rsplit("/", 1)[-1].removesuffix(".gguf")
