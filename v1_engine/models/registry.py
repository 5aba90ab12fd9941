"""Maps a Hugging Face config to the model class that implements it."""

from __future__ import annotations

from typing import Any

from torch import nn

from v1_engine.models.deepseek import DeepseekV2ForCausalLM, DeepseekV3ForCausalLM
from v1_engine.models.llama import LlamaForCausalLM

_ARCHITECTURES: dict[str, type[nn.Module]] = {
    "DeepseekV2ForCausalLM": DeepseekV2ForCausalLM,
    "DeepseekV3ForCausalLM": DeepseekV3ForCausalLM,
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
}
_MODEL_TYPES: dict[str, str] = {
    "deepseek_v2": "DeepseekV2ForCausalLM",
    "deepseek_v3": "DeepseekV3ForCausalLM",
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}


def supported_architectures() -> list[str]:
    return sorted(_ARCHITECTURES)


def get_model_class(hf_config: Any) -> type[nn.Module]:
    """The class for `hf_config.architectures[0]`, or for its model_type when the config names
    no architecture."""
    architectures = getattr(hf_config, "architectures", None) or []
    model_type = getattr(hf_config, "model_type", None)
    if architectures:
        name = architectures[0]
    else:
        name = _MODEL_TYPES.get(model_type, f"model_type={model_type!r}")
    if name not in _ARCHITECTURES:
        raise ValueError(
            f"architectures must name one of {supported_architectures()}, got {name!r}"
        )
    return _ARCHITECTURES[name]
