"""Picks the attention backend for a device."""

from __future__ import annotations

import torch

from v1_engine.attention.backend import AttentionBackend
from v1_engine.attention.cpu import CPUAttentionBackend


def get_attn_backend(device: torch.device) -> AttentionBackend:
    """The backend for `device`. Only the reference backend exists so far; it runs anywhere."""
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"device must be one of ('cpu', 'cuda'), got {device.type!r}")
    return CPUAttentionBackend()
