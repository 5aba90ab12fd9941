"""Picks the attention backend for a device.

CUDA gets the Triton backend, everything else the PyTorch reference. The environment variable
V1ENGINE_ATTENTION_BACKEND (cpu | triton) overrides the choice, e.g. to compare the two on one
GPU, or to run the Triton kernels on the CPU under TRITON_INTERPRET=1.
"""

from __future__ import annotations

import importlib.util
import os

import torch

from v1_engine.attention.backend import AttentionBackend
from v1_engine.attention.cpu import CPUAttentionBackend

BACKEND_ENV_VAR = "V1ENGINE_ATTENTION_BACKEND"
BACKEND_CHOICES = ("cpu", "triton")


def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def get_attn_backend(device: torch.device) -> AttentionBackend:
    """The backend for `device`: $V1ENGINE_ATTENTION_BACKEND if set, else triton on CUDA."""
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"device must be one of ('cpu', 'cuda'), got {device.type!r}")
    choice = os.environ.get(BACKEND_ENV_VAR, "").strip().lower()
    if not choice:
        choice = "triton" if device.type == "cuda" else "cpu"
    if choice not in BACKEND_CHOICES:
        raise ValueError(f"{BACKEND_ENV_VAR} must be one of {BACKEND_CHOICES}, got {choice!r}")
    if choice == "cpu":
        return CPUAttentionBackend()
    if not triton_available():
        raise ValueError(
            f"the triton attention backend needs the triton package (pip install triton), or set "
            f"{BACKEND_ENV_VAR}=cpu"
        )
    if device.type == "cpu" and os.environ.get("TRITON_INTERPRET", "0") != "1":
        raise ValueError(
            f"{BACKEND_ENV_VAR}=triton on the CPU needs the Triton interpreter (TRITON_INTERPRET=1)"
        )
    from v1_engine.attention.triton_attn import TritonAttentionBackend

    return TritonAttentionBackend()
