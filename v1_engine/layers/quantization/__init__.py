"""Quantized linear layers: which linear method each Linear gets, from the engine's
`quantization` setting and the checkpoint's `quantization_config`.

The loader builds the config with `get_quant_config`, builds the model inside
`set_quant_config(config)` (each Linear asks `current_linear_method()`), then runs every
layer's `process_weights_after_loading` once the checkpoint is in.
"""

from __future__ import annotations

from typing import Any

from v1_engine.config import QUANTIZATION_CHOICES
from v1_engine.layers.quantization.base import (
    LinearMethod,
    QuantizationConfig,
    UnquantizedLinearMethod,
)
from v1_engine.layers.quantization.context import (
    current_linear_method,
    current_quant_config,
    set_quant_config,
)
from v1_engine.layers.quantization.fp8 import (
    Fp8BlockLinearMethod,
    Fp8Config,
    Fp8OnlineLinearMethod,
    Fp8PerTensorLinearMethod,
)

__all__ = [
    "Fp8BlockLinearMethod",
    "Fp8Config",
    "Fp8OnlineLinearMethod",
    "Fp8PerTensorLinearMethod",
    "LinearMethod",
    "QuantizationConfig",
    "UnquantizedLinearMethod",
    "current_linear_method",
    "current_quant_config",
    "get_quant_config",
    "set_quant_config",
]


def checkpoint_quantization_config(hf_config: Any) -> dict[str, Any] | None:
    """The checkpoint's `quantization_config` as a dict, or None for an unquantized one."""
    qc = getattr(hf_config, "quantization_config", None)
    if qc is None or isinstance(qc, dict):
        return qc
    return qc.to_dict()


def get_quant_config(quantization: str | None, hf_config: Any) -> QuantizationConfig | None:
    """The config the model's linear layers are built with.

    A quantized checkpoint is loaded as stored whatever `quantization` says (only FP8
    checkpoints are supported); otherwise quantization="fp8" quantizes at load and None keeps
    the weights as they are."""
    if quantization not in QUANTIZATION_CHOICES:
        raise ValueError(
            f"quantization must be one of {QUANTIZATION_CHOICES}, got {quantization!r}"
        )
    checkpoint_config = checkpoint_quantization_config(hf_config)
    if checkpoint_config is not None:
        return Fp8Config.from_checkpoint(checkpoint_config)
    if quantization == "fp8":
        return Fp8Config.online()
    return None
