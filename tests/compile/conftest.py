"""A tiny random-weight Llama shared by the compile tests (Inductor on 30 layers is too slow
for CI on two cores; the tiny model has the same layer structure)."""

from __future__ import annotations

import pytest
from hf_reference import make_tiny_model


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory, default_tokenizer):
    path = tmp_path_factory.mktemp("tiny-llama-compile")
    make_tiny_model("llama", path, default_tokenizer)
    return path
