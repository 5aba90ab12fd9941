"""DeepSeek-V2 / V3 compiled: the MLA + MoE forward under the piecewise torch.compile backend.

On CPU (level 1): Dynamo traces the forward once with the token count symbolic and no graph
break (the data-dependent MLA and MoE work sits behind their custom ops), the graph splits at
every MLA op into num_layers + 1 Inductor pieces, greedy tokens equal the eager engine's over
mixed prefill + decode steps, and no batch size makes it trace again.

On CUDA (level 2): tiny V2-Lite- and V3-shaped models replay whole-forward decode CUDA graphs
around the Triton MLA and MoE kernels; in float32 their greedy tokens equal the eager engine's,
in bf16 (V2-Lite's shape) they do up to near ties swapped by rounding, with close logprobs.
"""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch
from test_deepseek_vs_hf import TINY_VARIANTS, save_tiny_deepseek

from v1_engine import LLM, SamplingParams
from v1_engine.worker.step_inputs import StepInputs

V2_GROUPED_NO_QLORA = {
    "model_type": "deepseek_v2",
    "q_lora_rank": None,
    "n_routed_experts": 8,
    "topk_method": "group_limited_greedy",
    "n_group": 4,
    "topk_group": 2,
    "routed_scaling_factor": 1.5,
    "num_hidden_layers": 2,
}
"""V2 with the query projected directly and softmax scores routed within the 2 best of 4 groups."""
V3_VARIANT = "v3-yarn-grouped-mtp"
"""V3: low-rank query, sigmoid router with e_score_correction_bias, a dense first layer."""
V2_LITE_SHAPED = {
    "model_type": "deepseek_v2",
    "hidden_size": 256,
    "intermediate_size": 512,
    "moe_intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "kv_lora_rank": 64,
    "qk_nope_head_dim": 32,
    "qk_rope_head_dim": 32,
    "v_head_dim": 32,
    "q_lora_rank": None,
    "n_routed_experts": 16,
    "num_experts_per_tok": 4,
    "n_shared_experts": 2,
    "topk_method": "greedy",
    "n_group": 1,
    "topk_group": 1,
    "first_k_dense_replace": 1,
    "num_hidden_layers": 3,
    "max_position_embeddings": 256,
    "rope_parameters": {
        "rope_type": "yarn",
        "rope_theta": 10000.0,
        "factor": 4.0,
        "original_max_position_embeddings": 64,
        "mscale": 0.707,
        "mscale_all_dim": 0.707,
        "beta_fast": 32,
        "beta_slow": 1,
    },
}
"""DeepSeek-V2-Lite's structure (direct query, greedy softmax top-k, two shared experts, a dense
first layer, yarn rope) at sizes the Triton MLA and MoE kernels take."""
V3_SHAPED = {
    **{k: v for k, v in V2_LITE_SHAPED.items() if k != "topk_method"},
    "model_type": "deepseek_v3",
    "q_lora_rank": 64,
    "n_group": 4,
    "topk_group": 2,
    "norm_topk_prob": True,
    "routed_scaling_factor": 2.5,
}
"""The same sizes with V3's low-rank query and sigmoid, bias-corrected, group-limited router."""
PROMPT_LENS = (1, 6, 19, 30)
MAX_BATCHED_TOKENS = 16
"""Small enough that prompts prefill in chunks beside other requests' decode tokens."""
BF16_LOGPROB_TOL = 0.5
"""bf16 noise in a logprob of these random-weight models (compiled vs eager differ by up to
~0.3 on CPU, measured): a larger difference is a bug, a top-2 margin below it may flip."""


def save_variant(name: str, spec: dict, path: Path, tokenizer, seed: int = 5) -> None:
    """save_tiny_deepseek for a spec not among its named variants (registered only meanwhile)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setitem(TINY_VARIANTS, name, spec)
        save_tiny_deepseek(name, path, seed=seed, tokenizer=tokenizer)


def make_prompts(vocab_size: int, lens: tuple[int, ...] = PROMPT_LENS) -> list[list[int]]:
    generator = torch.Generator().manual_seed(11)
    return [torch.randint(3, vocab_size, (n,), generator=generator).tolist() for n in lens]


def greedy(llm: LLM, prompts: list[list[int]], max_tokens: int = 8) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return [out.outputs[0].token_ids for out in llm.generate(prompts, params, use_tqdm=False)]


def build_llm(path: Path, level: int | dict, **kwargs) -> LLM:
    """The engine on a tiny model at compilation level (or config) `level`."""
    return LLM(
        str(path),
        max_model_len=128,
        num_kv_blocks=64,
        block_size=4,
        max_num_batched_tokens=MAX_BATCHED_TOKENS,
        enable_prefix_caching=False,  # every run prefills: the same mix of step shapes
        compilation_config=level,
        **kwargs,
    )


def reset_dynamo() -> None:
    """Clear Dynamo's counters (graph breaks, unique graphs) before a model compiles.

    Dynamo's learned state is kept on purpose: the tests compile several models in one process
    whose float attributes differ (RMSNorm eps, routed_scaling_factor) on the same decoder code
    objects, and each must still trace once (CompiledForward traces with automatic dynamic shapes
    off; with it on, the differing float became a symbol and the first call traced twice)."""
    torch._dynamo.utils.counters.clear()


class StepRecorder:
    """Stands in for the runner's forward dispatch to record each step's query lengths."""

    def __init__(self, run_forward) -> None:
        self.query_lens: list[list[int]] = []
        self._run_forward = run_forward

    def __call__(self, inputs: StepInputs) -> torch.Tensor:
        starts = inputs.metadata.query_start_loc_cpu.tolist()
        self.query_lens.append([b - a for a, b in itertools.pairwise(starts)])
        return self._run_forward(inputs)

    @property
    def num_mixed_steps(self) -> int:
        """Steps holding both a decode token and a prefill chunk."""
        return sum(1 in lens and max(lens) > 1 for lens in self.query_lens)

    @property
    def token_counts(self) -> set[int]:
        return {sum(lens) for lens in self.query_lens}


@pytest.fixture(scope="module", params=["v2-grouped-no-qlora", V3_VARIANT])
def model_dir(request, tmp_path_factory, default_tokenizer) -> Path:
    path = tmp_path_factory.mktemp(f"deepseek-compile-{request.param}")
    if request.param == V3_VARIANT:
        save_tiny_deepseek(V3_VARIANT, path, seed=5, tokenizer=default_tokenizer)
    else:
        save_variant(request.param, V2_GROUPED_NO_QLORA, path, default_tokenizer)
    return path


@pytest.fixture(scope="module")
def prompts(default_tokenizer) -> list[list[int]]:
    return make_prompts(len(default_tokenizer))


@pytest.fixture(scope="module")
def eager_tokens(model_dir, prompts) -> dict[int, list[list[int]]]:
    """Eager greedy tokens of the first n prompts run together, for each batch size n."""
    llm = build_llm(model_dir, level=0)
    assert llm.engine_core.model_runner._forward is llm.engine_core.model_runner.model
    return {n: greedy(llm, prompts[:n]) for n in range(1, len(prompts) + 1)}


@pytest.fixture(scope="module")
def compiled_llm(model_dir) -> LLM:
    reset_dynamo()
    return build_llm(model_dir, level=1)


def record_steps(llm: LLM, monkeypatch: pytest.MonkeyPatch) -> StepRecorder:
    runner = llm.engine_core.model_runner
    recorder = StepRecorder(runner._run_forward)
    monkeypatch.setattr(runner, "_run_forward", recorder)
    return recorder


def test_traced_once_without_graph_breaks(compiled_llm):
    """fullgraph=True already refuses a break; the counter says none was even attempted."""
    forward = compiled_llm.engine_core.model_runner._forward
    assert forward.stats.num_traces == 1
    assert forward.stats.inductor_s > 0
    assert not torch._dynamo.utils.counters["graph_break"]


def test_graph_split_at_every_mla_op(compiled_llm):
    """One MLA op per layer, each alone between two Inductor pieces: num_layers + 1 pieces."""
    runner = compiled_llm.engine_core.model_runner
    stats = runner._forward.stats
    num_layers = runner.hf_config.num_hidden_layers
    assert stats.num_splitting_ops == num_layers
    assert stats.num_pieces == num_layers + 1


def test_compiled_greedy_equals_eager_in_mixed_steps(
    compiled_llm, eager_tokens, prompts, monkeypatch
):
    recorder = record_steps(compiled_llm, monkeypatch)
    assert greedy(compiled_llm, prompts) == eager_tokens[len(prompts)]
    assert recorder.num_mixed_steps > 0, "no step mixed a prefill chunk with decode tokens"


def test_no_recompile_across_batch_sizes(compiled_llm, eager_tokens, prompts, monkeypatch):
    """1 to 4 requests: single-token decodes, full budgets, ragged chunks; one trace serves all
    (a second one would raise under the fail_on_recompile stance)."""
    runner = compiled_llm.engine_core.model_runner
    recorder = record_steps(compiled_llm, monkeypatch)
    for count in range(1, len(prompts) + 1):
        assert greedy(compiled_llm, prompts[:count]) == eager_tokens[count]
    assert {1, 2, 3, 4, MAX_BATCHED_TOKENS} <= recorder.token_counts
    assert runner._forward.stats.num_traces == 1
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1


# ---- CUDA: decode graphs --------------------------------------------------------------------


def max_logprob_diff_or_tie(eager: list, compiled: list) -> float:
    """Check two runs' CompletionOutputs (greedy, with top-2 logprobs) agree; return the largest
    difference between the logprobs both gave the eager run's tokens.

    The tokens must be equal, except that a completion may diverge where eager's top-2 margin
    was below BF16_LOGPROB_TOL (a near tie). The compiled run's token need not be eager's
    second choice: with random weights a bf16 rounding difference can flip a near tie in the
    MoE's top-k routing, which moves the logits of that step by more than the margin (seen on
    the H200: a divergence at a margin of 0.125 to eager's third token). Past a divergence the
    contexts differ, so nothing more is compared."""
    max_diff = 0.0
    for i, (want, got) in enumerate(zip(eager, compiled, strict=True)):
        at = next(
            (j for j, (a, b) in enumerate(zip(got.token_ids, want.token_ids)) if a != b), None
        )
        compared = len(want.token_ids) if at is None else at + 1
        for step, token in enumerate(want.token_ids[:compared]):
            if token in got.logprobs[step]:
                diff = got.logprobs[step][token].logprob - want.logprobs[step][token].logprob
                max_diff = max(max_diff, abs(diff))
        if at is not None:
            mine, theirs = got.token_ids[at], want.token_ids[at]
            ranked = sorted((lp.logprob for lp in want.logprobs[at].values()), reverse=True)
            margin = ranked[0] - ranked[1]
            assert margin < BF16_LOGPROB_TOL, (
                f"completion {i} diverged at token {at} (got {mine}, eager {theirs}); eager's "
                f"top-2 margin {margin:.3f} is not a near tie"
            )
    return max_diff


def eager_and_graphed(spec: dict, dtype: str, path: Path, tokenizer) -> dict[str, list]:
    """Greedy CompletionOutputs (16 tokens, top-2 logprobs) of six prompts at -O0 and at -O2
    with decode graphs of 1, 2, 4 and 8 requests, checking the -O2 engine traced once into
    num_layers + 1 pieces and replayed graphs for its decode steps."""
    prompts = make_prompts(len(tokenizer), (1, 6, 19, 30, 3, 11))
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=2)
    sizes = [1, 2, 4, 8]
    outputs = {}
    for run, level in (("eager", 0), ("graphs", {"level": 2, "cudagraph_capture_sizes": sizes})):
        reset_dynamo()
        llm = build_llm(path, level, dtype=dtype, max_num_seqs=8)
        runner = llm.engine_core.model_runner
        assert runner.device.type == "cuda"
        graphs = runner.graphs.decode
        assert (graphs is None) == (run == "eager")
        replays_before = 0 if graphs is None else graphs.num_replays
        generated = llm.generate(prompts, params, use_tqdm=False)
        outputs[run] = [o.outputs[0] for o in generated]
        if graphs is not None:
            assert graphs.sizes == sizes
            assert graphs.num_replays - replays_before >= 10, "decode steps replayed no graph"
            stats = runner._forward.stats
            assert stats.num_traces == 1
            assert stats.num_pieces == spec["num_hidden_layers"] + 1
        del llm, runner, graphs
        torch.cuda.empty_cache()
    return outputs


@pytest.mark.gpu
def test_v2_lite_shaped_decode_graphs_match_eager_bf16(tmp_path, default_tokenizer):
    """-O2 (Inductor pieces, whole-forward decode CUDA graphs around the Triton MLA and MoE
    kernels) against -O0 in bf16: the same tokens up to near ties, close logprobs."""
    save_variant("v2-lite-shaped", V2_LITE_SHAPED, tmp_path, default_tokenizer)
    outputs = eager_and_graphed(V2_LITE_SHAPED, "bfloat16", tmp_path, default_tokenizer)
    max_diff = max_logprob_diff_or_tie(outputs["eager"], outputs["graphs"])
    print(f"DeepSeek V2-Lite-shaped -O2 vs -O0 (bf16): max |logprob diff| {max_diff:.4f}")
    assert max_diff < BF16_LOGPROB_TOL


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("name", "spec"), [("v2-lite", V2_LITE_SHAPED), ("v3", V3_SHAPED)], ids=["v2-lite", "v3"]
)
def test_decode_graphs_equal_eager_fp32(name, spec, tmp_path, default_tokenizer):
    """In float32 the greedy tokens of -O2 and -O0 are equal outright, for V2 and for V3's
    sigmoid router (in bf16 a near tie in top-k routing can flip an expert and move the
    logits by more than a nat, so bf16 token equality is only checked on V2-Lite's shape)."""
    save_variant(f"{name}-shaped", spec, tmp_path, default_tokenizer)
    outputs = eager_and_graphed(spec, "float32", tmp_path, default_tokenizer)
    want = [o.token_ids for o in outputs["eager"]]
    assert [o.token_ids for o in outputs["graphs"]] == want
    max_diff = max(
        abs(g.logprobs[step][token].logprob - e.logprobs[step][token].logprob)
        for e, g in zip(outputs["eager"], outputs["graphs"])
        for step, token in enumerate(e.token_ids)
    )
    print(f"DeepSeek {name}-shaped -O2 vs -O0 (fp32): max |logprob diff| {max_diff:.2e}")
