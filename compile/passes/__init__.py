"""Fusion passes: FX rewrites of the traced forward into fused ops, applied before Inductor."""

from compile.passes.fusion import (
    FUSION_PASSES,
    fuse_add_rms_norm,
    fuse_mlp,
    fuse_rms_norm_fp8_quant,
    fuse_rope_kv_cache,
    fuse_silu_and_mul,
    fuse_silu_and_mul_fp8_quant,
    fuse_skinny_add_rms_norm,
    fuse_skinny_silu_mul,
)

__all__ = [
    "FUSION_PASSES",
    "fuse_add_rms_norm",
    "fuse_mlp",
    "fuse_rms_norm_fp8_quant",
    "fuse_rope_kv_cache",
    "fuse_silu_and_mul",
    "fuse_silu_and_mul_fp8_quant",
    "fuse_skinny_add_rms_norm",
    "fuse_skinny_silu_mul",
]
