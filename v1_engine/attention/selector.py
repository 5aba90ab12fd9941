"""Picks the attention backend for a device, for regular and for latent (MLA) attention.

The choice, first match wins: the `attention_backend` option (CacheConfig, `--attention-backend`)
when the caller passes it; else the environment variable V1ENGINE_ATTENTION_BACKEND (e.g. to
compare backends on one GPU, or to run the Triton kernels on the CPU under TRITON_INTERPRET=1);
else auto: Triton on CUDA, the PyTorch references elsewhere. Auto never picks flash_attn: that
backend wraps an optional package, and the Triton kernels are the path every CUDA test covers.
MLA layers have no flash_attn form: under that choice they take the Triton MLA backend.
"""

from __future__ import annotations

import importlib.util
import os
from functools import lru_cache
from typing import TYPE_CHECKING

import torch

from v1_engine.attention.backend import AttentionBackend
from v1_engine.attention.cpu import CPUAttentionBackend
from v1_engine.attention.flash_attn import flash_attn_available, install_hint
from v1_engine.attention.mla_cpu import CPUMLABackend

if TYPE_CHECKING:
    from v1_engine.attention.mla_triton import TritonMLABackend

BACKEND_ENV_VAR = "V1ENGINE_ATTENTION_BACKEND"
BACKEND_CHOICES = ("cpu", "triton", "flash_attn")


def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def resolve_backend_name(device: torch.device, name: str | None = None) -> str:
    """'cpu', 'triton' or 'flash_attn' for `device`: `name` (the attention_backend option) if
    given, else $V1ENGINE_ATTENTION_BACKEND if set, else triton on CUDA and cpu elsewhere.
    Raises ValueError for an unsupported device, an unknown choice, or a backend that cannot run
    here; the message names where the choice came from."""
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"device must be one of ('cpu', 'cuda'), got {device.type!r}")
    source = "attention_backend" if name is not None else BACKEND_ENV_VAR
    choice = name if name is not None else os.environ.get(BACKEND_ENV_VAR, "").strip().lower()
    if not choice:
        return "triton" if device.type == "cuda" else "cpu"
    if choice not in BACKEND_CHOICES:
        raise ValueError(f"{source} must be one of {BACKEND_CHOICES}, got {choice!r}")
    if choice == "flash_attn":
        _check_flash_attn(device, source)
    elif choice == "triton":
        _check_triton(device, source)
    return choice


def _check_triton(device: torch.device, source: str) -> None:
    if not triton_available():
        raise ValueError(
            f"{source}='triton' needs the triton package (pip install triton), or choose 'cpu'"
        )
    if device.type == "cpu" and os.environ.get("TRITON_INTERPRET", "0") != "1":
        raise ValueError(
            f"{source}='triton' on the CPU needs the Triton interpreter (TRITON_INTERPRET=1)"
        )


def _check_flash_attn(device: torch.device, source: str) -> None:
    if device.type != "cuda":
        raise ValueError(
            f"{source}='flash_attn' runs on CUDA only, got device {device.type!r}: choose 'cpu' "
            "or leave it unset"
        )
    if not flash_attn_available():
        raise ValueError(
            f"{source}='flash_attn' but vllm_flash_attn is not importable: {install_hint()}"
        )


def get_attn_backend(device: torch.device, name: str | None = None) -> AttentionBackend:
    """The backend for `device`: `name` (the attention_backend option, None for the environment
    or auto) resolved by `resolve_backend_name`."""
    choice = resolve_backend_name(device, name)
    if choice == "cpu":
        return CPUAttentionBackend()
    if choice == "flash_attn":
        from v1_engine.attention.flash_attn import FlashAttentionBackend

        return FlashAttentionBackend(device)
    from v1_engine.attention.triton_attn import TritonAttentionBackend

    return TritonAttentionBackend()


def get_mla_backend(device: torch.device) -> CPUMLABackend | TritonMLABackend:
    """The MLA backend for `device`, chosen like `get_attn_backend` from the environment. The MLA
    op asks for it on every call: the choice is cached per (device type, environment)."""
    env = (
        os.environ.get(BACKEND_ENV_VAR, "").strip().lower(),
        os.environ.get("TRITON_INTERPRET", "0"),
    )
    return _cached_mla_backend(device.type, env)


@lru_cache(maxsize=8)
def _cached_mla_backend(device_type: str, env: tuple[str, str]) -> CPUMLABackend | TritonMLABackend:
    if resolve_backend_name(torch.device(device_type)) == "cpu":
        return CPUMLABackend()
    from v1_engine.attention.mla_triton import TritonMLABackend

    return TritonMLABackend()
