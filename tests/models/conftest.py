"""Fixtures for model tests (helpers live in model_helpers.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
from model_helpers import save_scaled_tiny_llama, save_tiny_hf_model


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory) -> Path:
    """A saved tiny random-weight Llama HF directory."""
    path = tmp_path_factory.mktemp("tiny-llama")
    save_tiny_hf_model("llama", path)
    return path


@pytest.fixture(scope="module")
def scaled_dir(tmp_path_factory) -> Path:
    """A saved 2-layer Llama with the scaled init (model_helpers.save_scaled_tiny_llama)."""
    path = tmp_path_factory.mktemp("scaled-llama")
    save_scaled_tiny_llama(path)
    return path
