"""KV-cache sizing: bytes per block, how many blocks fit a budget, and the GPU memory profile
that finds the budget (weights + peak activations + non-torch memory, the rest is KV cache)."""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

if TYPE_CHECKING:
    from v1_engine.config import CacheConfig

logger = logging.getLogger(__name__)

FP8_KV_CACHE_NAMES = ("fp8", "fp8_e4m3")


def resolve_kv_cache_dtype(
    cache_config: CacheConfig, model_dtype: torch.dtype, layers: Iterable[nn.Module] = ()
) -> torch.dtype:
    """The dtype the KV cache is allocated in: the model dtype for "auto", e4m3 for "fp8".

    Raises ValueError for an fp8 cache when one of `layers` cannot read it: only the standard
    attention layer has the fp8 path (an MLA layer's latent cache stays in the model dtype).
    """
    name = cache_config.kv_cache_dtype
    if name == "auto":
        return model_dtype
    if name not in FP8_KV_CACHE_NAMES:
        raise ValueError(
            f"kv_cache_dtype must be one of {('auto', *FP8_KV_CACHE_NAMES)}, got {name!r}"
        )
    from v1_engine.layers.attention import Attention

    unsupported = [layer for layer in layers if not isinstance(layer, Attention)]
    if unsupported:
        first = unsupported[0]
        raise ValueError(
            f"kv_cache_dtype={name!r} is supported only by standard attention layers, but "
            f"{len(unsupported)} layers (e.g. {getattr(first, 'layer_name', '?')}) are "
            f"{type(first).__name__}, whose cache stays in the model dtype: use "
            f"kv_cache_dtype='auto' for this model"
        )
    return torch.float8_e4m3fn


def kv_bytes_per_block(layers: Sequence, block_size: int, dtype: torch.dtype) -> int:
    """One block of block_size tokens, summed over every attention layer's cache shape."""
    elem = torch.empty((), dtype=dtype).element_size()
    return sum(math.prod(layer.kv_cache_shape(1, block_size)) * elem for layer in layers)


def num_kv_blocks_for_budget(budget_bytes: int, bytes_per_block: int) -> int:
    if budget_bytes < bytes_per_block:
        raise ValueError(
            f"no memory left for the KV cache (budget {budget_bytes} bytes, one block needs "
            f"{bytes_per_block}): lower max_model_len or raise gpu_memory_utilization"
        )
    return budget_bytes // bytes_per_block


GIB = float(1 << 30)


@dataclass(frozen=True)
class KVBudgetReport:
    """What the memory profile measured and the KV pool it leaves room for (bytes unless named)."""

    total_bytes: int
    """Device memory in all."""
    usable_bytes: int
    """total * gpu_memory_utilization: what the engine may use, weights and KV included."""
    weights_bytes: int
    """Held by the torch allocator before the profile forward (the weights, mostly)."""
    peak_activation_bytes: int
    """Peak allocation of the profile forward above the weights."""
    non_torch_bytes: int
    """Used outside this process's torch allocator: CUDA context, library workspaces, others."""
    kv_cache_bytes: int
    num_blocks: int
    block_size: int
    bytes_per_block: int
    profiled_tokens: int

    @property
    def max_concurrent_tokens(self) -> int:
        return self.num_blocks * self.block_size

    def summary(self) -> str:
        return (
            f"memory profile at {self.profiled_tokens} tokens: total {self.total_bytes / GIB:.2f} "
            f"GiB, usable {self.usable_bytes / GIB:.2f} GiB, weights {self.weights_bytes / GIB:.2f}"
            f" GiB, peak activation {self.peak_activation_bytes / GIB:.2f} GiB, non-torch "
            f"{self.non_torch_bytes / GIB:.2f} GiB -> KV cache {self.kv_cache_bytes / GIB:.2f} "
            f"GiB = {self.num_blocks} blocks of {self.block_size} tokens "
            f"({self.max_concurrent_tokens} concurrent tokens)"
        )


def kv_budget_from_measurements(
    total_bytes: int,
    free_bytes: int,
    reserved_bytes: int,
    weights_bytes: int,
    peak_activation_bytes: int,
    gpu_memory_utilization: float,
) -> tuple[int, int, int]:
    """(kv_budget, usable, non_torch) from one profile's measurements.

    usable = total * utilization; it must hold the weights, the activation peak of the largest
    step and whatever is not the torch allocator's (`total - free - reserved`: the CUDA context,
    cuBLAS workspaces, other processes); the rest is KV cache. Freed-but-cached allocator memory
    does not count against the budget: the allocator hands it to the KV cache.
    """
    if not 0.0 < gpu_memory_utilization <= 1.0:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization}")
    usable = int(total_bytes * gpu_memory_utilization)
    non_torch = max(0, total_bytes - free_bytes - reserved_bytes)
    budget = usable - weights_bytes - peak_activation_bytes - non_torch
    return budget, usable, non_torch


def make_dummy_forward(
    model: nn.Module,
    attn_backend: Any,
    num_tokens: int,
    num_logits: int,
    vocab_size: int,
    device: torch.device,
    max_positions: int | None = None,
) -> Callable[[], None]:
    """A forward of `num_tokens` tokens without KV cache, plus logits for `num_logits` rows.

    It reaches the activation peak of the largest step: attention runs with no metadata (the op
    zero-fills its output), the MLP and the projections see the full token budget, and the
    float32 logits of a full batch of sampled rows are materialised.
    """
    from v1_engine.forward_context import set_forward_context

    def forward() -> None:
        input_ids = torch.randint(0, vocab_size, (num_tokens,), device=device)
        positions = torch.arange(num_tokens, device=device)
        if max_positions is not None:
            # The budget may exceed the context length: stay inside the rotary tables.
            positions = positions % max_positions
        with torch.inference_mode():
            with set_forward_context(None, attn_backend, model.attention_layers()):
                hidden = model(input_ids, positions)
            rows = hidden[-min(num_logits, num_tokens) :]
            logits = model.compute_logits(rows).float()
            torch.softmax(logits, dim=-1)
            # One row too: the head's decode-sized kernels (the skinny GEMM, the rescored FP8
            # head's) compile here, at startup, not in the first request's step.
            model.compute_logits(rows[-1:])

    return forward


def profile_kv_budget(
    model: nn.Module,
    dummy_forward: Callable[[], None],
    *,
    block_size: int,
    kv_dtype: torch.dtype,
    gpu_memory_utilization: float,
    device: torch.device,
    profiled_tokens: int,
    max_model_len: int | None = None,
) -> tuple[int, KVBudgetReport]:
    """Size the KV pool from a profiled forward at the step's token budget; (num_blocks, report).

    Call it after the weights are loaded and before any KV cache is allocated. Raises ValueError
    when the pool cannot hold one block, or `max_model_len` tokens when given.
    """
    if device.type != "cuda":
        raise ValueError(f"profile_kv_budget needs a CUDA device, got {device}")
    per_block = kv_bytes_per_block(model.attention_layers(), block_size, kv_dtype)
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    weights = torch.cuda.memory_allocated(device)
    dummy_forward()
    torch.cuda.synchronize(device)
    peak_activation = torch.cuda.max_memory_allocated(device) - weights
    free, total = torch.cuda.mem_get_info(device)
    reserved = torch.cuda.memory_reserved(device)
    budget, usable, non_torch = kv_budget_from_measurements(
        total, free, reserved, weights, peak_activation, gpu_memory_utilization
    )
    torch.cuda.empty_cache()
    num_blocks = num_kv_blocks_for_budget(budget, per_block)
    report = KVBudgetReport(
        total_bytes=total,
        usable_bytes=usable,
        weights_bytes=weights,
        peak_activation_bytes=peak_activation,
        non_torch_bytes=non_torch,
        kv_cache_bytes=num_blocks * per_block,
        num_blocks=num_blocks,
        block_size=block_size,
        bytes_per_block=per_block,
        profiled_tokens=profiled_tokens,
    )
    logger.info("%s", report.summary())
    if max_model_len is not None and report.max_concurrent_tokens < max_model_len:
        raise ValueError(
            f"the KV cache holds {report.max_concurrent_tokens} tokens, fewer than max_model_len "
            f"({max_model_len}): lower max_model_len or raise gpu_memory_utilization "
            f"({report.summary()})"
        )
    return num_blocks, report
