"""Kernel tests: tests marked `gpu` skip themselves where no CUDA device is visible."""

from __future__ import annotations

import pytest
import torch


def pytest_runtest_setup(item: pytest.Item) -> None:
    if item.get_closest_marker("gpu") is not None and not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
