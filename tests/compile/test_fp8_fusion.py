"""FP8 activation-quant fusions: the passes fold the per-token (and per-group) quant of an FP8
linear's input into the RMSNorm / SiLU-and-mul before it, and the FP8 decode passes drop it.

On the CPU the fused ops run the unfused chain itself, so a fused forward is bit-identical to the
unfused one. The fused kernels against their references: tests/kernels/test_triton_fused_quant.py.
"""

from __future__ import annotations

import pytest
import torch
from fp8_values import activations, norm_weight

from compile.compiled_forward import CompiledForward
from compile.passes import (
    FUSION_PASSES,
    fuse_rms_norm_fp8_quant,
    fuse_silu_and_mul_fp8_quant,
)
from compile.passes import fused_quant_ops as ops
from v1_engine.attention.selector import get_attn_backend
from v1_engine.config import CompilationConfig
from v1_engine.forward_context import set_forward_context
from v1_engine.kernels import fp8
from v1_engine.layers.activation import SiluAndMul
from v1_engine.layers.norm import RMSNorm
from v1_engine.models.loader import get_model, load_hf_config


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


# ---- the passes on the traced FP8 Llama forward ---------------------------------------------


def tiny_fp8_llama(config, path) -> torch.nn.Module:
    """The tiny Llama in float32 on the CPU, its linears quantized online to FP8."""
    cpu = torch.device("cpu")
    return get_model(
        config, str(path), dtype=torch.float32, device=cpu, load_format="auto", seed=0,
        quantization="fp8",
    )  # fmt: skip


def _count_ops(gm: torch.fx.GraphModule) -> dict[str, int]:
    counts: dict[str, int] = {}
    for node in gm.graph.nodes:
        if node.op == "call_function" and "v1_engine" in str(node.target):
            name = str(node.target).split(".")[1]
            counts[name] = counts.get(name, 0) + 1
    return counts


@pytest.mark.parametrize(
    "names",
    [
        ["add_rms_norm", "silu_and_mul", "rms_norm_fp8_quant", "silu_and_mul_fp8_quant"],
        ["rms_norm_fp8_quant", "silu_and_mul_fp8_quant"],  # the base passes are implied
    ],
)
def test_fp8_passes_on_tiny_llama_forward(tiny_llama_dir, names):
    """Per layer, both norms feed an FP8 linear (qkv, gate_up) and the SiLU-and-mul feeds
    down_proj: 2 norm and 1 SiLU fusions per layer. The final norm feeds the unquantized lm_head
    and stays a plain fused norm; o_proj's quant (after attention) stays alone. Logits are
    bit-identical to the unfused compiled forward for every batch size."""
    config = load_hf_config(str(tiny_llama_dir))
    CompilationConfig(fusion_passes=names).verify()
    cpu = torch.device("cpu")
    model = tiny_fp8_llama(config, tiny_llama_dir)
    base = [(name, FUSION_PASSES[name]) for name in ("add_rms_norm", "silu_and_mul")]
    graphs: list[torch.fx.GraphModule] = []
    passes = [(name, FUSION_PASSES[name]) for name in names] + [("record", graphs.append)]
    layers = config.num_hidden_layers
    batches = [torch.randint(0, config.vocab_size, (n,)) for n in (4, 1, 9)]
    with (
        torch.inference_mode(),
        set_forward_context(None, get_attn_backend(cpu), model.attention_layers()),
    ):
        unfused = CompiledForward(model, passes=base, use_inductor=False)
        expected = [unfused(ids, torch.arange(len(ids))) for ids in batches]
        torch._dynamo.reset()  # Dynamo's cache is per code object: the next trace starts clean
        fused = CompiledForward(model, passes=passes, use_inductor=False)
        for ids, want in zip(batches, expected, strict=True):
            assert torch.equal(fused(ids, torch.arange(len(ids))), want)
            assert torch.equal(want, model(ids, torch.arange(len(ids))))
    matches = fused.stats.pass_matches
    assert matches["rms_norm_fp8_quant"] == 2 * layers
    assert matches["silu_and_mul_fp8_quant"] == layers
    assert fused.stats.num_traces == 1
    counts = _count_ops(graphs[0])
    assert counts["rms_norm_per_token_fp8_quant"] == 1  # layer 0's input norm: no residual
    assert counts["add_rms_norm_per_token_fp8_quant"] == 2 * layers - 1
    assert counts["silu_and_mul_per_token_fp8_quant"] == layers
    assert counts["per_token_fp8_quant"] == layers  # o_proj
    assert counts["fused_add_rms_norm"] == 1  # the final norm
    assert "silu_and_mul" not in counts


def test_fp8_decode_passes_on_tiny_llama_forward(tiny_llama_dir):
    """The FP8 decode passes after the quant fusions: per layer o_proj's lone quant + GEMM
    becomes one fp8_dynamic_linear and gate_up -> SiLU-and-mul + quant -> down one fp8_gated_mlp
    (through the float32 model's bf16 -> float32 cast); no activation quant is left outside a
    norm. On the CPU the ops run the quantized chain: logits bit-identical to the forward
    without the decode passes."""
    config = load_hf_config(str(tiny_llama_dir))
    cpu = torch.device("cpu")
    model = tiny_fp8_llama(config, tiny_llama_dir)
    quant_names = ("rms_norm_fp8_quant", "silu_and_mul_fp8_quant")
    base = [(name, FUSION_PASSES[name]) for name in quant_names]
    graphs: list[torch.fx.GraphModule] = []
    decode = [(name, FUSION_PASSES[name]) for name in ("fp8_gated_mlp", "fp8_dynamic_linear")]
    batches = [torch.randint(0, config.vocab_size, (n,)) for n in (4, 1, 9)]
    with (
        torch.inference_mode(),
        set_forward_context(None, get_attn_backend(cpu), model.attention_layers()),
    ):
        plain = CompiledForward(model, passes=base, use_inductor=False)
        expected = [plain(ids, torch.arange(len(ids))) for ids in batches]
        torch._dynamo.reset()
        fused = CompiledForward(
            model, passes=decode + [("record", graphs.append)], use_inductor=False
        )
        for ids, want in zip(batches, expected, strict=True):
            assert torch.equal(fused(ids, torch.arange(len(ids))), want)
    layers = config.num_hidden_layers
    matches = fused.stats.pass_matches
    assert (matches["fp8_gated_mlp"], matches["fp8_dynamic_linear"]) == (layers, layers)
    counts = _count_ops(graphs[0])
    assert counts["fp8_gated_mlp"] == layers and counts["fp8_dynamic_linear"] == layers
    assert counts["scaled_mm"] == layers  # qkv alone
    assert "per_token_fp8_quant" not in counts
    assert "silu_and_mul_per_token_fp8_quant" not in counts
    assert counts["add_rms_norm_per_token_fp8_quant"] == 2 * layers - 1


@pytest.mark.parametrize("with_gated_mlp", [True, False])
def test_fp8_norm_linear_pass_on_tiny_llama_forward(tiny_llama_dir, with_gated_mlp):
    """fp8_norm_linear after the quant fusions: every add + RMSNorm + quant feeding qkv (all but
    layer 0's, which has no residual) becomes an fp8_add_norm_linear; the post-attention ones
    become fp8_add_norm_gated_mlp where fp8_gated_mlp ran first, else fp8_add_norm_linear of
    gate_up. The final norm (unquantized lm_head) stays. On the CPU the ops run the quantized
    chain: logits bit-identical to the forward without the pass."""
    config = load_hf_config(str(tiny_llama_dir))
    cpu = torch.device("cpu")
    model = tiny_fp8_llama(config, tiny_llama_dir)
    quant_names = ("rms_norm_fp8_quant", "silu_and_mul_fp8_quant")
    names = quant_names + (("fp8_gated_mlp",) if with_gated_mlp else ()) + ("fp8_norm_linear",)
    CompilationConfig(fusion_passes=list(names)).verify()
    graphs: list[torch.fx.GraphModule] = []
    batches = [torch.randint(0, config.vocab_size, (n,)) for n in (4, 1, 9)]
    with (
        torch.inference_mode(),
        set_forward_context(None, get_attn_backend(cpu), model.attention_layers()),
    ):
        plain = CompiledForward(
            model, passes=[(n, FUSION_PASSES[n]) for n in quant_names], use_inductor=False
        )
        expected = [plain(ids, torch.arange(len(ids))) for ids in batches]
        torch._dynamo.reset()
        passes = [(n, FUSION_PASSES[n]) for n in names] + [("record", graphs.append)]
        fused = CompiledForward(model, passes=passes, use_inductor=False)
        for ids, want in zip(batches, expected, strict=True):
            assert torch.equal(fused(ids, torch.arange(len(ids))), want)
    layers = config.num_hidden_layers
    assert fused.stats.pass_matches["fp8_norm_linear"] == 2 * layers - 1
    counts = _count_ops(graphs[0])
    assert "add_rms_norm_per_token_fp8_quant" not in counts
    assert counts["rms_norm_per_token_fp8_quant"] == 1  # layer 0's input norm
    assert counts["fused_add_rms_norm"] == 1  # the final norm
    if with_gated_mlp:
        assert counts["fp8_add_norm_gated_mlp"] == layers
        assert counts["fp8_add_norm_linear"] == layers - 1
        assert counts["scaled_mm"] == layers + 1  # layer 0's qkv, every o_proj
    else:
        assert counts["fp8_add_norm_linear"] == 2 * layers - 1
        assert counts["silu_and_mul_per_token_fp8_quant"] == layers


def test_fp8_norm_linear_pass_leaves_what_it_cannot_take():
    """A norm whose quantized output is read twice keeps its chain, and so does one whose
    residual sum is read before the GEMM (the fused op would come after that reader)."""
    from compile.passes import fused_quant_ops as quant_ops

    class Sublayers(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w, self.s = fp8.per_token_fp8_quant_ref(torch.randn(32, 32) * 0.1)
            self.norm_w = (torch.randn(32) * 0.1 + 1.0).to(torch.bfloat16)

        def forward(self, x, r):
            q, s, summed = quant_ops.add_rms_norm_per_token_fp8_quant(x, r, self.norm_w, 1e-5)
            a = fp8.scaled_mm(q, self.w, s, self.s, torch.bfloat16)
            q2, s2, summed2 = quant_ops.add_rms_norm_per_token_fp8_quant(x, a, self.norm_w, 1e-5)
            early = summed2 * 2.0  # the residual sum read before its GEMM
            b = fp8.scaled_mm(q2, self.w, s2, self.s, torch.bfloat16)
            return q.float().sum(), summed, early, b

    module = Sublayers()
    x, r = (torch.randn(3, 32).to(torch.bfloat16) for _ in range(2))
    compiled, counts, graphs = _compile_with_passes(module, FUSION_PASSES["fp8_norm_linear"])
    with torch.no_grad():
        got, want = compiled(x, r), module(x, r)
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g, w)
    assert counts == [(0,)]
    assert _count_ops(graphs[0])["add_rms_norm_per_token_fp8_quant"] == 2


def test_fp8_decode_passes_leave_what_they_cannot_take():
    """A quant whose q escapes stays with its GEMM, and a gate_up GEMM read twice keeps its
    chain (its lone input quant becomes an fp8_dynamic_linear), as does a biased down GEMM."""

    class Sublayers(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w_o, self.s_o = fp8.per_token_fp8_quant_ref(torch.randn(16, 32) * 0.1)
            self.w_gu, self.s_gu = fp8.per_token_fp8_quant_ref(torch.randn(64, 32) * 0.1)
            self.w_d, self.s_d = fp8.per_token_fp8_quant_ref(torch.randn(32, 32) * 0.1)
            self.bias = torch.randn(32).to(torch.bfloat16)

        def forward(self, x: torch.Tensor, h: torch.Tensor):
            q, s = fp8.per_token_fp8_quant(x)
            o = fp8.scaled_mm(q, self.w_o, s, self.s_o, torch.bfloat16)
            q2, s2 = fp8.per_token_fp8_quant(h)
            gate_up = fp8.scaled_mm(q2, self.w_gu, s2, self.s_gu, torch.bfloat16)
            qa, sa = ops.silu_and_mul_per_token_fp8_quant(gate_up)
            down = fp8.scaled_mm(qa, self.w_d, sa, self.s_d, torch.bfloat16, self.bias)
            return o, q.float().sum(), down, gate_up.sum()

    module = Sublayers()
    x, h = torch.randn(3, 32), torch.randn(3, 32)
    compiled, _, graphs = _compile_with_passes(
        module, FUSION_PASSES["fp8_gated_mlp"], FUSION_PASSES["fp8_dynamic_linear"]
    )
    with torch.no_grad():
        got, want = compiled(x, h), module(x, h)
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g, w)
    counts = _count_ops(graphs[0])
    assert counts["fp8_dynamic_linear"] == 1 and "fp8_gated_mlp" not in counts
    assert counts["scaled_mm"] == 2 and counts["per_token_fp8_quant"] == 1


@pytest.mark.slow
def test_fp8_passes_under_inductor_keep_the_tiny_llama_forward(tiny_llama_dir):
    """The fused ops' fake impls let Inductor compile the pieces around them; on the CPU the
    result still equals the eager model exactly."""
    config = load_hf_config(str(tiny_llama_dir))
    cpu = torch.device("cpu")
    model = tiny_fp8_llama(config, tiny_llama_dir)
    names = ("rms_norm_fp8_quant", "silu_and_mul_fp8_quant")
    forward = CompiledForward(model, passes=[(n, FUSION_PASSES[n]) for n in names])
    with (
        torch.inference_mode(),
        set_forward_context(None, get_attn_backend(cpu), model.attention_layers()),
    ):
        for num_tokens in (5, 1):
            ids = torch.randint(0, config.vocab_size, (num_tokens,))
            positions = torch.arange(num_tokens)
            assert torch.equal(forward(ids, positions), model(ids, positions))
    layers = config.num_hidden_layers
    assert forward.stats.pass_matches == {
        "rms_norm_fp8_quant": 2 * layers,
        "silu_and_mul_fp8_quant": layers,
    }


# ---- the passes on small modules: block quant, escapes ------------------------------------------


class _BlockFp8Sublayers(torch.nn.Module):
    """A plain norm, a residual norm and a SiLU-and-mul, each feeding the group quant of a
    block-scaled FP8 linear the way Fp8BlockLinearMethod calls it."""

    def __init__(self, hidden: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.norm = RMSNorm(hidden, eps=1e-5).to(dtype)
        self.post_norm = RMSNorm(hidden, eps=1e-5).to(dtype)
        self.act = SiluAndMul()
        torch.nn.init.normal_(self.norm.weight, 1.0, 0.2)
        torch.nn.init.normal_(self.post_norm.weight, 1.0, 0.2)

    @staticmethod
    def quantized(x: torch.Tensor) -> torch.Tensor:
        q, scales = fp8.per_token_group_fp8_quant(x.reshape(-1, x.shape[-1]), 128)
        return q.float() * scales.repeat_interleave(128, -1)

    def forward(self, x: torch.Tensor, residual: torch.Tensor):
        a = self.quantized(self.norm(x))
        normed, summed = self.post_norm(a.to(x.dtype), residual)
        b = self.quantized(normed)
        c = self.quantized(self.act(torch.cat([x, summed], dim=-1)))
        return a, b, c, summed


def _compile_with_passes(module, *graph_passes):
    counts: list[tuple[int, ...]] = []
    graphs: list[torch.fx.GraphModule] = []

    def backend(gm, example_inputs):
        counts.append(tuple(graph_pass(gm) for graph_pass in graph_passes))
        graphs.append(gm)
        return gm

    return torch.compile(module, backend=backend, fullgraph=True), counts, graphs


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_group_quant_fusions_keep_results(dtype):
    torch.manual_seed(0)
    module = _BlockFp8Sublayers(256, dtype)
    x, residual = activations((5, 256), dtype, 1), activations((5, 256), dtype, 2)
    compiled, counts, graphs = _compile_with_passes(
        module, fuse_rms_norm_fp8_quant, fuse_silu_and_mul_fp8_quant
    )
    for got, want in zip(compiled(x, residual), module(x, residual), strict=True):
        assert torch.equal(got, want)
    assert counts == [(2, 1)]
    found = _count_ops(graphs[0])
    assert found["rms_norm_per_token_group_fp8_quant"] == 1
    assert found["add_rms_norm_per_token_group_fp8_quant"] == 1
    assert found["silu_and_mul_per_token_group_fp8_quant"] == 1
    assert "per_token_group_fp8_quant" not in found


class _NormEscapes(torch.nn.Module):
    """The norm output is quantized and also returned: the fusion would lose it."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.norm = RMSNorm(hidden)
        self.act = SiluAndMul()

    def forward(self, x: torch.Tensor, residual: torch.Tensor):
        normed, summed = self.norm(x, residual)
        q, scales = fp8.per_token_fp8_quant(normed)
        activated = self.act(summed)
        q2, scales2 = fp8.per_token_fp8_quant(activated)
        return q.float() * scales, normed, q2.float() * scales2, activated


def test_passes_skip_when_the_unquantized_output_escapes():
    module = _NormEscapes(32)
    torch.nn.init.ones_(module.norm.weight)
    x, residual = torch.randn(3, 32), torch.randn(3, 32)
    compiled, counts, _ = _compile_with_passes(
        module, fuse_rms_norm_fp8_quant, fuse_silu_and_mul_fp8_quant
    )
    for got, want in zip(compiled(x, residual), module(x, residual), strict=True):
        assert torch.equal(got, want)
    assert counts == [(0, 0)]


def test_fused_ops_pass_opcheck():
    x, residual = activations((4, 256), torch.bfloat16, 3), activations((4, 256), torch.bfloat16, 4)
    w = norm_weight(256, torch.bfloat16, 5)
    v = torch.ops.v1_engine
    for op, args in (
        (v.rms_norm_per_token_fp8_quant, (x, w, 1e-6)),
        (v.add_rms_norm_per_token_fp8_quant, (x, residual, w, 1e-6)),
        (v.silu_and_mul_per_token_fp8_quant, (x,)),
        (v.rms_norm_per_token_group_fp8_quant, (x, w, 1e-6, 128)),
        (v.add_rms_norm_per_token_group_fp8_quant, (x, residual, w, 1e-6, 128)),
        (v.silu_and_mul_per_token_group_fp8_quant, (x, 64)),
    ):
        torch.library.opcheck(op.default, args)


def test_fp8_decode_ops_pass_opcheck():
    x = activations((3, 256), torch.bfloat16, 6)
    q, scale = fp8.per_token_fp8_quant_ref(x)
    w_o, s_o = fp8.per_token_fp8_quant_ref(activations((64, 256), torch.float32, 7) * 0.1)
    w_gu, s_gu = fp8.per_token_fp8_quant_ref(activations((128, 256), torch.float32, 8) * 0.1)
    w_d, s_d = fp8.per_token_fp8_quant_ref(activations((32, 64), torch.float32, 9) * 0.1)
    bias = activations((64,), torch.bfloat16, 10)
    bf16 = torch.bfloat16
    v = torch.ops.v1_engine
    # opcheck's schema test perturbs the inputs arithmetically, which e4m3 tensors do not support.
    utils = ("test_faketensor", "test_aot_dispatch_dynamic")
    torch.library.opcheck(v.fp8_dynamic_linear.default, (x, w_o, s_o, bf16, bias), test_utils=utils)
    torch.library.opcheck(
        v.fp8_gated_mlp.default, (q, scale, w_gu, s_gu, w_d, s_d, bf16, bf16), test_utils=utils
    )
