"""v1engine: an LLM inference and serving engine in the style of vLLM V1."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from v1_engine.sampling_params import SamplingParams
from v1_engine.structured_output import StructuredOutputsParams

__version__ = "0.1.0"
__all__ = [
    "LLM",
    "AsyncEngine",
    "CompletionOutput",
    "EngineDeadError",
    "RequestOutput",
    "SamplingParams",
    "StructuredOutputsParams",
    "__version__",
]

if TYPE_CHECKING:
    from v1_engine.engine.async_engine import AsyncEngine
    from v1_engine.engine.exceptions import EngineDeadError
    from v1_engine.engine.llm import LLM
    from v1_engine.outputs import CompletionOutput, RequestOutput

_LAZY = {
    "LLM": "v1_engine.engine.llm",
    "AsyncEngine": "v1_engine.engine.async_engine",
    "EngineDeadError": "v1_engine.engine.exceptions",
    "RequestOutput": "v1_engine.outputs",
    "CompletionOutput": "v1_engine.outputs",
}


def __getattr__(name: str) -> Any:
    """Import the heavy parts (torch, transformers) only when they are used."""
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'v1_engine' has no attribute {name!r}")
