"""Rotary position embedding: neox style (the two halves of each head are rotated together) by
default, or the interleaved style (adjacent pairs rotated together) DeepSeek models use.

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


def _rotate(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, is_neox_style: bool
) -> torch.Tensor:
    if is_neox_style:
        half = x.shape[-1] // 2
        x1, x2 = x[..., :half], x[..., half:]
    else:
        x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def rotary_embedding_ref(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    cos_cache: torch.Tensor,
    sin_cache: torch.Tensor,
    is_neox_style: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The PyTorch rotary: RotaryEmbedding's path off CUDA, the op's body on every device but
    CUDA, and the tests' oracle. Neox style rounds the gathered cos/sin to the query dtype and
    rotates in that dtype; the interleaved style rotates in float32 whatever the model dtype,
    as its reference does."""
    if not is_neox_style:
        cos = cos_cache[positions][:, None, :]
        sin = sin_cache[positions][:, None, :]
        rotated_q = _rotate(query.float(), cos, sin, False).to(query.dtype)
        return rotated_q, _rotate(key.float(), cos, sin, False).to(key.dtype)
    cos = cos_cache[positions].to(query.dtype)[:, None, :]
    sin = sin_cache[positions].to(query.dtype)[:, None, :]
    return _rotate(query, cos, sin, True), _rotate(key, cos, sin, True)


@torch.library.custom_op("v1_engine::rotary_embedding", mutates_args=())
def rotary_embedding(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    cos_cache: torch.Tensor,
    sin_cache: torch.Tensor,
    is_neox_style: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotated (query [T, Hq, D], key [T, Hkv, D]) at `positions` [T], as new contiguous
    tensors. One opaque node under torch.compile: on CUDA a single Triton kernel
    (kernels/triton_rope.py, float32 math rounded once), elsewhere `rotary_embedding_ref`."""
    return rotary_embedding_ref(positions, query, key, cos_cache, sin_cache, is_neox_style)


@rotary_embedding.register_fake
def _rotary_embedding_fake(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    cos_cache: torch.Tensor,
    sin_cache: torch.Tensor,
    is_neox_style: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    return query.new_empty(query.shape), key.new_empty(key.shape)


@rotary_embedding.register_kernel("cuda")
def _rotary_embedding_cuda(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    cos_cache: torch.Tensor,
    sin_cache: torch.Tensor,
    is_neox_style: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    # Imported on first CUDA use so CPU imports never need triton.
    from v1_engine.kernels import triton_rope

    return triton_rope.rotary_embedding(positions, query, key, cos_cache, sin_cache, is_neox_style)


class RotaryEmbedding(nn.Module):
    """Applies rotary embedding to query [T, Hq, D] and key [T, Hkv, D] at `positions` [T].

    `attention_scaling` multiplies cos and sin (YaRN's attention factor; 1 otherwise). The
    interleaved style (`is_neox_style=False`) rotates pairs (x0, x1), (x2, x3), ... and returns
    the rotated even elements followed by the rotated odd ones: query and key get the same
    permutation, so their dot products are those of the interleaved layout. On CUDA the rotation
    is the `v1_engine::rotary_embedding` op: one kernel for query and key.
    """

    def __init__(
        self,
        head_size: int,
        max_position: int,
        inv_freq: torch.Tensor,
        attention_scaling: float = 1.0,
        is_neox_style: bool = True,
    ) -> None:
        super().__init__()
        self.head_size = head_size
        self.is_neox_style = is_neox_style
        inv_freq = inv_freq.to(torch.float32)
        freqs = torch.arange(max_position, dtype=torch.int64).to(torch.float32)[:, None] * inv_freq
        cos, sin = freqs.cos(), freqs.sin()
        if attention_scaling != 1.0:
            cos, sin = cos * attention_scaling, sin * attention_scaling
        self.register_buffer("cos_cache", cos, persistent=False)
        self.register_buffer("sin_cache", sin, persistent=False)

    def forward(
        self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if query.shape[-1] != self.head_size or key.shape[-1] != self.head_size:
            raise ValueError(
                f"query and key head size must be {self.head_size}, "
                f"got {query.shape[-1]} and {key.shape[-1]}"
            )
        return apply_rotary(
            positions, query, key, self.cos_cache, self.sin_cache, self.is_neox_style
        )


def apply_rotary(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    cos_cache: torch.Tensor,
    sin_cache: torch.Tensor,
    is_neox_style: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The rotation as the models apply it (RotaryEmbedding.forward, and the attention op when
    the `rope_kv_cache` pass moved it there without a fused backend path): the op's one kernel
    on CUDA. Elsewhere the PyTorch code itself, not the op: torch.compile then fuses it into the
    layer as it always has, so compiled CPU results stay bit-identical to before the op existed
    (an opaque op there moves bf16 roundings and greedy tokens of tiny models)."""
    args = (positions, query, key, cos_cache, sin_cache, is_neox_style)
    if query.is_cuda:
        return torch.ops.v1_engine.rotary_embedding(*args)
    return rotary_embedding_ref(*args)


def get_rope(head_size: int, max_position: int, rope_parameters: dict[str, Any]) -> RotaryEmbedding:
    """Build the rotary embedding of a model from its rope settings (see rope_parameters_of)."""
    if rope_parameters.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError(
            f"partial_rotary_factor must be 1.0, got {rope_parameters['partial_rotary_factor']}"
        )
    inv_freq = compute_inv_freq(head_size, rope_parameters)
    return RotaryEmbedding(head_size, max_position, inv_freq)


def _yarn_get_mscale(scale: float, mscale: float = 1.0) -> float:
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


def yarn_softmax_mscale(rope_parameters: dict[str, Any]) -> float:
    """The factor DeepSeek applies twice to the softmax scale (query and key each carry one) when
    a scaled rope sets `mscale_all_dim`; 1 otherwise."""
    if rope_parameters.get("rope_type", "default") == "default":
        return 1.0
    mscale_all_dim = rope_parameters.get("mscale_all_dim", 0)
    if not mscale_all_dim:
        return 1.0
    return _yarn_get_mscale(rope_parameters["factor"], mscale_all_dim)


def yarn_inv_freq(
    rotary_dim: int, params: dict[str, Any], max_position: int
) -> tuple[torch.Tensor, float]:
    """YaRN: (inverse frequencies, attention factor). High frequencies are kept, low ones divided
    by `factor`, with a linear ramp between the beta_fast and beta_slow correction dims; cos/sin
    are multiplied by the attention factor (mscale / mscale_all_dim when both are given)."""
    base = float(params["rope_theta"])
    original_max = params["original_max_position_embeddings"]
    factor = params.get("factor") or max_position / original_max
    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attention_factor = _yarn_get_mscale(factor, mscale) / _yarn_get_mscale(
                factor, mscale_all_dim
            )
        else:
            attention_factor = _yarn_get_mscale(factor)
    beta_fast = params.get("beta_fast") or 32
    beta_slow = params.get("beta_slow") or 1

    def correction_dim(num_rotations: float) -> float:
        return (rotary_dim * math.log(original_max / (num_rotations * 2 * math.pi))) / (
            2 * math.log(base)
        )

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rotary_dim - 1)
    if low == high:
        high += 0.001  # the reference's guard against a zero-width ramp
    ramp = ((torch.arange(rotary_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = base ** (torch.arange(0, rotary_dim, 2).to(dtype=torch.float32) / rotary_dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    extrapolation_factor = 1 - ramp
    inv_freq = interpolation * (1 - extrapolation_factor) + extrapolation * extrapolation_factor
    return inv_freq, float(attention_factor)


SCALED_ROPE_TYPES = (*SUPPORTED_ROPE_TYPES, "yarn")


def get_scaled_rope(
    head_size: int,
    max_position: int,
    rope_parameters: dict[str, Any],
    is_neox_style: bool = True,
) -> RotaryEmbedding:
    """Like `get_rope`, plus YaRN (inverse frequencies and attention factor) and the choice of
    rotation style: the rope of MLA models, whose rope part is interleaved."""
    if rope_parameters.get("rope_type", "default") != "yarn":
        inv_freq = compute_inv_freq(head_size, rope_parameters)
        return RotaryEmbedding(head_size, max_position, inv_freq, is_neox_style=is_neox_style)
    inv_freq, attention_factor = yarn_inv_freq(head_size, rope_parameters, max_position)
    return RotaryEmbedding(head_size, max_position, inv_freq, attention_factor, is_neox_style)
