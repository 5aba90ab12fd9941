"""Picks the attention backend for a device, for regular and for latent (MLA) attention.

CUDA gets the Triton backends, everything else the PyTorch references. The environment variable
V1ENGINE_ATTENTION_BACKEND (cpu | triton) overrides both choices, e.g. to compare the two on one
GPU, or to run the Triton kernels on the CPU under TRITON_INTERPRET=1.
"""

from __future__ import annotations

import importlib.util
import os
from functools import lru_cache
from typing import TYPE_CHECKING

import torch

from v1_engine.attention.backend import AttentionBackend
from v1_engine.attention.cpu import CPUAttentionBackend
from v1_engine.attention.mla_cpu import CPUMLABackend

if TYPE_CHECKING:
    from v1_engine.attention.mla_triton import TritonMLABackend

BACKEND_ENV_VAR = "V1ENGINE_ATTENTION_BACKEND"
BACKEND_CHOICES = ("cpu", "triton")


def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def _backend_choice(device: torch.device) -> str:
    """'cpu' or 'triton' for `device`: $V1ENGINE_ATTENTION_BACKEND if set, else triton on CUDA.
    Raises ValueError for an unsupported device, an unknown choice, or triton where it cannot
    run."""
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"device must be one of ('cpu', 'cuda'), got {device.type!r}")
    choice = os.environ.get(BACKEND_ENV_VAR, "").strip().lower()
    if not choice:
        choice = "triton" if device.type == "cuda" else "cpu"
    if choice not in BACKEND_CHOICES:
        raise ValueError(f"{BACKEND_ENV_VAR} must be one of {BACKEND_CHOICES}, got {choice!r}")
    if choice == "cpu":
        return choice
    if not triton_available():
        raise ValueError(
            f"the triton attention backend needs the triton package (pip install triton), or set "
            f"{BACKEND_ENV_VAR}=cpu"
        )
    if device.type == "cpu" and os.environ.get("TRITON_INTERPRET", "0") != "1":
        raise ValueError(
            f"{BACKEND_ENV_VAR}=triton on the CPU needs the Triton interpreter (TRITON_INTERPRET=1)"
        )
    return choice


def get_attn_backend(device: torch.device) -> AttentionBackend:
    """The backend for `device`: $V1ENGINE_ATTENTION_BACKEND if set, else triton on CUDA."""
    if _backend_choice(device) == "cpu":
        return CPUAttentionBackend()
    from v1_engine.attention.triton_attn import TritonAttentionBackend

    return TritonAttentionBackend()


def get_mla_backend(device: torch.device) -> CPUMLABackend | TritonMLABackend:
    """The MLA backend for `device`, chosen like `get_attn_backend`. The MLA op asks for it on
    every call: the choice is cached per (device type, environment)."""
    env = (
        os.environ.get(BACKEND_ENV_VAR, "").strip().lower(),
        os.environ.get("TRITON_INTERPRET", "0"),
    )
    return _cached_mla_backend(device.type, env)


@lru_cache(maxsize=8)
def _cached_mla_backend(device_type: str, env: tuple[str, str]) -> CPUMLABackend | TritonMLABackend:
    if _backend_choice(torch.device(device_type)) == "cpu":
        return CPUMLABackend()
    from v1_engine.attention.mla_triton import TritonMLABackend

    return TritonMLABackend()
