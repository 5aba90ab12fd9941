"""The skinny-epilogue passes: a `v1_engine::skinny_linear` whose output only feeds the MLP's
SiLU-and-mul, or the residual add + RMSNorm after it, becomes one op (compile/passes/fusion.py).
On the CPU the fused ops run their references (F.linear, then the unfused op's reference), so
the rewritten graph must give bit-identical results; the kernels behind the ops on CUDA are
tested in tests/kernels/test_skinny_epilogues.py."""

from __future__ import annotations

import pytest
import torch

from compile.compiled_forward import CompiledForward
from compile.passes import fuse_skinny_add_rms_norm, fuse_skinny_norm_linear, fuse_skinny_silu_mul
from v1_engine.attention.selector import get_attn_backend
from v1_engine.config import FUSION_PASSES
from v1_engine.forward_context import set_forward_context
from v1_engine.layers.activation import SiluAndMul
from v1_engine.layers.norm import RMSNorm
from v1_engine.layers.quantization.base import UnquantizedLinearMethod
from v1_engine.models.loader import get_model, load_hf_config

skinny_linear_op = pytest.importorskip("v1_engine.kernels.skinny_linear_op")  # the op


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _ops(gm: torch.fx.GraphModule) -> list[str]:
    return [str(n.target) for n in gm.graph.nodes if n.op == "call_function"]


def _count(gm: torch.fx.GraphModule, name: str) -> int:
    return sum(1 for target in _ops(gm) if target.split(".")[1:2] == [name])


def _compile_with(module: torch.nn.Module, graph_pass):
    graphs: list[torch.fx.GraphModule] = []
    matches: list[object] = []

    def backend(gm, example_inputs):
        matches.append(graph_pass(gm))
        graphs.append(gm)
        return gm

    return torch.compile(module, backend=backend, fullgraph=True), graphs, matches


class _Mlp(torch.nn.Module):
    """gate_up (skinny) -> SiLU-and-mul -> down (skinny) -> add + RMSNorm, as a Llama layer's
    MLP and the next layer's input norm; `bias` and `leak` break the patterns."""

    def __init__(self, hidden: int, inter: int, bias: bool = False, leak: bool = False) -> None:
        super().__init__()
        self.w_gate_up = torch.nn.Parameter(torch.randn(2 * inter, hidden) * 0.1)
        self.w_down = torch.nn.Parameter(torch.randn(hidden, inter) * 0.1)
        self.b_down = torch.nn.Parameter(torch.randn(hidden)) if bias else None
        self.act = SiluAndMul()
        self.norm = RMSNorm(hidden, eps=1e-5)
        torch.nn.init.normal_(self.norm.weight)
        self.leak = leak

    def forward(self, x: torch.Tensor, residual: torch.Tensor):
        gate_up = torch.ops.v1_engine.skinny_linear(x, self.w_gate_up, None)
        act = self.act(gate_up)
        down = torch.ops.v1_engine.skinny_linear(act, self.w_down, self.b_down)
        normed, summed = self.norm(down, residual)
        if self.leak:  # the GEMM outputs read elsewhere too: nothing may be fused away
            return normed, summed, gate_up.sum() + down.sum()
        return normed, summed


def _both(gm: torch.fx.GraphModule) -> tuple[int, int]:
    return fuse_skinny_silu_mul(gm), fuse_skinny_add_rms_norm(gm)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_passes_fuse_the_mlp_and_keep_results(dtype):
    torch.manual_seed(0)
    module = _Mlp(32, 48).to(dtype)
    x, residual = torch.randn(3, 32, dtype=dtype), torch.randn(3, 32, dtype=dtype)
    compiled, graphs, matches = _compile_with(module, _both)
    actual = compiled(x, residual)
    assert matches == [(1, 1)]
    gm = graphs[0]
    assert _count(gm, "skinny_linear_silu_mul") == 1
    assert _count(gm, "skinny_linear_add_rms_norm") == 1
    for name in ("skinny_linear", "silu_and_mul", "fused_add_rms_norm"):
        assert _count(gm, name) == 0, _ops(gm)
    for a, b in zip(actual, module(x, residual)):
        assert torch.equal(a, b)


@pytest.mark.parametrize(
    ("bias", "leak", "expected"), [(True, False, (1, 0)), (False, True, (0, 0))]
)
def test_passes_leave_other_uses_alone(bias, leak, expected):
    """A biased GEMM is not fused into the norm; GEMM outputs read elsewhere are not fused."""
    torch.manual_seed(1)
    module = _Mlp(16, 24, bias=bias, leak=leak)
    x, residual = torch.randn(2, 16), torch.randn(2, 16)
    compiled, graphs, matches = _compile_with(module, _both)
    actual = compiled(x, residual)
    assert matches == [expected]
    assert _count(graphs[0], "skinny_linear") == 2 - sum(expected)
    for a, b in zip(actual, module(x, residual)):
        assert torch.equal(a, b)


def test_passes_on_tiny_llama_forward(tiny_llama_dir, monkeypatch):
    """The Llama forward with its unquantized linears on `v1_engine::skinny_linear` (as on
    CUDA): every MLP's gate_up + SiLU and every GEMM before a residual norm (o_proj and down_proj:
    2 per layer, the last down_proj into the final norm) become one op; bit-identical."""
    monkeypatch.setattr(
        UnquantizedLinearMethod,
        "apply",
        lambda self, layer, x, bias: skinny_linear_op.skinny_linear(x, layer.weight, bias),
    )
    config = load_hf_config(str(tiny_llama_dir))
    cpu = torch.device("cpu")
    model = get_model(
        config, str(tiny_llama_dir), dtype=torch.float32, device=cpu, load_format="auto", seed=0
    )
    passes = [
        ("skinny_silu_mul", fuse_skinny_silu_mul),
        ("skinny_add_rms_norm", fuse_skinny_add_rms_norm),
    ]
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
    assert forward.stats.pass_matches == {
        "skinny_silu_mul": layers,
        "skinny_add_rms_norm": 2 * layers,
    }
    assert forward.stats.num_traces == 1


def test_norm_linear_pass_on_tiny_llama_forward(tiny_llama_dir, monkeypatch):
    """skinny_norm_linear after skinny_silu_mul: every residual add + RMSNorm feeding a skinny
    GEMM becomes one op: qkv_proj of layers 1.. (layer 0's input norm has no residual) and every
    gate_up (the gated form); the final norm stays (the CPU's LM head is F.linear). Bit-identical
    on the CPU, where the op runs the norm and F.linear."""
    monkeypatch.setattr(
        UnquantizedLinearMethod,
        "apply",
        lambda self, layer, x, bias: skinny_linear_op.skinny_linear(x, layer.weight, bias),
    )
    config = load_hf_config(str(tiny_llama_dir))
    cpu = torch.device("cpu")
    model = get_model(
        config, str(tiny_llama_dir), dtype=torch.float32, device=cpu, load_format="auto", seed=0
    )
    graphs: list[torch.fx.GraphModule] = []
    passes = [
        ("skinny_silu_mul", fuse_skinny_silu_mul),
        ("skinny_norm_linear", fuse_skinny_norm_linear),
        ("record", graphs.append),
    ]
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
    assert forward.stats.pass_matches["skinny_norm_linear"] == 2 * layers - 1
    gated = sum(
        1
        for node in graphs[0].graph.nodes
        if _count_one(node, "skinny_add_norm_linear") and node.args[5] is True
    )
    assert gated == layers
    assert (
        _count(graphs[0], "skinny_add_norm_linear")
        == forward.stats.pass_matches["skinny_norm_linear"]
    )
    assert _count(graphs[0], "fused_add_rms_norm") == 1  # the final norm
    assert _count(graphs[0], "skinny_linear_silu_mul") == 0


def test_skinny_add_norm_linear_passes_opcheck():
    x, residual = torch.randn(3, 64), torch.randn(3, 64)
    norm_w, w = torch.randn(64), torch.randn(32, 64)
    for gated in (False, True):
        torch.library.opcheck(
            torch.ops.v1_engine.skinny_add_norm_linear.default,
            (x, residual, norm_w, 1e-5, w, gated),
        )


def _count_one(node: torch.fx.Node, name: str) -> bool:
    return node.op == "call_function" and str(node.target).split(".")[1:2] == [name]


# ---- on the GPU: the Llama-3-8B widths, where the skinny kernels and their epilogues run -------

_UNFUSED_SKINNY = ["add_rms_norm", "silu_and_mul", "rms_norm_fp8_quant", "silu_and_mul_fp8_quant"]


@pytest.mark.gpu
def test_epilogues_in_the_engine_match_unfused_gpu(tmp_path, default_tokenizer):
    """A 2-layer model of Llama-3-8B's widths at -O2 with every pass but fused_mlp and
    skinny_norm_linear (the opt-in norm epilogue too; the norm fold would take the norms first)
    against the same engine without the skinny passes: each decoder layer's gate_up + SiLU and
    both residual norms fused, and the same greedy tokens with the same logprobs for a batch of 3
    (norm epilogue at 3 rows, prefill and decode) and alone (1 row)."""
    from engine_ab import assert_same_greedy, greedy_runs, llama8b_widths_dir

    model_dir = llama8b_widths_dir(tmp_path, default_tokenizer)
    passes = [p for p in FUSION_PASSES if p not in ("fused_mlp", "skinny_norm_linear")]
    (fused, fused_counts), (plain, plain_counts) = greedy_runs(model_dir, [passes, _UNFUSED_SKINNY])
    names = ("skinny_silu_mul", "skinny_add_rms_norm")
    assert {k: fused_counts.get(k) for k in names} == {names[0]: 2, names[1]: 4}
    assert {k: plain_counts.get(k) for k in names} == {names[0]: None, names[1]: None}
    assert_same_greedy(fused, plain)


@pytest.mark.gpu
def test_norm_linear_in_the_engine_follows_the_unfused_gpu(
    tmp_path, default_tokenizer, monkeypatch
):
    """A 2-layer model of Llama-3-8B's widths at -O2 with skinny_norm_linear on top of the
    default passes and the folded kernel on for every decode M bucket the table has launches
    for: layer 1's qkv_proj and both gate_ups fold their norm (layer 0's input norm has no
    residual), the kernel runs, and the greedy tokens and logprobs follow the engine without
    the pass."""
    from engine_ab import assert_same_greedy, greedy_runs, llama8b_widths_dir

    from v1_engine.config import CompilationConfig
    from v1_engine.kernels import skinny_epilogues

    calls = []
    real = skinny_epilogues.skinny_gemm_add_norm
    monkeypatch.setattr(
        skinny_epilogues,
        "skinny_gemm_add_norm",
        lambda *a, **kw: calls.append(a[0].shape[0]) or real(*a, **kw),
    )
    monkeypatch.setattr(skinny_epilogues, "NORM_IN_M_BUCKETS", (1, 2, 4, 8, 16, 32, 64))
    model_dir = llama8b_widths_dir(tmp_path, default_tokenizer)
    default = CompilationConfig().effective_fusion_passes("cuda")
    (fused, counts), (plain, _) = greedy_runs(
        model_dir, [default + ["skinny_norm_linear"], default]
    )
    assert counts["skinny_norm_linear"] == 3
    assert calls and min(calls) <= 4  # captured into the decode graphs (replays call nothing)
    assert_same_greedy(fused, plain)
