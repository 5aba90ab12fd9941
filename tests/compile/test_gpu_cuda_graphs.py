"""Full decode CUDA graphs on the GPU: the same greedy tokens as eager, with padded batches, a
batch larger than the largest graph (eager fallback) and a mixed prefill/decode schedule."""

from __future__ import annotations

import pytest
import torch

from v1_engine import LLM, SamplingParams

pytestmark = pytest.mark.gpu

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, a",
    "List three prime numbers:",
    "The quick brown fox",
    "In 1969, the first",
]


def _greedy(llm: LLM, prompts: list[str], max_tokens: int = 16) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return [out.outputs[0].token_ids for out in llm.generate(prompts, params, use_tqdm=False)]


def _assert_same_tokens(got: list[list[int]], want: list[list[int]]) -> None:
    """Equal token lists, or a message naming the first divergence of each differing prompt."""
    diverged = []
    for i, (g, w) in enumerate(zip(got, want)):
        if g != w:
            at = next((j for j, (a, b) in enumerate(zip(g, w)) if a != b), min(len(g), len(w)))
            diverged.append(
                f"prompt {i} at token {at}: got {g[at : at + 4]}, eager {w[at : at + 4]}"
            )
    assert not diverged and len(got) == len(want), "; ".join(diverged)


def _runner(llm: LLM):
    return llm.engine_core.model_runner


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, default_tokenizer):
    from hf_reference import make_tiny_model

    path = tmp_path_factory.mktemp("tiny-llama-graphs")
    make_tiny_model("llama", path, default_tokenizer)
    return path


def _llm(model_dir, **kwargs) -> LLM:
    return LLM(
        str(model_dir),
        dtype="float32",
        max_model_len=128,
        num_kv_blocks=128,
        max_num_seqs=16,
        **kwargs,
    )


@pytest.fixture(scope="module")
def expected(model_dir) -> dict[int, list[list[int]]]:
    eager = _llm(model_dir, enforce_eager=True)
    runner = _runner(eager)
    assert runner.graphs.decode is None and runner.graphs.piecewise is None
    tokens = {n: _greedy(eager, PROMPTS[:n]) for n in (1, 3, 6)}
    del eager
    torch.cuda.empty_cache()
    return tokens


def test_piecewise_graphs_equal_eager(model_dir, expected):
    """Level 1: prefills of up to 32 tokens and decodes replay piecewise graphs (attention eager
    between them); the 6-prompt prefill is larger than every graph and runs eagerly."""
    llm = _llm(
        model_dir,
        compilation_config={
            "level": 1,
            "cudagraph_capture_sizes": [2, 8, 32],
            "piecewise_cudagraphs": True,
        },
    )
    runner = _runner(llm)
    assert runner.graphs.decode is None
    piecewise = runner.graphs.piecewise
    assert piecewise is not None and piecewise.sizes == [2, 8, 32]
    for n in (1, 3, 6):
        before = piecewise.num_replays
        _assert_same_tokens(_greedy(llm, PROMPTS[:n]), expected[n])
        assert piecewise.num_replays - before >= 15, "steps did not replay piecewise graphs"
    assert runner._forward.stats.num_traces == 1


def test_decode_graphs_equal_eager(model_dir, expected):
    graphs_llm = _llm(
        model_dir, compilation_config={"level": 2, "cudagraph_capture_sizes": [1, 2, 4]}
    )
    runner = _runner(graphs_llm)
    graphs = runner.graphs.decode
    assert graphs is not None and graphs.sizes == [1, 2, 4]
    assert "graph capture" in runner.startup_s
    for n in (1, 3):  # 3 requests replay the graph of 4 (one padding row)
        before = graphs.num_replays
        _assert_same_tokens(_greedy(graphs_llm, PROMPTS[:n]), expected[n])
        assert graphs.num_replays - before >= 10, "decode steps did not replay a graph"
    before = graphs.num_replays
    _assert_same_tokens(_greedy(graphs_llm, PROMPTS[:6]), expected[6])  # 6 > 4: eager steps
    assert runner._forward.stats.num_traces == 1
    print(
        f"decode graphs: capture {graphs.capture_s:.2f} s, pool {graphs.pool_bytes / 2**20:.1f} MiB"
    )


def test_level2_replays_piecewise_and_decode_graphs(model_dir, expected):
    """Default -O2: prefills and mixed steps of up to 64 tokens replay piecewise graphs, uniform
    decode steps replay the full decode graphs; tokens equal eager's."""
    llm = _llm(model_dir, compilation_config={"level": 2, "cudagraph_capture_sizes": [4, 16, 64]})
    runner = _runner(llm)
    decode, piecewise = runner.graphs.decode, runner.graphs.piecewise
    assert decode is not None and decode.sizes == [4, 16]  # capped by max_num_seqs
    assert piecewise is not None and piecewise.sizes == [4, 16, 64]
    for n in (1, 3, 6):
        before_decode, before_piecewise = decode.num_replays, piecewise.num_replays
        _assert_same_tokens(_greedy(llm, PROMPTS[:n]), expected[n])
        assert decode.num_replays - before_decode >= 10
        assert piecewise.num_replays > before_piecewise  # the prefill step
    assert runner._forward.stats.num_traces == 1


def test_default_model_level2_equals_eager_fp32():
    from v1_engine.models.loader import resolve_model_path

    try:
        resolve_model_path(None)
    except ValueError as e:
        pytest.skip(f"default model weights unavailable: {e}")
    kwargs = {"dtype": "float32", "max_model_len": 512, "max_num_seqs": 8}
    eager = _greedy(LLM(enforce_eager=True, **kwargs), PROMPTS[:5], max_tokens=24)
    torch.cuda.empty_cache()
    llm = LLM(compilation_config=2, **kwargs)
    graphs = _runner(llm).graphs.decode
    assert graphs is not None and graphs.sizes[-1] == 8
    _assert_same_tokens(_greedy(llm, PROMPTS[:5], max_tokens=24), eager)
    assert graphs.num_replays > 0
