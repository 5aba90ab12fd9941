"""Fusion passes: FX rewrites of the traced forward into fused ops, applied before Inductor
(compile/passes/fusion.py, and the FP8 ones in compile/passes/fp8_fusion.py)."""

from collections.abc import Callable

from torch import fx

from compile.passes.fp8_fusion import (
    fuse_fp8_dynamic_linear,
    fuse_fp8_gated_mlp,
    fuse_fp8_norm_linear,
    fuse_rms_norm_fp8_quant,
    fuse_silu_and_mul_fp8_quant,
)
from compile.passes.fusion import (
    fuse_add_rms_norm,
    fuse_mlp,
    fuse_rope_kv_cache,
    fuse_silu_and_mul,
    fuse_skinny_add_rms_norm,
    fuse_skinny_norm_linear,
    fuse_skinny_silu_mul,
)

FUSION_PASSES: dict[str, Callable[[fx.GraphModule], int]] = {
    "add_rms_norm": fuse_add_rms_norm,
    "silu_and_mul": fuse_silu_and_mul,
    "rms_norm_fp8_quant": fuse_rms_norm_fp8_quant,
    "silu_and_mul_fp8_quant": fuse_silu_and_mul_fp8_quant,
    "fp8_gated_mlp": fuse_fp8_gated_mlp,
    "fp8_norm_linear": fuse_fp8_norm_linear,
    "fp8_dynamic_linear": fuse_fp8_dynamic_linear,
    "skinny_silu_mul": fuse_skinny_silu_mul,
    "skinny_norm_linear": fuse_skinny_norm_linear,
    "fused_mlp": fuse_mlp,
    "skinny_add_rms_norm": fuse_skinny_add_rms_norm,
    "rope_kv_cache": fuse_rope_kv_cache,
}
"""Fusion passes by the name `CompilationConfig.fusion_passes` uses."""

__all__ = [
    "FUSION_PASSES",
    "fuse_add_rms_norm",
    "fuse_fp8_dynamic_linear",
    "fuse_fp8_gated_mlp",
    "fuse_fp8_norm_linear",
    "fuse_mlp",
    "fuse_rms_norm_fp8_quant",
    "fuse_rope_kv_cache",
    "fuse_silu_and_mul",
    "fuse_silu_and_mul_fp8_quant",
    "fuse_skinny_add_rms_norm",
    "fuse_skinny_norm_linear",
    "fuse_skinny_silu_mul",
]
