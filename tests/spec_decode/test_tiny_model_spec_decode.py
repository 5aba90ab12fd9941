"""Speculative decoding on a tiny random-weight Llama in float32 (so every kernel path agrees to
the argmax), on the CPU and the GPU: greedy output with n-gram drafts equal to the output without them, with
verify steps eager (-O0) and through their full CUDA graphs (-O2, where steps without drafts
replay the decode graphs)."""

from __future__ import annotations

import itertools

import pytest
import torch

from v1_engine import LLM, SamplingParams
from v1_engine.spec_decode.draft_counter import DraftCounter

SPEC = {"method": "ngram", "num_speculative_tokens": 4}


def _prompts() -> list[list[int]]:
    generator = torch.Generator().manual_seed(5)
    prompts = []
    for n in (3, 9, 17, 40):
        pattern = torch.randint(10, 1000, (n,), generator=generator).tolist()
        prompts.append(pattern * 3)  # repeats: drafts are proposed from the start
    return prompts


def _run(llm: LLM) -> list[list[int]]:
    eos = llm.get_tokenizer().eos_token_id
    prompts = _prompts() + [[5, 6, 7]]
    params = [SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)] * 4 + [
        # Forced repeats, EOS held back by min_tokens: drafts are kept.
        SamplingParams(temperature=0.0, max_tokens=40, logit_bias={eos: 100.0, 77: 60.0}, min_tokens=21)
    ]  # fmt: skip
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert outputs[-1].outputs[0].token_ids == [77] * 21 + [eos]
    return [o.outputs[0].token_ids for o in outputs]


def _check(model_dir, **kwargs) -> LLM:
    kwargs.update(dtype="float32", max_model_len=256, num_kv_blocks=128, max_num_seqs=16)
    expected = _run(LLM(str(model_dir), **kwargs))
    llm = LLM(str(model_dir), speculative_config=SPEC, **kwargs)
    counter = DraftCounter(llm)
    assert _run(llm) == expected
    assert counter.accepted > 15 and counter.draft_tokens >= counter.accepted
    assert llm.engine_core.scheduler.kv_cache_manager.num_free_blocks == 128
    return llm


def test_drafts_leave_greedy_output_unchanged_on_the_cpu(tiny_llama_dir):
    _check(tiny_llama_dir)


VERIFY_GRAPHS = 2  # the default at level 2: full graphs for verify steps
PIECEWISE_VERIFY = {"level": 2, "verify_cudagraphs": False}


@pytest.mark.gpu
@pytest.mark.parametrize(
    "level", [0, PIECEWISE_VERIFY, VERIFY_GRAPHS], ids=["O0", "O2-piecewise-verify", "O2"]
)
def test_drafts_leave_greedy_output_unchanged_on_the_gpu(tiny_llama_dir, level):
    assert torch.cuda.is_available()
    llm = _check(tiny_llama_dir, compilation_config=level)
    runner = llm.engine_core.model_runner
    if level == PIECEWISE_VERIFY:
        assert runner.graphs.verify is None  # verify steps run the piecewise graphs
    if level == VERIFY_GRAPHS:  # verify steps replayed full graphs, the others decode graphs
        assert runner.graphs.verify is not None and runner.graphs.verify.query_len == 5
        assert runner.graphs.verify.num_replays > 10
        assert runner.graphs.decode is not None and runner.graphs.decode.num_replays > 0
        assert runner._forward.stats.num_traces <= 1  # no recompilation for the verify graphs


def test_random_sampling_keeps_its_distribution(tiny_llama_dir):
    """Two allowed tokens at temperature 1: each position is a coin the model biases. Over 400
    seeded requests, drafts (proposed from a single repeated token on) must leave the statistics
    of the output as they are without drafts: how often each token comes, and how often a token
    repeats the one before it (what accepting wrong drafts would inflate)."""
    a, b = 300, 301
    stats = []
    for spec in (None, {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}):
        llm = LLM(
            str(tiny_llama_dir),
            dtype="float32",
            max_model_len=64,
            num_kv_blocks=512,
            max_num_seqs=128,
            speculative_config=spec,
        )
        params = [
            SamplingParams(
                temperature=1.0,
                seed=i,
                max_tokens=16,
                allowed_token_ids=[a, b],
                frequency_penalty=1.0,
            )
            for i in range(400)
        ]
        outputs = llm.generate([[5, 6, 7, 8]] * 400, params, use_tqdm=False)
        seqs = [o.outputs[0].token_ids for o in outputs]
        assert all(len(s) == 16 and set(s) <= {a, b} for s in seqs)
        share_a = sum(s.count(a) for s in seqs) / (400 * 16)
        repeats = sum(x == y for s in seqs for x, y in itertools.pairwise(s)) / (400 * 15)
        stats.append((share_a, repeats))
    (share_plain, repeats_plain), (share_spec, repeats_spec) = stats
    assert 0.1 < share_plain < 0.9  # the coin is not all one side
    assert share_spec == pytest.approx(share_plain, abs=0.04)
    assert repeats_spec == pytest.approx(repeats_plain, abs=0.04)


def test_backoff_drafts_less_where_drafts_fail_and_changes_no_token(tiny_llama_dir):
    """Random weights: 1-gram drafts are proposed often and rarely kept. With the back-off a
    request drafts far fewer tokens and outputs the same tokens."""
    generator = torch.Generator().manual_seed(11)
    prompts = [torch.randint(10, 60, (24,), generator=generator).tolist() for _ in range(8)]
    # 50 allowed tokens and a frequency penalty: greedy output does not loop, and the bigrams
    # drafts copy rarely come true.
    params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True, frequency_penalty=2.0,
                            allowed_token_ids=list(range(10, 60)))  # fmt: skip
    results = []
    for backoff in (0, 8):
        spec = {**SPEC, "prompt_lookup_min": 1, "draft_backoff": backoff}
        llm = LLM(str(tiny_llama_dir), dtype="float32", max_model_len=128, num_kv_blocks=128,
                  speculative_config=spec)  # fmt: skip
        counter = DraftCounter(llm)
        outputs = llm.generate(prompts, params, use_tqdm=False)
        results.append(
            ([o.outputs[0].token_ids for o in outputs], counter.draft_tokens, counter.accepted)
        )
    (plain_tokens, plain_drafts, plain_kept), (tokens, drafts, _) = results
    assert tokens == plain_tokens
    assert plain_drafts > 200 and plain_kept < plain_drafts / 4  # drafts mostly fail here
    assert 0 < drafts < plain_drafts / 2  # 304 vs 857 when written


@pytest.mark.gpu
def test_verify_graphs_compute_what_the_eager_forward_does(tiny_llama_dir):
    """Every verify step replayed from a full graph (its inputs packed, padded with empty
    requests and the padding request's tokens) gives the step's hidden states the eager forward
    gives for the same inputs, in float32."""
    from v1_engine.forward_context import set_forward_context

    llm = LLM(str(tiny_llama_dir), dtype="float32", max_model_len=256, num_kv_blocks=128,
              max_num_seqs=16, speculative_config=SPEC, compilation_config=VERIFY_GRAPHS)  # fmt: skip
    runner = llm.engine_core.model_runner
    graphs = runner.graphs.verify
    assert graphs is not None
    original = runner._run_forward
    errors: list[tuple[int, int, float]] = []

    def both(inputs):
        metadata = inputs.metadata
        if metadata.max_query_len == 1 or not graphs.can_run(metadata):
            return original(inputs)
        replayed = graphs.run(inputs.input_ids, inputs.positions, metadata).clone()
        layers = runner.model.attention_layers()
        with set_forward_context(metadata, runner.attn_backend, layers):
            eager = runner.model(inputs.input_ids, inputs.positions)
        error = float((replayed - eager).abs().max() / eager.abs().max())
        errors.append((metadata.num_reqs, metadata.num_actual_tokens, error))
        return eager

    runner._run_forward = both
    _run(llm)
    assert len(errors) > 10
    worst = max(errors, key=lambda e: e[2])
    assert worst[2] < 1e-4, (worst, errors[:20])


def test_verify_graph_inputs_compute_what_the_step_alone_does_on_the_cpu(tiny_llama_dir):
    """A verify graph's packing without the graph (CPU, Triton attention under the interpreter):
    a verify step's inputs written into the buffers of the graph that would run it, the forward
    run over those buffers as the captured metadata describes them, gives the step's hidden
    states (the first 12 verify steps are checked so; the others run as usual), and the greedy
    output stays the output without drafts."""
    from compile.cuda_graphs import VarlenCudaGraphs
    from v1_engine.attention.selector import get_attn_backend
    from v1_engine.forward_context import set_forward_context

    kwargs = {"dtype": "float32", "max_model_len": 256, "num_kv_blocks": 128, "max_num_seqs": 16}
    expected = _run(LLM(str(tiny_llama_dir), **kwargs))
    llm = LLM(str(tiny_llama_dir), speculative_config=SPEC, attention_backend="triton", **kwargs)
    runner = llm.engine_core.model_runner
    layers = runner.model.attention_layers()
    graphs = VarlenCudaGraphs(runner.model, [1, 2, 4, 8, 16], max_blocks_per_req=16,
                              max_seq_len=256, device=runner.device, query_len=5,
                              block_size=runner.block_size)  # fmt: skip
    graphs._graphs = dict.fromkeys(graphs.sizes)  # as if captured: can_run holds
    original = runner._run_forward
    errors: list[float] = []

    def packed(inputs):
        metadata = inputs.metadata
        if len(errors) == 12:  # checked enough: the rest on the (faster) CPU backend
            runner.attn_backend = get_attn_backend(runner.device, "cpu")
        if len(errors) >= 12 or metadata.max_query_len == 1 or not graphs.can_run(metadata):
            return original(inputs)
        with set_forward_context(metadata, runner.attn_backend, layers):
            alone = runner.model(inputs.input_ids, inputs.positions)
        size = graphs.write_inputs(inputs.input_ids, inputs.positions, metadata)
        padded = graphs._metadata(size)
        tokens = padded.num_actual_tokens
        with set_forward_context(padded, runner.attn_backend, layers):
            hidden = runner.model(graphs.input_ids[:tokens], graphs.positions[:tokens])
        assert bool(hidden.isfinite().all())
        n = metadata.num_actual_tokens
        errors.append(float((hidden[:n] - alone).abs().max() / alone.abs().max()))
        return hidden[:n]

    runner._run_forward = packed
    assert _run(llm) == expected
    assert len(errors) == 12 and max(errors) < 1e-5
