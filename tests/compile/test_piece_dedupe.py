"""Structurally identical pieces are compiled once: the middle decoder layers of a model share one
Inductor callable (their weights are graph inputs), each piece keeps its own wrapper, outputs stay
per-layer correct, and pieces that differ in a constant, a shape or a dtype never share."""

from __future__ import annotations

import itertools
import operator

import pytest
import torch
from torch import fx, nn
from transformers import AutoConfig

from compile.backend import PiecewiseBackend, piece_key
from compile.compiled_forward import CompiledForward
from compile.cuda_graphs import GraphedPiece
from v1_engine.attention.selector import get_attn_backend
from v1_engine.forward_context import set_forward_context
from v1_engine.models.loader import get_model

NUM_LAYERS = 4


@pytest.fixture(autouse=True)
def fresh_dynamo():
    """Each test traces from a clean Dynamo state (no code cache or dynamic-shape decisions left
    by another model)."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _compiled_pieces(backend: PiecewiseBackend) -> list[nn.Module]:
    """The compiled pieces of the split module, in execution order."""
    split = backend.split_module
    assert split is not None
    children = sorted(split.named_children(), key=lambda kv: int(kv[0].removeprefix("submod_")))
    return [module for _, module in children if hasattr(module, "compiled")]


# ---- the key ------------------------------------------------------------------------------------


def _norm_graph(eps: float, names: tuple[str, str] = ("x", "weight")) -> fx.GraphModule:
    """RMSNorm as a hand-built FX graph, so names and constants are under the test's control."""
    graph = fx.Graph()
    x, weight = graph.placeholder(names[0]), graph.placeholder(names[1])
    square = graph.call_method("pow", (x, 2))
    mean = graph.call_method("mean", (square, -1), {"keepdim": True})
    scale = graph.call_function(torch.rsqrt, (graph.call_function(operator.add, (mean, eps)),))
    normed = graph.call_function(operator.mul, (x, scale))
    graph.output(graph.call_function(operator.mul, (normed, weight)))
    return fx.GraphModule(nn.Module(), graph)


def _args(dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
    return [torch.randn(3, 8, dtype=dtype), torch.randn(8, dtype=dtype)]


def test_key_ignores_placeholder_names():
    layer_1, layer_7 = _norm_graph(1e-5), _norm_graph(1e-5, ("hidden_7", "layers_7_norm_weight"))
    assert layer_1.code != layer_7.code
    key = piece_key(layer_1, _args())
    assert key is not None and len(key) == 64
    assert key == piece_key(layer_7, _args())


def test_key_sees_constants_dtypes_shapes_strides_and_aliasing():
    key = piece_key(_norm_graph(1e-5), _args())
    assert key != piece_key(_norm_graph(1e-6), _args())
    assert key != piece_key(_norm_graph(1e-5), _args(torch.bfloat16))
    assert key != piece_key(_norm_graph(1e-5), [torch.randn(3, 16), torch.randn(16)])
    transposed = torch.randn(8, 3).t()
    assert key != piece_key(_norm_graph(1e-5), [transposed, torch.randn(8)])
    shared = torch.randn(16)
    apart = piece_key(_norm_graph(1e-5), [torch.randn(8), torch.randn(8)])
    aliased = piece_key(_norm_graph(1e-5), [shared[:8], shared[8:]])
    same = piece_key(_norm_graph(1e-5), [shared[:8], shared[:8]])
    assert len({apart, aliased, same}) == 3


def test_key_refuses_what_it_cannot_describe():
    with_constant = _norm_graph(1e-5)
    with_constant.register_buffer("scale", torch.ones(8))
    graph = with_constant.graph
    output = next(iter(graph.find_nodes(op="output")))
    with graph.inserting_before(output):
        scaled = graph.call_function(operator.mul, (output.args[0], graph.get_attr("scale")))
    output.args = (scaled,)
    with_constant.recompile()
    assert piece_key(with_constant, _args()) is None

    factor = 2.0
    with_closure = _norm_graph(1e-5)
    output = next(iter(with_closure.graph.find_nodes(op="output")))
    with with_closure.graph.inserting_before(output):
        doubled = with_closure.graph.call_function(lambda t: t * factor, (output.args[0],))
    output.args = (doubled,)
    with_closure.recompile()
    assert piece_key(with_closure, _args()) is None

    assert piece_key(_norm_graph(1e-5), [*_args(), object()]) is None


# ---- a toy model split at relu: pieces that differ must not share --------------------------------


class _Layer(nn.Module):
    def __init__(self, d_in: int, d_out: int, eps: float) -> None:
        super().__init__()
        self.proj = nn.Linear(d_in, d_out, bias=False)
        self.weight = nn.Parameter(1.0 + 0.3 * torch.randn(d_out))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.proj(x)
        return h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class _Stack(nn.Module):
    """Layers with aten relu between them: the backend splits at it like at attention."""

    def __init__(self, shapes: list[tuple[int, int, float]]) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList(_Layer(*shape) for shape in shapes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for index, layer in enumerate(self.layers):
            if index:
                x = torch.ops.aten.relu.default(x)
            x = layer(x)
        return x


def _compile_stack(shapes, cudagraphs: bool = False):
    model = _Stack(shapes).eval()
    backend = PiecewiseBackend(splitting_ops=("aten::relu",), cudagraphs=cudagraphs)
    return model, backend, torch.compile(model, backend=backend, fullgraph=True)


@pytest.mark.parametrize(
    ("shapes", "groups"),
    [
        # a different eps (4.0 changes every output) splits the third layer off
        ([(8, 8, 1e-5), (8, 8, 1e-5), (8, 8, 4.0), (8, 8, 1e-5)], [0, 0, 1, 0]),
        # different widths: only the first two layers are the same graph on the same shapes
        ([(8, 8, 1e-5), (8, 8, 1e-5), (8, 16, 1e-5), (16, 16, 1e-5)], [0, 0, 1, 2]),
    ],
)
def test_structurally_different_pieces_do_not_share(shapes, groups):
    """Pieces share a compiled callable exactly when they are in the same group."""
    model, backend, compiled = _compile_stack(shapes)
    x = torch.randn(5, 8)
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), model(x), rtol=1e-5, atol=1e-5)
    assert backend.stats.num_pieces == len(shapes)
    assert backend.stats.num_compiled == len(set(groups))
    callables = [piece.compiled for piece in _compiled_pieces(backend)]
    for a, b in itertools.combinations(range(len(shapes)), 2):
        assert (callables[a] is callables[b]) == (groups[a] == groups[b]), (a, b)


def test_each_piece_keeps_its_own_graph_wrapper(monkeypatch):
    """With piecewise CUDA graphs on, twins share the compiled callable but not the GraphedPiece
    (it holds the piece's captured graphs). Inductor is stubbed: this checks the wiring only."""
    compiled_graphs: list[fx.GraphModule] = []

    def fake_compile_fx(gm: fx.GraphModule, example_inputs: list) -> fx.GraphModule:
        compiled_graphs.append(gm)
        return gm

    monkeypatch.setattr("torch._inductor.compile_fx.compile_fx", fake_compile_fx)
    model, backend, compiled = _compile_stack([(8, 8, 1e-5)] * 4, cudagraphs=True)
    x = torch.randn(3, 8)
    with torch.no_grad():
        assert torch.equal(compiled(x), model(x))
    wrappers = [piece.compiled for piece in _compiled_pieces(backend)]
    assert all(isinstance(w, GraphedPiece) for w in wrappers)
    assert len({id(w) for w in wrappers}) == 4
    assert len({id(w.compiled) for w in wrappers}) == 1
    assert backend.stats.num_compiled == len(compiled_graphs) == 1


# ---- a random-weight Llama: first, middle and last pieces ---------------------------------------


@pytest.fixture(scope="module")
def llama() -> nn.Module:
    """A 4-layer Llama with different random weights in every layer (the dummy load format seeds
    each tensor alike, which would hide a piece computing with another layer's weights)."""
    config = AutoConfig.for_model(
        "llama",
        architectures=["LlamaForCausalLM"],
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=NUM_LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=False,
    )
    cpu = torch.device("cpu")
    model = get_model(config, None, dtype=torch.float32, device=cpu, load_format="dummy", seed=0)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in model.parameters():
            noise = 0.2 * torch.randn(param.shape, generator=generator)
            param.copy_(noise + 1.0 if param.dim() == 1 else noise)
    return model


def _forward_both(forward: CompiledForward, model: nn.Module, num_tokens: int):
    input_ids = torch.randint(0, 128, (num_tokens,), generator=torch.Generator().manual_seed(1))
    positions = torch.arange(num_tokens)
    return forward(input_ids, positions), model(input_ids, positions)


def test_llama_middle_layers_compile_once_and_stay_per_layer_correct(llama):
    layers = llama.model.layers
    assert not torch.equal(layers[1].mlp.down_proj.weight, layers[2].mlp.down_proj.weight)
    forward = CompiledForward(llama)
    with (
        torch.inference_mode(),
        set_forward_context(None, get_attn_backend(torch.device("cpu")), llama.attention_layers()),
    ):
        for num_tokens in (5, 1, 9):
            torch.testing.assert_close(*_forward_both(forward, llama, num_tokens))
        # Weights changed after compiling reach the shared code: nothing of them is baked in.
        before, _ = _forward_both(forward, llama, 6)
        layers[2].mlp.down_proj.weight.mul_(-1.5)
        after, eager = _forward_both(forward, llama, 6)
        assert not torch.allclose(before, after)
        torch.testing.assert_close(after, eager)
    stats = forward.stats
    assert stats.num_traces == 1
    assert stats.num_pieces == NUM_LAYERS + 1
    assert stats.num_compiled == 3
    callables = [piece.compiled for piece in _compiled_pieces(forward.backend)]
    middle = callables[1:-1]
    assert all(c is middle[0] for c in middle)
    assert callables[0] is not middle[0] and callables[-1] is not middle[0]


# ---- on the GPU: shared callables under piecewise CUDA graphs -----------------------------------


@pytest.fixture(scope="module")
def four_layer_llama_dir(tmp_path_factory, default_tokenizer):
    """The tiny test Llama with NUM_LAYERS layers, each with its own random weights."""
    from hf_reference import TINY_CONFIGS
    from transformers import AutoModelForCausalLM

    spec = dict(TINY_CONFIGS["llama"])
    config = AutoConfig.for_model(
        spec.pop("model_type"),
        vocab_size=len(default_tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=NUM_LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        bos_token_id=default_tokenizer.bos_token_id,
        eos_token_id=default_tokenizer.eos_token_id,
        **spec,
    )
    torch.manual_seed(1234)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0.0, 0.2)
    path = tmp_path_factory.mktemp("four-layer-llama")
    model.save_pretrained(path)
    default_tokenizer.save_pretrained(path)
    return path


@pytest.mark.gpu
def test_gpu_piecewise_graphs_of_shared_pieces_equal_eager(four_layer_llama_dir):
    """Twins replay their own captured graphs around one compiled callable: greedy tokens equal
    eager's for prefills and decodes that replay piecewise graphs."""
    from v1_engine import LLM, SamplingParams

    prompts = ["The capital of France is", "def fibonacci(n):", "Once upon a time, a"]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    kwargs = {"dtype": "float32", "max_model_len": 128, "num_kv_blocks": 128}

    def greedy(llm: LLM) -> list[list[int]]:
        return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]

    eager = greedy(LLM(str(four_layer_llama_dir), enforce_eager=True, **kwargs))
    torch.cuda.empty_cache()
    config = {"level": 1, "cudagraph_capture_sizes": [2, 8, 32], "piecewise_cudagraphs": True}
    llm = LLM(str(four_layer_llama_dir), compilation_config=config, **kwargs)
    runner = llm.engine_core.model_runner
    piecewise = runner.graphs.piecewise
    assert piecewise is not None
    before = piecewise.num_replays
    assert greedy(llm) == eager
    assert piecewise.num_replays - before >= 15, "steps did not replay piecewise graphs"
    stats = runner._forward.stats
    assert stats.num_pieces == NUM_LAYERS + 1 and stats.num_compiled == 3
    wrappers = [piece.compiled for piece in _compiled_pieces(runner._forward.backend)]
    middle = wrappers[1:-1]
    assert all(isinstance(w, GraphedPiece) and w.compiled is middle[0].compiled for w in middle)
    graphs = [w.graphs[piecewise.sizes[-1]].graph for w in middle]
    assert len({id(g) for g in graphs}) == len(middle), "twins must capture their own graphs"
