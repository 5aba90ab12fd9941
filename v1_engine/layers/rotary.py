"""Rotary position embedding (neox style: the two halves of each head are rotated together).

The cos/sin table is computed once for every position up to max_position, in float32, with the
same operations as the reference implementation so that results match it bit for bit.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


def rope_parameters_of(hf_config: Any) -> dict[str, Any]:
    """The rope settings as one dict: transformers 5's `rope_parameters`, or the legacy
    `rope_theta` + `rope_scaling` attributes of older configs."""
    params = getattr(hf_config, "rope_parameters", None)
    if isinstance(params, dict) and "rope_theta" in params:
        return {"rope_type": "default", **params}
    scaling = dict(getattr(hf_config, "rope_scaling", None) or {})
    rope_type = scaling.pop("rope_type", scaling.pop("type", "default"))
    theta = getattr(hf_config, "rope_theta", 10000.0)
    return {**scaling, "rope_type": rope_type, "rope_theta": theta}


def _base_inv_freq(rotary_dim: int, theta: float) -> torch.Tensor:
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64).to(torch.float32) / rotary_dim
    return 1.0 / (theta**exponents)


def _llama3_inv_freq(inv_freq: torch.Tensor, params: dict[str, Any]) -> torch.Tensor:
    """Llama 3.1 scaling: low frequencies divided by `factor`, high ones kept, a smooth ramp
    in between."""
    factor = params["factor"]
    low_freq_factor = params["low_freq_factor"]
    high_freq_factor = params["high_freq_factor"]
    old_context_len = params["original_max_position_embeddings"]
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def compute_inv_freq(rotary_dim: int, params: dict[str, Any]) -> torch.Tensor:
    """Inverse frequencies [rotary_dim // 2] for one of SUPPORTED_ROPE_TYPES."""
    rope_type = params.get("rope_type", "default")
    inv_freq = _base_inv_freq(rotary_dim, float(params["rope_theta"]))
    if rope_type == "default":
        return inv_freq
    if rope_type == "linear":
        return inv_freq / params["factor"]
    if rope_type == "llama3":
        return _llama3_inv_freq(inv_freq, params)
    raise ValueError(f"rope_type must be one of {SUPPORTED_ROPE_TYPES}, got {rope_type!r}")


class RotaryEmbedding(nn.Module):
    """Applies rotary embedding to query [T, Hq, D] and key [T, Hkv, D] at `positions` [T]."""

    def __init__(self, head_size: int, max_position: int, inv_freq: torch.Tensor) -> None:
        super().__init__()
        self.head_size = head_size
        inv_freq = inv_freq.to(torch.float32)
        freqs = torch.arange(max_position, dtype=torch.int64).to(torch.float32)[:, None] * inv_freq
        self.register_buffer("cos_cache", freqs.cos(), persistent=False)
        self.register_buffer("sin_cache", freqs.sin(), persistent=False)

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        half = self.head_size // 2
        x1, x2 = x[..., :half], x[..., half:]
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)

    def forward(
        self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        cos = self.cos_cache[positions].to(query.dtype)[:, None, :]
        sin = self.sin_cache[positions].to(query.dtype)[:, None, :]
        return self._rotate(query, cos, sin), self._rotate(key, cos, sin)


def get_rope(head_size: int, max_position: int, rope_parameters: dict[str, Any]) -> RotaryEmbedding:
    """Build the rotary embedding of a model from its rope settings (see rope_parameters_of)."""
    if rope_parameters.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError(
            f"partial_rotary_factor must be 1.0, got {rope_parameters['partial_rotary_factor']}"
        )
    inv_freq = compute_inv_freq(head_size, rope_parameters)
    return RotaryEmbedding(head_size, max_position, inv_freq)
