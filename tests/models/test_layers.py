"""Layer building blocks: rope settings, fused norms, sharded weight loading, the registry."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from v1_engine.layers.activation import SiluAndMul
from v1_engine.layers.linear import MergedColumnLinear, QKVLinear
from v1_engine.layers.norm import RMSNorm
from v1_engine.layers.rotary import compute_inv_freq, get_rope, rope_parameters_of
from v1_engine.models.llama import LlamaForCausalLM
from v1_engine.models.registry import get_model_class


def test_rope_parameters_from_transformers5_and_legacy_configs():
    modern = SimpleNamespace(
        rope_parameters={"rope_type": "linear", "rope_theta": 5.0, "factor": 2}
    )
    assert rope_parameters_of(modern) == {"rope_type": "linear", "rope_theta": 5.0, "factor": 2}
    legacy = SimpleNamespace(rope_theta=500.0, rope_scaling={"type": "linear", "factor": 4.0})
    assert rope_parameters_of(legacy) == {"rope_type": "linear", "rope_theta": 500.0, "factor": 4.0}
    bare = SimpleNamespace()
    assert rope_parameters_of(bare) == {"rope_type": "default", "rope_theta": 10000.0}


def test_linear_rope_divides_default_frequencies():
    default = compute_inv_freq(8, {"rope_type": "default", "rope_theta": 100.0})
    linear = compute_inv_freq(8, {"rope_type": "linear", "rope_theta": 100.0, "factor": 4.0})
    torch.testing.assert_close(default, torch.tensor([1.0, 100**-0.25, 100**-0.5, 100**-0.75]))
    torch.testing.assert_close(linear, default / 4)


def test_unknown_rope_type_is_rejected():
    with pytest.raises(ValueError, match="rope_type must be one of"):
        get_rope(8, 16, {"rope_type": "yarn", "rope_theta": 10.0, "factor": 2.0})


def test_rope_at_position_zero_is_identity_and_preserves_norms():
    rope = get_rope(8, 16, {"rope_type": "default", "rope_theta": 10000.0})
    q, k = torch.randn(3, 4, 8), torch.randn(3, 2, 8)
    positions = torch.tensor([0, 5, 15])
    rq, _ = rope(positions, q, k)
    torch.testing.assert_close(rq[0], q[0])
    torch.testing.assert_close(rq.norm(dim=-1), q.norm(dim=-1))
    # Rotating both by the same offset keeps their dot product (relative positions only).
    a, b = rope(torch.tensor([3, 3]), q[:2, :1].expand(2, 2, 8), k[:2])
    c, d = rope(torch.tensor([9, 9]), q[:2, :1].expand(2, 2, 8), k[:2])
    torch.testing.assert_close((a * b).sum(-1), (c * d).sum(-1), atol=1e-5, rtol=1e-5)


def test_fused_residual_norm_returns_normed_sum_and_sum():
    norm = RMSNorm(16, eps=1e-6)
    torch.nn.init.uniform_(norm.weight, 0.5, 1.5)
    x, residual = torch.randn(5, 16), torch.randn(5, 16)
    out, new_residual = norm(x, residual)
    torch.testing.assert_close(new_residual, x + residual)
    summed = x + residual
    expected = norm.weight * summed / torch.sqrt(summed.pow(2).mean(-1, keepdim=True) + 1e-6)
    torch.testing.assert_close(out, expected)


def test_silu_and_mul():
    x = torch.randn(3, 8)
    torch.testing.assert_close(SiluAndMul()(x), torch.nn.functional.silu(x[:, :4]) * x[:, 4:])


def test_qkv_shards_land_in_order_and_shapes_are_checked():
    layer = QKVLinear(hidden_size=6, head_size=2, num_heads=2, num_kv_heads=1, bias=True)
    q, k, v = torch.full((4, 6), 1.0), torch.full((2, 6), 2.0), torch.full((2, 6), 3.0)
    for shard_id, tensor in (("v", v), ("q", q), ("k", k)):
        layer.weight.weight_loader(layer.weight, tensor, shard_id)
    assert layer.weight[:, 0].tolist() == [1, 1, 1, 1, 2, 2, 3, 3]
    with pytest.raises(ValueError, match=r"shape \(3, 6\)"):
        layer.weight.weight_loader(layer.weight, torch.zeros(3, 6), "k")


def test_merged_column_linear_concatenates_outputs():
    layer = MergedColumnLinear(4, [3, 5])
    gate, up = torch.randn(3, 4), torch.randn(5, 4)
    layer.weight.weight_loader(layer.weight, up, 1)
    layer.weight.weight_loader(layer.weight, gate, 0)
    x = torch.randn(2, 4)
    torch.testing.assert_close(layer(x), torch.cat([x @ gate.T, x @ up.T], dim=-1))


@pytest.mark.parametrize(
    "config",
    [
        SimpleNamespace(architectures=["MistralForCausalLM"], model_type="mistral"),
        SimpleNamespace(architectures=["Qwen2ForCausalLM"], model_type="qwen2"),
        SimpleNamespace(architectures=None, model_type="qwen3"),
    ],
)
def test_registry_maps_family_to_llama_class(config):
    assert get_model_class(config) is LlamaForCausalLM


def test_registry_rejects_unknown_model_type():
    with pytest.raises(ValueError, match="LlamaForCausalLM"):
        get_model_class(SimpleNamespace(architectures=[], model_type="gpt2"))
