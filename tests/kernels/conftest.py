"""Kernel tests: tests marked `gpu` skip themselves where no CUDA device is visible."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch


def pytest_runtest_setup(item: pytest.Item) -> None:
    if item.get_closest_marker("gpu") is not None and not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")


@pytest.fixture(scope="session")
def run_compile_probe() -> Callable[[str], dict]:
    """Runs one of this folder's sm_90 compile probes (pdl_ptx_probe.py, pipeline_probe.py) in a
    fresh process, where Triton's interpreter is off, and returns the JSON it prints. The probe
    imports this checkout's package (its root first on PYTHONPATH), not whichever checkout the
    environment installed: a git worktree's tests compile the worktree's kernels."""
    root = str(Path(__file__).resolve().parents[2])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        p for p in (root, os.environ.get("PYTHONPATH")) if p
    )}  # fmt: skip

    def run(script: str) -> dict:
        path = Path(__file__).with_name(script)
        done = subprocess.run(
            [sys.executable, str(path)],
            capture_output=True,
            text=True,
            timeout=600,
            check=False,
            env=env,
        )
        assert done.returncode == 0, done.stderr[-3000:]
        return json.loads(done.stdout)

    return run
