"""KV-cache sizing: bytes per block and how many blocks fit a memory budget."""

from __future__ import annotations

from collections.abc import Sequence

import torch


def kv_bytes_per_block(layers: Sequence, block_size: int, dtype: torch.dtype) -> int:
    """K and V of block_size tokens, summed over every attention layer."""
    elem = torch.empty((), dtype=dtype).element_size()
    return sum(2 * block_size * layer.num_kv_heads * layer.head_size * elem for layer in layers)


def num_kv_blocks_for_budget(budget_bytes: int, bytes_per_block: int) -> int:
    if budget_bytes < bytes_per_block:
        raise ValueError(
            f"no memory left for the KV cache (budget {budget_bytes} bytes, one block needs "
            f"{bytes_per_block}): lower max_model_len or raise gpu_memory_utilization"
        )
    return budget_bytes // bytes_per_block
