"""Reading checkpoint tensors lazily and filling models with weights (real or dummy)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn
from tqdm.auto import tqdm

from v1_engine.kernels.fp8 import FP8_DTYPE
from v1_engine.layers.linear import copy_checked
from v1_engine.layers.norm import RMSNorm


def default_weight_loader(param: nn.Parameter, loaded_weight: torch.Tensor) -> None:
    """Copy a whole checkpoint tensor into a parameter (converting dtype/device), through the
    parameter's own `weight_loader` when it has one (e.g. a linear layer's scale, stored as a
    scalar in some checkpoints)."""
    loader = getattr(param, "weight_loader", None)
    if loader is not None:
        loader(param, loaded_weight)
        return
    copy_checked(param.data, loaded_weight, "parameter")


def safetensors_files(model_dir: Path) -> list[Path]:
    """The checkpoint shards: those named by the index when there is one (a directory may also
    hold a consolidated copy), else every *.safetensors file."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return [model_dir / name for name in sorted(set(weight_map.values()))]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ValueError(f"model directory {str(model_dir)!r} holds no *.safetensors files")
    return files


def safetensors_weights_iterator(model_dir: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) for every tensor of the checkpoint, each read from the mmapped file only
    when the consumer asks for it."""
    files = safetensors_files(model_dir)
    total = 0
    for file in files:
        with safe_open(file, framework="pt", device="cpu") as f:
            total += len(f.keys())
    with tqdm(total=total, desc="Loading weights", unit="tensor") as progress:
        for file in files:
            with safe_open(file, framework="pt", device="cpu") as f:
                names = f.keys()
                for name in names:
                    yield name, f.get_tensor(name)
                    progress.update(1)


@torch.no_grad()
def initialize_dummy_weights(model: nn.Module, seed: int, std: float = 0.02) -> None:
    """Random weights of the real shapes (the benchmark load format): normal(0, std) everywhere,
    ones for RMSNorm scales so activations keep a sane magnitude through the layers.

    An FP8 checkpoint's config gives FP8 weights and scales: the weights get normal(0, 1) and
    every scale `std`, so the dequantized weights are normal(0, std) like the others."""
    norm_weights = {id(m.weight) for m in model.modules() if isinstance(m, RMSNorm)}
    for param in model.parameters():
        if id(param) in norm_weights:
            param.fill_(1.0)
            continue
        if getattr(param, "is_quant_scale", False):
            param.fill_(std)
            continue
        generator = torch.Generator(device=param.device).manual_seed(seed)
        if param.dtype == FP8_DTYPE:
            values = torch.empty(param.shape, device=param.device)
            param.copy_(values.normal_(mean=0.0, std=1.0, generator=generator))
        else:
            param.normal_(mean=0.0, std=std, generator=generator)
        seed += 1
