"""The torch.compile front-end: a piecewise backend that splits the traced forward at the
attention ops and compiles each piece with Inductor, fusion passes applied before it, CUDA
graphs (piecewise for any batch, whole-forward for decode batches) and the on-disk compile
cache."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pathlib import Path

    from torch import nn

    from compile.compiled_forward import CompiledForward
    from v1_engine.config import CompilationConfig


def build_compiled_forward(
    model: nn.Module,
    config: CompilationConfig,
    cudagraphs: bool = False,
    device_type: str = "cpu",
    cache_dir: Path | None = None,
) -> CompiledForward:
    """The model's forward behind the piecewise backend with the fusion passes configured for
    `device_type`; `cudagraphs` makes its pieces capturable (piecewise CUDA graphs); with the
    compile cache's directory, traced once per cache key and loaded by later starts.

    Imported lazily by the model runner so an eager engine never loads torch.compile."""
    from compile.backend import SPLITTING_OPS
    from compile.compiled_forward import CompiledForward
    from compile.passes import FUSION_PASSES

    passes = [(name, FUSION_PASSES[name]) for name in config.effective_fusion_passes(device_type)]
    return CompiledForward(model, SPLITTING_OPS, passes, cudagraphs=cudagraphs, cache_dir=cache_dir)
