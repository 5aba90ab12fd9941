"""The `fused_mlp` pass: a decoder layer's gate_up GEMM, SiLU-and-mul, down GEMM and the residual
add + RMSNorm after it become `v1_engine::fused_mlp_add_rms_norm` (compile/passes/fusion.py).
On the CPU the op runs its reference (the unfused ops' references in a row), so the rewritten
graph must give bit-identical results; the kernel behind it on CUDA is tested in
tests/kernels/test_triton_mlp.py."""

from __future__ import annotations

import pytest
import torch

from compile.compiled_forward import CompiledForward
from compile.passes import fuse_mlp, fuse_skinny_silu_mul
from v1_engine.attention.selector import get_attn_backend
from v1_engine.config import FUSION_PASSES, CompilationConfig
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


def _count(gm: torch.fx.GraphModule, name: str) -> int:
    targets = [str(n.target) for n in gm.graph.nodes if n.op == "call_function"]
    return sum(1 for target in targets if target.split(".")[1:2] == [name])


class _Mlp(torch.nn.Module):
    """gate_up -> SiLU-and-mul -> down -> add + RMSNorm; `bias` / `leak` break the pattern."""

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
        if self.leak:
            return normed, summed, act.sum()
        return normed, summed


def _compile_with(module, graph_pass):
    graphs, matches = [], []

    def backend(gm, example_inputs):
        matches.append(graph_pass(gm))
        graphs.append(gm)
        return gm

    return torch.compile(module, backend=backend, fullgraph=True), graphs, matches


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("gated_first", [False, True])
def test_pass_fuses_the_mlp_and_keeps_results(dtype, gated_first):
    # Either form of the gate_up half: the plain GEMM + SiLU-and-mul, or the gated skinny op
    # the skinny_silu_mul pass (before this one in FUSION_PASSES) leaves.
    torch.manual_seed(0)
    module = _Mlp(32, 48).to(dtype)
    x, residual = torch.randn(3, 32, dtype=dtype), torch.randn(3, 32, dtype=dtype)

    def passes(gm):
        if gated_first:
            assert fuse_skinny_silu_mul(gm) == 1
        return fuse_mlp(gm)

    compiled, graphs, matches = _compile_with(module, passes)
    actual = compiled(x, residual)
    assert matches == [1]
    gm = graphs[0]
    assert _count(gm, "fused_mlp_add_rms_norm") == 1
    for name in ("skinny_linear", "silu_and_mul", "skinny_linear_silu_mul", "fused_add_rms_norm"):
        assert _count(gm, name) == 0, name
    expected = module(x, residual)
    assert len(actual) == 2
    for a, b in zip(actual, expected, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize(("bias", "leak"), [(True, False), (False, True)])
def test_pass_leaves_other_uses_alone(bias, leak):
    """A biased down GEMM, or an activation read elsewhere: nothing fused, results unchanged."""
    torch.manual_seed(1)
    module = _Mlp(16, 24, bias=bias, leak=leak)
    x, residual = torch.randn(2, 16), torch.randn(2, 16)
    compiled, graphs, matches = _compile_with(module, fuse_mlp)
    actual = compiled(x, residual)
    assert matches == [0]
    assert _count(graphs[0], "skinny_linear") == 2
    for a, b in zip(actual, module(x, residual), strict=True):
        assert torch.equal(a, b)


def test_pass_is_opt_in_and_runs_after_the_gated_pass():
    # Opt-in: measured slower than the unfused chain (benchmarks/RESULTS.md).
    names = list(FUSION_PASSES)
    assert names.index("skinny_silu_mul") < names.index("fused_mlp")
    assert "fused_mlp" not in CompilationConfig().effective_fusion_passes("cuda")
    assert CompilationConfig(fusion_passes=["fused_mlp"]).effective_fusion_passes("cuda") == [
        "fused_mlp"
    ]


def _tiny_llama_on_skinny_linears(path, monkeypatch) -> tuple:
    """(config, the float32 tiny Llama on the CPU) whose linears call `v1_engine::skinny_linear`
    as on CUDA, so the pass finds the chain it fuses there."""
    monkeypatch.setattr(
        UnquantizedLinearMethod,
        "apply",
        lambda self, layer, x, bias: skinny_linear_op.skinny_linear(x, layer.weight, bias),
    )
    config = load_hf_config(str(path))
    cpu = torch.device("cpu")
    model = get_model(
        config, str(path), dtype=torch.float32, device=cpu, load_format="auto", seed=0
    )
    return config, model


def test_pass_on_tiny_llama_forward(tiny_llama_dir, monkeypatch):
    """Every decoder layer's MLP with the norm after it (the next layer's input norm, the last
    one the final norm) becomes one op; the forward stays bit-identical."""
    config, model = _tiny_llama_on_skinny_linears(tiny_llama_dir, monkeypatch)
    cpu = torch.device("cpu")
    passes = [("skinny_silu_mul", fuse_skinny_silu_mul), ("fused_mlp", fuse_mlp)]
    forward = CompiledForward(model, passes=passes, use_inductor=False)
    with (
        torch.inference_mode(),
        set_forward_context(None, get_attn_backend(cpu), model.attention_layers()),
    ):
        for num_tokens in (4, 1, 9):
            input_ids = torch.randint(0, config.vocab_size, (num_tokens,))
            positions = torch.arange(num_tokens)
            assert torch.equal(forward(input_ids, positions), model(input_ids, positions))
    layers = config.num_hidden_layers
    assert forward.stats.pass_matches == {"skinny_silu_mul": layers, "fused_mlp": layers}


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter runs the kernel on CPU")
@pytest.mark.parametrize("mode1", ["dot_swap", "dot"])
def test_kernel_behind_the_pass_on_tiny_llama_forward_interpreted(
    tiny_llama_dir, monkeypatch, mode1
):
    """The engine GPU test's setup without the GPU: the pass on the real model's graph, and
    each fused op running the Triton kernel (under the interpreter, programs in turn) with the
    forced launch forms of that test, for a prefill of 9 rows and decode rows of 1 and 3. The
    logits follow the model's (float32 sums in another order). If this passes while the engine
    GPU test fails, what breaks is on the device: PDL neighbours, concurrency, graphs."""
    from v1_engine.kernels import triton_mlp

    launch = {"mode1": mode1, "block_n1": 16, "block_k1": 32, "mode2": "dot_swap",
              "block_n2": 16, "block_k2": 32, "split2": 2}  # fmt: skip
    calls = []

    def kernel(x, w_gate_up, w_down, residual, norm_weight, eps):
        calls.append(x.shape[0])
        return triton_mlp.fused_mlp_add_rms_norm(
            x, w_gate_up, w_down, residual, norm_weight, eps, **launch
        )

    def retarget(gm: torch.fx.GraphModule) -> int:
        ops = [
            n
            for n in gm.graph.nodes
            if n.target is torch.ops.v1_engine.fused_mlp_add_rms_norm.default
        ]
        for node in ops:
            node.target = kernel
        gm.recompile()
        return len(ops)

    config, model = _tiny_llama_on_skinny_linears(tiny_llama_dir, monkeypatch)
    cpu = torch.device("cpu")
    passes = [("fused_mlp", fuse_mlp), ("retarget", retarget)]
    forward = CompiledForward(model, passes=passes, use_inductor=False)
    with (
        torch.inference_mode(),
        set_forward_context(None, get_attn_backend(cpu), model.attention_layers()),
    ):
        for num_tokens in (9, 1, 3):
            input_ids = torch.randint(0, config.vocab_size, (num_tokens,))
            positions = torch.arange(num_tokens)
            got, want = forward(input_ids, positions), model(input_ids, positions)
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    layers = config.num_hidden_layers
    assert forward.stats.pass_matches["fused_mlp"] == layers
    assert sorted(set(calls)) == [1, 3, 9] and len(calls) == 3 * layers


@pytest.mark.gpu
def test_fused_mlp_in_the_engine_matches_unfused_gpu(tmp_path, default_tokenizer, monkeypatch):
    """A 2-layer model of Llama-3-8B's widths at -O2 with the fused_mlp pass and a launch for
    every M bucket up to 64 (the kernel runs in the prefill of 60 tokens and in every decode
    graph, captured with it), against the same engine without the pass: both MLPs fused, the
    same greedy tokens with the same logprobs (a flip only as a near-tie: the kernel sums the
    down GEMM over another K split than the chain, see engine_ab.assert_same_greedy)."""
    from engine_ab import assert_same_greedy, greedy_runs, llama8b_widths_dir

    from v1_engine.kernels import triton_mlp

    small = {"mode1": "dot_swap", "block_n1": 64}
    table = {}
    for bucket in (1, 2, 4, 8, 16, 32, 64):
        launch = small if bucket <= 16 else {}
        table[(bucket, 14336, 4096)] = triton_mlp.resolve_launch(bucket, 14336, 4096, 4096, launch)
    monkeypatch.setattr(triton_mlp, "TUNED_LAUNCH", table)
    model_dir = llama8b_widths_dir(tmp_path, default_tokenizer)
    base = CompilationConfig().effective_fusion_passes("cuda")
    (fused, fused_counts), (plain, plain_counts) = greedy_runs(
        model_dir, [[*base, "fused_mlp"], base]
    )
    assert fused_counts.get("fused_mlp") == 2 and "fused_mlp" not in plain_counts
    assert_same_greedy(fused, plain)
