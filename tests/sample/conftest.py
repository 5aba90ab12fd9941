"""Helpers shared by the sampler tests: building metadata from plain SamplingParams."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from v1_engine.sample.metadata import SamplingMetadata
from v1_engine.sampling_params import SamplingParams


def _build_metadata(
    params: list[SamplingParams],
    vocab_size: int,
    *,
    prompts: list[list[int]] | None = None,
    outputs: list[list[int]] | None = None,
    eos: list[int | None] | None = None,
    generators: list[torch.Generator | None] | None = None,
) -> SamplingMetadata:
    num_rows = len(params)
    return SamplingMetadata.build(
        params,
        prompts if prompts is not None else [[0]] * num_rows,
        outputs if outputs is not None else [[] for _ in range(num_rows)],
        eos if eos is not None else [None] * num_rows,
        generators if generators is not None else [None] * num_rows,
        vocab_size,
        torch.device("cpu"),
    )


@pytest.fixture
def build_metadata() -> Callable[..., SamplingMetadata]:
    """SamplingMetadata.build on CPU with empty outputs, no EOS and no generators by default."""
    return _build_metadata


@pytest.fixture(autouse=True)
def _fixed_global_seed() -> None:
    torch.manual_seed(1234)
