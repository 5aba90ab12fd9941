"""Shared fixtures: the default model's HF directory, tiny random-weight models, HF references."""

from __future__ import annotations

import os

import pytest
import torch

_HAS_CUDA = torch.cuda.is_available()
if not _HAS_CUDA:
    # Triton kernels run under the interpreter on the CPU. Set before any kernel module is
    # imported, so every @triton.jit function of the session is interpreted, including helpers
    # one kernel module imports from another (kernels/pdl.py), whatever order tests import them.
    os.environ.setdefault("TRITON_INTERPRET", "1")

from hf_reference import TINY_CONFIGS, make_tiny_model


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
def default_tokenizer(request):
    """The default model's tokenizer; on a machine without the model package (the GPU machine),
    its files from $V1ENGINE_TOKENIZER_DIR."""
    from transformers import AutoTokenizer

    directory = os.environ.get("V1ENGINE_TOKENIZER_DIR")
    if directory is None:
        directory = request.getfixturevalue("default_model_dir")
    return AutoTokenizer.from_pretrained(directory)


@pytest.fixture(scope="session")
def hf_default_model(default_model_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32)
    return model.eval()


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory, default_tokenizer):
    """A tiny random-weight Llama (the default tokenizer; same layer structure as the big ones,
    fast enough for CI on two cores), shared by every test that needs one model of that kind."""
    path = tmp_path_factory.mktemp("tiny-llama")
    make_tiny_model("llama", path, default_tokenizer)
    return path


@pytest.fixture(scope="session", params=sorted(TINY_CONFIGS))
def tiny_model_dir(request, tmp_path_factory, default_tokenizer):
    path = tmp_path_factory.mktemp(f"tiny-{request.param}")
    make_tiny_model(request.param, path, default_tokenizer)
    return path
