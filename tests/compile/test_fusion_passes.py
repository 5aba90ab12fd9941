"""Fusion passes: each finds its pattern in the traced Llama forward and leaves the result
bit-identical (the fused ops compute the same operations in the same order)."""

from __future__ import annotations

import pytest
import torch

from compile.compiled_forward import CompiledForward
from compile.passes import fuse_add_rms_norm, fuse_silu_and_mul
from v1_engine.attention.selector import get_attn_backend
from v1_engine.forward_context import set_forward_context
from v1_engine.layers.activation import SiluAndMul
from v1_engine.layers.norm import RMSNorm
from v1_engine.models.loader import get_model, load_hf_config


def _count_op(gm: torch.fx.GraphModule, name: str) -> int:
    return sum(
        1 for node in gm.graph.nodes if node.op == "call_function" and name in str(node.target)
    )


def _compile_with(module: torch.nn.Module, graph_pass=None):
    """`module` behind a backend that records Dynamo's graph (after `graph_pass`, if any) and
    runs it as FX, so any difference in the result comes from the pass alone."""
    graphs: list[torch.fx.GraphModule] = []
    matches: list[int] = []

    def backend(gm, example_inputs):
        if graph_pass is not None:
            matches.append(graph_pass(gm))
        graphs.append(gm)
        return gm

    return torch.compile(module, backend=backend, fullgraph=True), graphs, matches


class _NormThenMLP(torch.nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.norm = RMSNorm(hidden, eps=1e-5)
        self.act = SiluAndMul()
        torch.nn.init.normal_(self.norm.weight)

    def forward(self, x: torch.Tensor, residual: torch.Tensor):
        normed, summed = self.norm(x, residual)
        return self.act(torch.cat([normed, summed], dim=-1)), summed


def _both_passes(gm: torch.fx.GraphModule) -> tuple[int, int]:
    return fuse_add_rms_norm(gm), fuse_silu_and_mul(gm)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_passes_find_patterns_and_keep_results(dtype):
    torch.manual_seed(0)
    module = _NormThenMLP(32).to(dtype)
    x, residual = torch.randn(5, 32, dtype=dtype), torch.randn(5, 32, dtype=dtype)
    compiled, graphs, matches = _compile_with(module, _both_passes)
    actual = compiled(x, residual)
    assert matches == [(1, 1)]
    gm = graphs[0]
    assert _count_op(gm, "fused_add_rms_norm") == 1
    assert _count_op(gm, "silu_and_mul") == 1
    assert _count_op(gm, "rsqrt") == 0
    for a, b in zip(actual, module(x, residual)):
        assert torch.equal(a, b)


@pytest.fixture(autouse=True)
def fresh_dynamo():
    """Each test here traces from a clean Dynamo state: code caches and automatic dynamic-shape
    decisions left by earlier compiled models would change what the trace (and the passes) see."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def test_passes_leave_unmatched_graphs_alone():
    module = RMSNorm(16)  # no residual add: not the fused pattern
    torch.nn.init.ones_(module.weight)
    compiled, _, matches = _compile_with(module, _both_passes)
    x = torch.randn(3, 16)
    assert torch.equal(compiled(x), module(x))
    assert matches == [(0, 0)]


def test_passes_on_tiny_llama_forward(tiny_llama_dir):
    """Every residual norm (2 per layer; the first layer's input norm has no residual, the final
    norm has one) and every MLP gate is fused, and the forward is bit-identical."""
    config = load_hf_config(str(tiny_llama_dir))
    cpu = torch.device("cpu")
    model = get_model(
        config, str(tiny_llama_dir), dtype=torch.float32, device=cpu, load_format="auto", seed=0
    )
    passes = [("add_rms_norm", fuse_add_rms_norm), ("silu_and_mul", fuse_silu_and_mul)]
    forward = CompiledForward(model, passes=passes, use_inductor=False)
    layers = config.num_hidden_layers
    with (
        torch.inference_mode(),
        set_forward_context(None, get_attn_backend(cpu), model.attention_layers()),
    ):
        for num_tokens in (4, 1, 9):
            input_ids = torch.randint(0, config.vocab_size, (num_tokens,))
            positions = torch.arange(num_tokens)
            assert torch.equal(forward(input_ids, positions), model(input_ids, positions))
    assert forward.stats.pass_matches == {"add_rms_norm": 2 * layers, "silu_and_mul": layers}
    assert forward.stats.num_traces == 1


def test_fusion_passes_default_by_device():
    """Unset: every pass but the opt-in ones on CUDA (one Triton kernel per fused op), none on
    the CPU; an explicit list (even empty) wins everywhere, opt-in passes included."""
    from v1_engine.config import FUSION_PASSES, OPT_IN_FUSION_PASSES, CompilationConfig

    default = CompilationConfig().effective_fusion_passes("cuda")
    assert OPT_IN_FUSION_PASSES == ("skinny_add_rms_norm", "fused_mlp", "skinny_norm_linear")
    assert default == [name for name in FUSION_PASSES if name not in OPT_IN_FUSION_PASSES]
    assert "skinny_silu_mul" in default and "fp8_gated_mlp" in default
    assert "fp8_norm_linear" in default and "fp8_dynamic_linear" in default
    opt_in = CompilationConfig(fusion_passes=["skinny_add_rms_norm"])
    assert opt_in.effective_fusion_passes("cuda") == ["skinny_add_rms_norm"]
    assert CompilationConfig().effective_fusion_passes("cpu") == []
    assert CompilationConfig(fusion_passes=[]).effective_fusion_passes("cuda") == []
    chosen = CompilationConfig(fusion_passes=["silu_and_mul"])
    assert chosen.effective_fusion_passes("cuda") == ["silu_and_mul"]


def test_fusion_passes_refuse_unknown_and_repeated_names():
    """A pass named twice would run twice (its second run finds nothing and its match count no
    longer says what the graph holds): refused, as an unknown name is, naming the field."""
    from v1_engine.config import CompilationConfig

    CompilationConfig(fusion_passes=["silu_and_mul", "add_rms_norm"]).verify()
    with pytest.raises(ValueError, match=r"fusion_passes must name each pass once.*silu_and_mul"):
        CompilationConfig(fusion_passes=["silu_and_mul", "add_rms_norm", "silu_and_mul"]).verify()
    with pytest.raises(ValueError, match=r"fusion_passes must be among .*\['nope'\]"):
        CompilationConfig(fusion_passes=["nope"]).verify()
