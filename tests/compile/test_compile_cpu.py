"""Level-1 compilation on CPU: same greedy tokens as eager, one trace for every batch size,
the graph split into num_layers + 1 Inductor pieces around the attention ops."""

from __future__ import annotations

import pytest
import torch

from v1_engine import LLM, SamplingParams
from v1_engine.config import CompilationConfig, EngineConfig

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, a"]


def _greedy(llm: LLM, prompts: list[str], max_tokens: int = 16) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return [out.outputs[0].token_ids for out in llm.generate(prompts, params, use_tqdm=False)]


def _compiled_forward(llm: LLM):
    return llm.engine_core.model_runner._forward


@pytest.fixture(scope="module")
def eager_tokens(tiny_llama_dir) -> list[list[int]]:
    llm = LLM(str(tiny_llama_dir), max_model_len=128, num_kv_blocks=64)
    assert llm.engine_core.model_runner._forward is llm.engine_core.model_runner.model
    return _greedy(llm, PROMPTS)


@pytest.fixture(scope="module")
def compiled_llm(tiny_llama_dir) -> LLM:
    return LLM(str(tiny_llama_dir), max_model_len=128, num_kv_blocks=64, compilation_config=1)


def test_compiled_greedy_equals_eager(compiled_llm, eager_tokens):
    assert _greedy(compiled_llm, PROMPTS) == eager_tokens


def test_graph_split_into_layers_plus_one_pieces(compiled_llm):
    stats = _compiled_forward(compiled_llm).stats
    num_layers = compiled_llm.engine_core.model_runner.hf_config.num_hidden_layers
    assert stats.num_splitting_ops == num_layers
    assert stats.num_pieces == num_layers + 1
    assert stats.inductor_s > 0


def test_no_recompile_across_batch_sizes(compiled_llm, eager_tokens):
    """Batches of 1, 2 and 3 requests, prefill chunks and single-token decodes: one trace."""
    for count in (1, 2, 3):
        assert _greedy(compiled_llm, PROMPTS[:count]) == eager_tokens[:count]
    forward = _compiled_forward(compiled_llm)
    assert forward.stats.num_traces == 1


def test_recompile_while_serving_fails_loudly(compiled_llm):
    """A guard failure (here: int32 token ids) must raise, not silently compile again."""
    runner = compiled_llm.engine_core.model_runner
    forward = _compiled_forward(compiled_llm)
    from v1_engine.forward_context import set_forward_context

    with (
        torch.inference_mode(),
        set_forward_context(None, runner.attn_backend, runner.model.attention_layers()),
    ):
        forward(torch.zeros(7, dtype=torch.int64), torch.arange(7))
        with pytest.raises(RuntimeError, match="recompile"):
            forward(torch.zeros(5, dtype=torch.int32), torch.arange(5))
    assert forward.stats.num_traces == 1


def test_compiled_with_fusion_passes_equals_eager(tiny_llama_dir, eager_tokens):
    llm = LLM(
        str(tiny_llama_dir),
        max_model_len=128,
        num_kv_blocks=64,
        compilation_config={"level": 1, "fusion_passes": ["add_rms_norm", "silu_and_mul"]},
    )
    stats = _compiled_forward(llm).stats
    num_layers = llm.engine_core.model_runner.hf_config.num_hidden_layers
    assert stats.pass_matches == {"add_rms_norm": 2 * num_layers, "silu_and_mul": num_layers}
    assert _greedy(llm, PROMPTS) == eager_tokens


@pytest.mark.parametrize(
    ("value", "level"),
    [(0, 0), (1, 1), (2, 2), ({"level": 1, "max_cudagraph_capture_size": 64}, 1)],
)
def test_compilation_config_from_kwargs(value, level):
    config = EngineConfig.from_kwargs(compilation_config=value)
    assert config.compilation_config.level == level
    assert config.compilation_config.effective_level() == level


def test_default_is_eager_and_enforce_eager_wins():
    assert EngineConfig.from_kwargs().compilation_config.effective_level() == 0
    config = EngineConfig.from_kwargs(compilation_config=2, enforce_eager=True)
    assert config.compilation_config.level == 2
    assert config.compilation_config.effective_level() == 0


@pytest.mark.parametrize(
    ("value", "field"),
    [
        (3, "compilation level"),
        (True, "compilation_config"),
        ("1", "compilation_config"),
        ({"levle": 1}, "unknown compilation_config keys"),
        ({"fusion_passes": ["nope"]}, "fusion_passes"),
        ({"cudagraph_capture_sizes": [0]}, "cudagraph_capture_sizes"),
        ({"max_cudagraph_capture_size": 0}, "max_cudagraph_capture_size"),
    ],
)
def test_invalid_compilation_config_names_the_field(value, field):
    with pytest.raises(ValueError, match=field):
        EngineConfig.from_kwargs(compilation_config=value)


def test_config_object_passes_through():
    config = CompilationConfig(level=1, fusion_passes=["silu_and_mul"])
    assert EngineConfig.from_kwargs(compilation_config=config).compilation_config == config


def test_default_model_compiled_equals_eager():
    """The CI check of the issue: level 1 on the default model gives eager's greedy tokens
    (about 20 s of Dynamo + Inductor on two cores with a cold Inductor cache)."""
    compiled = LLM(max_model_len=256, num_kv_blocks=64, compilation_config=1)
    stats = _compiled_forward(compiled).stats
    assert stats.num_pieces == compiled.engine_core.model_runner.hf_config.num_hidden_layers + 1
    compiled_tokens = _greedy(compiled, PROMPTS)
    del compiled
    eager = LLM(max_model_len=256, num_kv_blocks=64)
    assert compiled_tokens == _greedy(eager, PROMPTS)


def test_fp8_model_compiles_without_symbolic_bools_between_pieces(tiny_llama_dir):
    """Online FP8 under -O1: the GEMM wrappers' scale checks compared the per-token scale's row
    count with the traced token count, and that symbolic bool crossed into the next compiled
    piece (Inductor on CUDA cannot compile it; split_graph now refuses it on every device). The
    compiled FP8 model must trace and give the eager FP8 model's tokens."""
    kwargs = {"dtype": "bfloat16", "quantization": "fp8", "max_model_len": 128}
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    prompts = ["The capital of France is", "def f(x):"]
    eager = LLM(str(tiny_llama_dir), **kwargs).generate(prompts, params, use_tqdm=False)
    torch._dynamo.utils.counters.clear()
    compiled = LLM(str(tiny_llama_dir), compilation_config=1, **kwargs)
    got = [o.outputs[0].token_ids for o in compiled.generate(prompts, params, use_tqdm=False)]
    want = [o.outputs[0].token_ids for o in eager]
    assert compiled.engine_core.model_runner._forward.stats.num_traces == 1
    # bf16 activations: Inductor rounds some intermediates differently from eager (1-2 bf16
    # ulps), so a random tiny model may flip a later near tie; the first token of every prompt
    # must agree and the runs must mostly follow each other.
    assert [g[0] for g in got] == [w[0] for w in want]
    agree = sum(
        next((i for i, (a, b) in enumerate(zip(g, w)) if a != b), len(g)) for g, w in zip(got, want)
    )
    assert agree >= len(prompts) * 5, (got, want)


def test_compilation_shows_progress_per_piece(tiny_llama_dir, capfd):
    """Compiling is long work: a tqdm bar counts the Inductor pieces (layers + 1)."""
    llm = LLM(str(tiny_llama_dir), max_model_len=128, num_kv_blocks=32, compilation_config=1)
    pieces = llm.engine_core.model_runner._forward.stats.num_pieces
    err = capfd.readouterr().err
    assert "Compiling with Inductor" in err and f"{pieces}/{pieces}" in err
