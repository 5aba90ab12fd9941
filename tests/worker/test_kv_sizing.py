"""KV sizing: the budget arithmetic (CPU) and the memory profile on a real device (gpu)."""

from __future__ import annotations

import pytest
import torch

from v1_engine.worker.kv_sizing import (
    kv_budget_from_measurements,
    kv_bytes_per_block,
    make_dummy_forward,
    profile_kv_budget,
)

GIB = 1 << 30


def test_budget_subtracts_weights_activations_and_non_torch_memory():
    # 100 GiB device, 0.9 usable; torch reserved 20 GiB, 75 GiB free -> 5 GiB outside torch.
    budget, usable, non_torch = kv_budget_from_measurements(
        total_bytes=100 * GIB,
        free_bytes=75 * GIB,
        reserved_bytes=20 * GIB,
        weights_bytes=16 * GIB,
        peak_activation_bytes=3 * GIB,
        gpu_memory_utilization=0.9,
    )
    assert usable == 90 * GIB
    assert non_torch == 5 * GIB
    assert budget == (90 - 16 - 3 - 5) * GIB


def test_budget_rejects_bad_utilization():
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        kv_budget_from_measurements(GIB, GIB, 0, 0, 0, 1.5)


def test_profile_needs_cuda():
    with pytest.raises(ValueError, match="CUDA"):
        profile_kv_budget(
            torch.nn.Linear(2, 2),
            lambda: None,
            block_size=16,
            kv_dtype=torch.float32,
            gpu_memory_utilization=0.5,
            device=torch.device("cpu"),
            profiled_tokens=1,
        )


def _tiny_cuda_model() -> torch.nn.Module:
    from pathlib import Path

    from transformers import LlamaConfig

    from v1_engine.models import get_model

    config = LlamaConfig(
        vocab_size=1000,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
    )
    return get_model(
        config,
        Path("."),
        dtype=torch.bfloat16,
        device=torch.device("cuda"),
        load_format="dummy",
        seed=0,
    )


@pytest.mark.gpu
def test_profile_on_gpu_sizes_pool_from_measured_memory():
    from v1_engine.attention.triton_attn import TritonAttentionBackend

    model = _tiny_cuda_model()
    device = torch.device("cuda")
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    forward = make_dummy_forward(model, TritonAttentionBackend(), 4096, 256, 1000, device)
    num_blocks, report = profile_kv_budget(
        model,
        forward,
        block_size=16,
        kv_dtype=torch.bfloat16,
        gpu_memory_utilization=0.3,
        device=device,
        profiled_tokens=4096,
        max_model_len=4096,
    )
    per_block = kv_bytes_per_block(model.attention_layers(), 16, torch.bfloat16)
    assert report.bytes_per_block == per_block == 2 * 2 * 16 * 2 * 64 * 2
    assert report.weights_bytes >= params
    # 4096 tokens x 512 intermediate x bf16 (gate and up): at least 8 MiB of activations.
    assert report.peak_activation_bytes >= 4096 * 512 * 2 * 2
    assert num_blocks == report.num_blocks
    used = report.weights_bytes + report.peak_activation_bytes + report.non_torch_bytes
    assert used + num_blocks * per_block <= report.usable_bytes
    assert used + (num_blocks + 1) * per_block > report.usable_bytes
    print("\n" + report.summary())
    with pytest.raises(ValueError, match="max_model_len"):
        profile_kv_budget(
            model,
            forward,
            block_size=16,
            kv_dtype=torch.bfloat16,
            gpu_memory_utilization=0.3,
            device=device,
            profiled_tokens=4096,
            max_model_len=10**12,
        )
