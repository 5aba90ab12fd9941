"""The quantization config in force while a model is being built.

The loader sets it around the model's constructor, so every Linear picks its linear method
without each model threading a config through its layers. It is a context manager that refuses
nesting: one model is built at a time, and a forgotten reset would leak into the next model.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from v1_engine.layers.quantization.base import (
    LinearMethod,
    QuantizationConfig,
    UnquantizedLinearMethod,
)

_current: list[QuantizationConfig | None] = []


@contextlib.contextmanager
def set_quant_config(config: QuantizationConfig | None) -> Iterator[None]:
    """Linear layers built inside this block use `config` (None: unquantized)."""
    if _current:
        raise RuntimeError("set_quant_config does not nest: a model is already being built")
    _current.append(config)
    try:
        yield
    finally:
        _current.pop()


def current_quant_config() -> QuantizationConfig | None:
    return _current[0] if _current else None


def current_linear_method() -> LinearMethod:
    """The method a Linear built now gets: the config's, or unquantized outside a build."""
    config = current_quant_config()
    return UnquantizedLinearMethod() if config is None else config.get_linear_method()
