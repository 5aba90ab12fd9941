"""DeepSeek-V2 / V3 (MLA + MoE) against Hugging Face transformers, on tiny random-weight models.

Prompts run packed in one flat batch over a paged LATENT cache with non-contiguous blocks; every
position's logits must match HF's own forward, whether computed in one prefill, in two chunks
(the second attending to cached latents) or token by token through the absorbed decode path.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch
from model_helpers import PagedModelDriver, load_ours
from safetensors.torch import load_file, save_file

from v1_engine.attention.cpu import CPUAttentionBackend
from v1_engine.models.deepseek import DeepseekV2ForCausalLM, DeepseekV3ForCausalLM
from v1_engine.models.registry import get_model_class

PROMPT_LENS = (7, 2, 13, 24)
FIRST_CHUNK_LENS = (3, 1, 8, 5)
TOLERANCE = 1e-4
VOCAB_SIZE = 256

TINY_BASE = {
    "vocab_size": VOCAB_SIZE,
    "hidden_size": 64,
    "intermediate_size": 96,
    "moe_intermediate_size": 32,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "max_position_embeddings": 128,
    "kv_lora_rank": 32,
    "qk_nope_head_dim": 16,
    "qk_rope_head_dim": 8,
    "v_head_dim": 12,
    "first_k_dense_replace": 1,
    "n_shared_experts": 1,
    "num_experts_per_tok": 2,
    "tie_word_embeddings": False,
}
YARN = {
    "rope_type": "yarn",
    "rope_theta": 10000.0,
    "factor": 4.0,
    "original_max_position_embeddings": 32,
    "mscale": 1.0,
    "mscale_all_dim": 0.8,
    "beta_fast": 32,
    "beta_slow": 1,
}
TINY_VARIANTS: dict[str, dict] = {
    "v2-qlora-grouped": {
        "model_type": "deepseek_v2",
        "q_lora_rank": 24,
        "n_routed_experts": 8,
        "topk_method": "group_limited_greedy",
        "n_group": 4,
        "topk_group": 2,
        "routed_scaling_factor": 1.5,
    },
    "v2-lite-greedy-bias": {
        "model_type": "deepseek_v2",
        "q_lora_rank": None,
        "n_routed_experts": 4,
        "topk_method": "greedy",
        "attention_bias": True,
        "mlp_bias": True,
        "num_hidden_layers": 2,
    },
    "v3-yarn-grouped-mtp": {
        "model_type": "deepseek_v3",
        "q_lora_rank": 24,
        "n_routed_experts": 8,
        "n_group": 4,
        "topk_group": 2,
        "norm_topk_prob": True,
        "routed_scaling_factor": 2.5,
        "rope_parameters": YARN,
        "num_nextn_predict_layers": 1,
    },
    "v3-neox-ungrouped": {
        "model_type": "deepseek_v3",
        "q_lora_rank": None,
        "n_routed_experts": 4,
        "n_group": 1,
        "topk_group": 1,
        "norm_topk_prob": False,
        "rope_interleave": False,
        "num_hidden_layers": 2,
    },
}


@torch.no_grad()
def save_tiny_deepseek(variant: str, path: Path, seed: int = 0, tokenizer=None):
    """Save a seeded random-weight float32 HF DeepSeek model; return it (eval). Every parameter
    and the router's score bias are redrawn; MTP-layer tensors are appended for V3 variants
    that declare them, as real V3 checkpoints carry them."""
    from transformers import AutoConfig, AutoModelForCausalLM

    spec = {**TINY_BASE, **TINY_VARIANTS[variant]}
    if tokenizer is not None:
        spec.update(
            vocab_size=len(tokenizer),
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
        )
    config = AutoConfig.for_model(spec.pop("model_type"), **spec)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    for name, param in model.named_parameters():
        if "norm" in name:
            param.copy_(1.0 + 0.2 * torch.randn_like(param))
        else:
            param.normal_(0.0, 0.2)
    for name, buffer in model.named_buffers():
        if name.endswith("e_score_correction_bias"):
            buffer.normal_(0.0, 0.1)
    model.save_pretrained(path)
    if getattr(config, "num_nextn_predict_layers", 0):
        _append_mtp_tensors(path, config)
    if tokenizer is not None:
        tokenizer.save_pretrained(path)
    return model.eval()


def _append_mtp_tensors(path: Path, config) -> None:
    file = path / "model.safetensors"
    tensors = load_file(file)
    mtp = f"model.layers.{config.num_hidden_layers}"
    hidden = config.hidden_size
    tensors[f"{mtp}.eh_proj.weight"] = torch.randn(hidden, 2 * hidden)
    tensors[f"{mtp}.enorm.weight"] = torch.ones(hidden)
    tensors[f"{mtp}.self_attn.kv_b_proj.weight"] = torch.randn(8, 8)
    save_file(tensors, file, metadata={"format": "pt"})


class LatentPagedDriver(PagedModelDriver):
    """The paged test driver with each layer's own cache shape (one latent per token)."""

    def __init__(self, model: torch.nn.Module, block_size: int = 4, num_blocks: int = 64) -> None:
        self.model = model
        self.block_size = block_size
        self.backend = CPUAttentionBackend()
        self.layers = model.attention_layers()
        for layer in self.layers:
            layer.kv_cache = torch.full(layer.kv_cache_shape(num_blocks, block_size), float("nan"))
        self.free_blocks = list(range(num_blocks))
        random.Random(0).shuffle(self.free_blocks)
        self.block_tables = {}
        self.num_computed = {}


@pytest.fixture(scope="module", params=sorted(TINY_VARIANTS))
def model_pair(request, tmp_path_factory):
    """(HF model, our model loaded from its saved directory through the loader)."""
    path = tmp_path_factory.mktemp(request.param)
    hf_model = save_tiny_deepseek(request.param, path)
    return hf_model, load_ours(path)


def _prompts() -> list[list[int]]:
    generator = torch.Generator().manual_seed(7)
    return [torch.randint(0, VOCAB_SIZE, (n,), generator=generator).tolist() for n in PROMPT_LENS]


@torch.no_grad()
def _hf_logits(hf_model, prompt: Sequence[int]) -> torch.Tensor:
    return hf_model(torch.tensor([list(prompt)])).logits[0].float()


def test_packed_prefill_matches_hf(model_pair):
    hf_model, ours = model_pair
    prompts = _prompts()
    driver = LatentPagedDriver(ours)
    logits = driver.step([(f"r{i}", p) for i, p in enumerate(prompts)])
    for prompt, got in zip(prompts, logits):
        torch.testing.assert_close(got, _hf_logits(hf_model, prompt), atol=TOLERANCE, rtol=0)


def test_two_chunks_attend_to_cached_latents(model_pair):
    """The second step mixes prefill chunks (expanded form) and a one-token request (absorbed)."""
    hf_model, ours = model_pair
    prompts = _prompts()
    driver = LatentPagedDriver(ours)
    chunks = list(zip(prompts, FIRST_CHUNK_LENS))
    first = driver.step([(f"r{i}", p[:n]) for i, (p, n) in enumerate(chunks)])
    second = driver.step([(f"r{i}", p[n:]) for i, (p, n) in enumerate(chunks)])
    assert [len(p) - n for p, n in chunks].count(1) == 1
    for prompt, head, tail in zip(prompts, first, second):
        torch.testing.assert_close(
            torch.cat([head, tail]), _hf_logits(hf_model, prompt), atol=TOLERANCE, rtol=0
        )


def test_batched_decode_steps_match_hf(model_pair):
    """Prefill all but the last 4 tokens, then feed them one per step: every request decodes
    through the absorbed path, batched, at a different context length."""
    hf_model, ours = model_pair
    prompts = [p for p in _prompts() if len(p) > 4]
    driver = LatentPagedDriver(ours)
    driver.step([(f"r{i}", p[:-4]) for i, p in enumerate(prompts)])
    decoded: list[list[torch.Tensor]] = [[] for _ in prompts]
    for k in range(4, 0, -1):
        logits = driver.step([(f"r{i}", [p[-k]]) for i, p in enumerate(prompts)])
        for i, row in enumerate(logits):
            decoded[i].append(row[0])
    for prompt, rows in zip(prompts, decoded):
        expected = _hf_logits(hf_model, prompt)[-4:]
        torch.testing.assert_close(torch.stack(rows), expected, atol=TOLERANCE, rtol=0)


def test_model_shape_and_registry(model_pair):
    hf_model, ours = model_pair
    config = hf_model.config
    expected_class = (
        DeepseekV3ForCausalLM if config.model_type == "deepseek_v3" else DeepseekV2ForCausalLM
    )
    assert get_model_class(config) is expected_class
    layers = ours.attention_layers()
    assert [layer.layer_name for layer in layers] == [
        f"model.layers.{i}.self_attn.mla_attn" for i in range(config.num_hidden_layers)
    ]
    latent = config.kv_lora_rank + config.qk_rope_head_dim
    assert all(layer.kv_cache_shape(10, 4) == (10, 4, latent) for layer in layers)
    dense, *moe = ours.model.layers
    assert not hasattr(dense.mlp, "experts")
    assert all(layer.mlp.experts.w13_weight.shape[0] == config.n_routed_experts for layer in moe)


def test_dummy_weights_are_absorbed_and_run(model_pair, tmp_path):
    """load_format="dummy" skips load_weights: the loader still builds W_UK / W_UV."""
    hf_model, _ = model_pair
    hf_model.config.save_pretrained(tmp_path)
    ours = load_ours(tmp_path, load_format="dummy", seed=3)
    attn = ours.model.layers[0].self_attn
    per_head = attn.kv_b_proj.weight.view(attn.num_heads, -1, attn.kv_lora_rank)
    torch.testing.assert_close(attn.mla_attn.w_uk, per_head[:, : attn.qk_nope_head_dim])
    logits = LatentPagedDriver(ours).step([("r", [1, 2, 3])])[0]
    assert torch.isfinite(logits).all()


def test_stacked_expert_checkpoint_loads_the_same(tmp_path):
    """Experts stored as stacked 3D tensors load into the same parameters as per-expert ones;
    an unknown name and a missing expert are refused."""
    save_tiny_deepseek("v2-qlora-grouped", tmp_path)
    per_expert = load_file(tmp_path / "model.safetensors")
    ours = load_ours(tmp_path)
    stacked = dict(per_expert)
    for layer in (1, 2):
        prefix = f"model.layers.{layer}.mlp.experts"
        parts = {
            part: [stacked.pop(f"{prefix}.{e}.{part}_proj.weight") for e in range(8)]
            for part in ("gate", "up", "down")
        }
        stacked[f"{prefix}.gate_up_proj"] = torch.stack(
            [torch.cat([g, u]) for g, u in zip(parts["gate"], parts["up"])]
        )
        stacked[f"{prefix}.down_proj"] = torch.stack(parts["down"])
    other = DeepseekV2ForCausalLM(ours.config)
    other.load_weights(stacked.items())
    for (name, mine), (_, theirs) in zip(ours.named_parameters(), other.named_parameters()):
        torch.testing.assert_close(mine, theirs, atol=0, rtol=0, msg=name)
    with pytest.raises(ValueError, match="no matching model parameter"):
        other.load_weights([*per_expert.items(), ("model.layers.0.mlp.bogus.weight", None)])
    incomplete = {
        k: v for k, v in per_expert.items() if k != "model.layers.2.mlp.experts.5.up_proj.weight"
    }
    with pytest.raises(ValueError, match="experts.w13_weight"):
        other.load_weights(incomplete.items())


def test_greedy_through_llm_matches_hf_generate(tmp_path, default_tokenizer):
    from hf_reference import hf_greedy

    from v1_engine import LLM, SamplingParams

    hf_model = save_tiny_deepseek(
        "v3-yarn-grouped-mtp", tmp_path, seed=5, tokenizer=default_tokenizer
    )
    llm = LLM(
        model=str(tmp_path),
        max_model_len=128,
        num_kv_blocks=64,
        block_size=4,
        max_num_batched_tokens=16,
    )
    generator = torch.Generator().manual_seed(11)
    prompts = [
        torch.randint(3, hf_model.config.vocab_size, (n,), generator=generator).tolist()
        for n in (1, 6, 19, 30)
    ]
    params = SamplingParams(temperature=0.0, max_tokens=10, min_tokens=10)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    expected = [hf_greedy(hf_model, p, 10, exact=True) for p in prompts]
    assert [o.outputs[0].token_ids for o in outputs] == expected


def test_traces_as_one_graph_with_opaque_mla_and_moe_ops(tmp_path):
    """torch.compile(fullgraph=True) succeeds: the data-dependent MLA and MoE work sits behind
    their custom ops (fake impls give shapes), and the compiled model gives the same logits."""
    save_tiny_deepseek("v3-yarn-grouped-mtp", tmp_path)
    ours = load_ours(tmp_path)
    steps = [("a", [1, 2, 3, 4, 5]), ("b", [7])]
    eager = LatentPagedDriver(ours).step(steps)
    ours.forward = torch.compile(ours.forward, backend="aot_eager", fullgraph=True, dynamic=True)
    compiled = LatentPagedDriver(ours).step(steps)
    for want, got in zip(eager, compiled):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_latent_cache_defaults_to_64_token_blocks(tmp_path):
    """With no block_size asked for, a DeepSeek model's latent cache gets 64-token blocks (its
    decode kernel's page-tiled steps) and other models 16; an explicit size is kept."""
    from transformers import LlamaConfig

    from v1_engine.config import EngineConfig, default_block_size
    from v1_engine.engine.prepare import prepare_engine_config

    save_tiny_deepseek("v3-yarn-grouped-mtp", tmp_path)
    config = EngineConfig.from_kwargs(model=str(tmp_path))
    assert config.cache_config.block_size is None
    prepare_engine_config(config)
    assert config.cache_config.block_size == 64
    config = EngineConfig.from_kwargs(model=str(tmp_path), block_size=16)
    prepare_engine_config(config)
    assert config.cache_config.block_size == 16
    assert default_block_size(LlamaConfig()) == 16
