"""Models, their registry and the loader (HF directories, GGUF files, dummy weights)."""

from v1_engine.models.loader import get_model, get_tokenizer, load_hf_config, resolve_model_path
from v1_engine.models.registry import get_model_class

__all__ = ["get_model", "get_model_class", "get_tokenizer", "load_hf_config", "resolve_model_path"]
