"""Fusion passes: FX rewrites of the traced forward into fused ops, applied before Inductor."""

from compile.passes.fusion import FUSION_PASSES, fuse_add_rms_norm, fuse_silu_and_mul

__all__ = ["FUSION_PASSES", "fuse_add_rms_norm", "fuse_silu_and_mul"]
