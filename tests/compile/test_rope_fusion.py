"""The `rope_kv_cache` pass: the rotary embedding moves into the attention op when its outputs
feed nothing else (compile/passes/fusion.py), where the Triton backend rotates and writes the
K/V cache in one kernel. On the CPU the op rotates with the reference and then runs the plain
path, so the rewritten forward must be bit-identical; on the GPU the fused engine must match the
unfused one (kernels: tests/kernels/test_rope_kv_cache.py)."""

from __future__ import annotations

import pytest
import torch

from compile.compiled_forward import CompiledForward
from compile.passes import fuse_rope_kv_cache
from v1_engine.attention.selector import get_attn_backend
from v1_engine.config import FUSION_PASSES
from v1_engine.forward_context import set_forward_context
from v1_engine.layers.rotary import RotaryEmbedding
from v1_engine.models.loader import get_model, load_hf_config


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.fixture
def rope_as_op(monkeypatch):
    """RotaryEmbedding through `v1_engine::rotary_embedding` on the CPU too (as on CUDA; the
    op's CPU body is the reference the module otherwise calls directly)."""

    def forward(self, positions, query, key):
        args = (positions, query, key, self.cos_cache, self.sin_cache, self.is_neox_style)
        return torch.ops.v1_engine.rotary_embedding(*args)

    monkeypatch.setattr(RotaryEmbedding, "forward", forward)


def _attention_calls(gm: torch.fx.GraphModule) -> list[torch.fx.Node]:
    return [
        n
        for n in gm.graph.nodes
        if n.op == "call_function" and "unified_attention" in str(n.target)
    ]


@pytest.mark.parametrize("use_inductor", [False, True])
def test_pass_on_tiny_llama_forward(tiny_llama_dir, rope_as_op, use_inductor):
    """Every layer's rotary moves into its attention call (the rotary op is gone from the
    graph), and the forward is bit-identical: to the eager model without Inductor, to the same
    compiled forward without the pass with it (Inductor's own kernels differ from eager)."""
    config = load_hf_config(str(tiny_llama_dir))
    cpu = torch.device("cpu")
    model = get_model(
        config, str(tiny_llama_dir), dtype=torch.float32, device=cpu, load_format="auto", seed=0
    )
    graphs = []
    passes = [("rope_kv_cache", fuse_rope_kv_cache), ("record", graphs.append)]
    forward = CompiledForward(model, passes=passes, use_inductor=use_inductor)
    reference = CompiledForward(model, use_inductor=True) if use_inductor else model
    with (
        torch.inference_mode(),
        set_forward_context(None, get_attn_backend(cpu), model.attention_layers()),
    ):
        for num_tokens in (4, 1, 9):
            input_ids = torch.randint(0, config.vocab_size, (num_tokens,))
            positions = torch.arange(num_tokens)
            assert torch.equal(forward(input_ids, positions), reference(input_ids, positions))
    layers = config.num_hidden_layers
    assert forward.stats.pass_matches["rope_kv_cache"] == layers
    calls = _attention_calls(graphs[0])
    assert len(calls) == layers and all(len(c.args) == 9 for c in calls)
    assert not any("rotary_embedding" in str(n.target) for n in graphs[0].graph.nodes)


class _RopeLeak(torch.nn.Module):
    """The rotated query is also returned: the rotation must stay where it is."""

    def __init__(self, rope: RotaryEmbedding) -> None:
        super().__init__()
        self.rope = rope

    def forward(self, positions, q, k, v):
        q, k = self.rope(positions, q, k)
        out = torch.empty_like(q)
        torch.ops.v1_engine.unified_attention(q, k, v, out, "layer")
        return out, q


def test_pass_leaves_a_rotated_query_read_elsewhere(rope_as_op):
    from v1_engine.layers.rotary import compute_inv_freq

    inv_freq = compute_inv_freq(8, {"rope_type": "default", "rope_theta": 10000.0})
    module = _RopeLeak(RotaryEmbedding(8, 64, inv_freq))
    graphs, matches = [], []

    def backend(gm, example_inputs):
        matches.append(fuse_rope_kv_cache(gm))
        graphs.append(gm)
        return gm

    compiled = torch.compile(module, backend=backend, fullgraph=True)
    positions = torch.arange(3)
    q, k, v = torch.randn(3, 2, 8), torch.randn(3, 1, 8), torch.randn(3, 1, 8)
    from v1_engine.layers.attention import Attention

    with set_forward_context(None, None, [Attention(2, 8, 1.0, 1, "layer")]):
        out, q_rot = compiled(positions, q, k, v)
    assert not out.any() and q_rot.shape == q.shape  # a run without a cache: zeros
    assert matches == [0]
    assert any("rotary_embedding" in str(n.target) for n in graphs[0].graph.nodes)


def test_rope_pass_is_on_by_default_on_cuda():
    from v1_engine.config import CompilationConfig

    assert "rope_kv_cache" in FUSION_PASSES
    assert "rope_kv_cache" in CompilationConfig().effective_fusion_passes("cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_rope_fusion_in_the_engine_matches_unfused_gpu(tmp_path, default_tokenizer, kv_cache_dtype):
    """Llama-3-8B widths, 2 layers, -O2: the default passes against the same without
    rope_kv_cache give the same greedy tokens and logprobs; with a bf16 cache the Triton
    backend's fused kernel runs, with an fp8 one its fallback (rotary op, then the quantizing
    write), which is the unfused computation exactly."""
    from engine_ab import assert_same_greedy, greedy_runs, llama8b_widths_dir

    from v1_engine.config import CompilationConfig

    model_dir = llama8b_widths_dir(tmp_path, default_tokenizer)
    default = CompilationConfig().effective_fusion_passes("cuda")
    without = [name for name in default if name != "rope_kv_cache"]
    (fused, fused_counts), (plain, plain_counts) = greedy_runs(
        model_dir, [default, without], kv_cache_dtype=kv_cache_dtype
    )
    assert fused_counts.get("rope_kv_cache") == 2 and "rope_kv_cache" not in plain_counts
    if kv_cache_dtype == "fp8":
        assert [o.token_ids for o in fused] == [o.token_ids for o in plain]
    assert_same_greedy(fused, plain)
