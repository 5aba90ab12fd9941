"""DeepSeek routers and the reference MoE forward against straightforward per-token references
(and the routers against the Hugging Face router modules themselves)."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from v1_engine.layers.moe import RouterConfig, fused_experts_reference, select_experts

NUM_EXPERTS, NUM_TOKENS = 8, 24


def _top(values: list[float], k: int, allowed: set[int]) -> list[int]:
    ranked = sorted(allowed, key=lambda e: -values[e])
    return ranked[:k]


def _reference_route(logits: list[float], config: RouterConfig, bias: list[float] | None):
    """One token, in plain Python: (expert ids sorted, their weights)."""
    per_group = NUM_EXPERTS // config.num_groups
    groups = [range(g * per_group, (g + 1) * per_group) for g in range(config.num_groups)]
    if config.topk_method == "noaux_tc":
        scores = [1 / (1 + math.exp(-x)) for x in logits]
        choice = [s + b for s, b in zip(scores, bias or [0.0] * NUM_EXPERTS)]
        group_score = [sum(sorted((choice[e] for e in g), reverse=True)[:2]) for g in groups]
    else:
        top = max(logits)
        exps = [math.exp(x - top) for x in logits]
        scores = [x / sum(exps) for x in exps]
        choice = scores
        group_score = [max(scores[e] for e in g) for g in groups]
    allowed = set(range(NUM_EXPERTS))
    if config.topk_method != "greedy":
        best = _top(group_score, config.topk_group, set(range(config.num_groups)))
        allowed = {e for g in best for e in groups[g]}
    ids = sorted(_top(choice, config.top_k, allowed))
    weights = [scores[e] for e in ids]
    if config.renormalize:
        weights = [w / sum(weights) for w in weights]
    return ids, [w * config.routed_scaling_factor for w in weights]


CONFIGS = {
    "v2-greedy": RouterConfig(NUM_EXPERTS, 2, "greedy", routed_scaling_factor=1.5),
    "v2-group-limited": RouterConfig(NUM_EXPERTS, 3, "group_limited_greedy", 4, 2),
    "v3-noaux-tc": RouterConfig(NUM_EXPERTS, 2, "noaux_tc", 4, 2, True, 2.5),
    "v3-one-group-unnormalized": RouterConfig(NUM_EXPERTS, 3, "noaux_tc", 1, 1, False, 1.0),
}


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_router_matches_per_token_reference(name):
    config = CONFIGS[name]
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(NUM_TOKENS, NUM_EXPERTS, generator=generator) * 2
    bias = None
    if config.topk_method == "noaux_tc":
        bias = torch.randn(NUM_EXPERTS, generator=generator) * 0.3
    weights, ids = select_experts(logits, config, bias)
    assert weights.dtype == torch.float32 and ids.shape == (NUM_TOKENS, config.top_k)
    for t in range(NUM_TOKENS):
        want_ids, want_weights = _reference_route(
            logits[t].tolist(), config, None if bias is None else bias.tolist()
        )
        order = ids[t].argsort()
        assert ids[t][order].tolist() == want_ids
        assert weights[t][order].tolist() == pytest.approx(want_weights, rel=1e-5)


def test_correction_bias_steers_choice_but_not_weights():
    config = RouterConfig(4, 1, "noaux_tc", routed_scaling_factor=1.0)
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    weights, ids = select_experts(logits, config, torch.tensor([0.0, 0.0, 0.0, 5.0]))
    assert ids.tolist() == [[3]]
    assert weights.item() == pytest.approx(torch.sigmoid(torch.tensor(-1.0)).item())


def _hf_config(**overrides):
    base = {
        "num_experts_per_tok": 2,
        "num_local_experts": NUM_EXPERTS,
        "num_experts": NUM_EXPERTS,
        "hidden_size": 16,
        "n_group": 4,
        "topk_group": 2,
    }
    return SimpleNamespace(**{**base, **overrides})


@pytest.mark.parametrize("topk_method", ["greedy", "group_limited_greedy"])
def test_v2_router_matches_hf_module(topk_method):
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2TopkRouter

    hf = DeepseekV2TopkRouter(_hf_config(routed_scaling_factor=1.5, topk_method=topk_method))
    torch.nn.init.normal_(hf.weight, std=0.5)
    x = torch.randn(NUM_TOKENS, 16, generator=torch.Generator().manual_seed(4))
    _, hf_weights, hf_ids = hf(x)
    config = RouterConfig(NUM_EXPERTS, 2, topk_method, 4, 2, False, 1.5)
    weights, ids = select_experts(F.linear(x, hf.weight), config)
    _assert_same_routing(weights, ids, hf_weights, hf_ids)


def test_v3_router_matches_hf_module():
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    hf = DeepseekV3TopkRouter(_hf_config(routed_scaling_factor=2.5, norm_topk_prob=True))
    torch.nn.init.normal_(hf.weight, std=0.5)
    torch.nn.init.normal_(hf.e_score_correction_bias, std=0.3)
    x = torch.randn(NUM_TOKENS, 16, generator=torch.Generator().manual_seed(5))
    _, hf_weights, hf_ids = hf(x)
    config = RouterConfig(NUM_EXPERTS, 2, "noaux_tc", 4, 2, True, 2.5)
    weights, ids = select_experts(F.linear(x, hf.weight), config, hf.e_score_correction_bias)
    _assert_same_routing(weights, ids, hf_weights, hf_ids)


def _assert_same_routing(weights, ids, hf_weights, hf_ids):
    ours, theirs = ids.argsort(dim=-1), hf_ids.argsort(dim=-1)
    assert torch.equal(ids.gather(1, ours), hf_ids.gather(1, theirs))
    torch.testing.assert_close(weights.gather(1, ours), hf_weights.gather(1, theirs))


def test_grouped_expert_forward_matches_per_token_loop():
    generator = torch.Generator().manual_seed(6)
    hidden, inter, top_k = 16, 12, 3
    x = torch.randn(NUM_TOKENS, hidden, generator=generator)
    w13 = torch.randn(NUM_EXPERTS, 2 * inter, hidden, generator=generator) * 0.3
    w2 = torch.randn(NUM_EXPERTS, hidden, inter, generator=generator) * 0.3
    # Expert 7 is never chosen: an empty group must be skipped.
    ids = torch.stack([torch.randperm(7, generator=generator)[:top_k] for _ in range(NUM_TOKENS)])
    weights = torch.rand(NUM_TOKENS, top_k, generator=generator)
    got = fused_experts_reference(x, w13, w2, weights, ids)
    for t in range(NUM_TOKENS):
        expected = torch.zeros(hidden)
        for k in range(top_k):
            e = int(ids[t, k])
            gate, up = (w13[e] @ x[t]).chunk(2)
            expected += weights[t, k] * (w2[e] @ (F.silu(gate) * up))
        torch.testing.assert_close(got[t], expected, atol=1e-5, rtol=1e-5)


def test_router_config_rejects_bad_groups():
    with pytest.raises(ValueError, match="n_group must divide"):
        RouterConfig(NUM_EXPERTS, 2, "noaux_tc", num_groups=3)
    with pytest.raises(ValueError, match="topk_group must be in"):
        RouterConfig(NUM_EXPERTS, 2, "group_limited_greedy", num_groups=4, topk_group=5)
    with pytest.raises(ValueError, match="topk_method must be one of"):
        RouterConfig(NUM_EXPERTS, 2, "random")


@pytest.mark.gpu
@pytest.mark.parametrize("variant", ["v2-qlora-grouped", "v3-yarn-grouped-mtp"])
def test_gpu_tiny_deepseek_through_kernels_matches_hf_greedy(variant, tmp_path, default_tokenizer):
    """On CUDA the engine runs the Triton MLA decode kernel and the fused MoE kernels (float32,
    IEEE dots): greedy tokens equal Hugging Face's, over prefill, chunked prefill and decode."""
    from hf_reference import hf_greedy
    from test_deepseek_vs_hf import save_tiny_deepseek

    from v1_engine import LLM, SamplingParams
    from v1_engine.attention.mla_triton import TritonMLABackend
    from v1_engine.layers.mla import get_mla_backend

    hf_model = save_tiny_deepseek(variant, tmp_path, seed=5, tokenizer=default_tokenizer)
    llm = LLM(
        model=str(tmp_path),
        dtype="float32",
        max_model_len=128,
        num_kv_blocks=64,
        block_size=4,
        max_num_batched_tokens=16,
    )
    assert llm.engine_core.model_runner.device.type == "cuda"
    assert isinstance(get_mla_backend(torch.device("cuda")), TritonMLABackend)
    generator = torch.Generator().manual_seed(11)
    prompts = [
        torch.randint(3, hf_model.config.vocab_size, (n,), generator=generator).tolist()
        for n in (1, 6, 19, 30)
    ]
    params = SamplingParams(temperature=0.0, max_tokens=10, min_tokens=10)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    expected = [hf_greedy(hf_model, p, 10, exact=True) for p in prompts]
    assert [o.outputs[0].token_ids for o in outputs] == expected
