"""On CUDA: the compiled forward (level 1) and the DeepSeek MLA/MoE model through the engine."""

from __future__ import annotations

import pytest
import torch
from hf_reference import hf_greedy, make_tiny_model
from test_deepseek_vs_hf import save_tiny_deepseek

from v1_engine import LLM, SamplingParams

pytestmark = pytest.mark.gpu


def _prompts(vocab_size: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(11)
    return [
        torch.randint(3, vocab_size, (n,), generator=generator).tolist() for n in (1, 6, 19, 30)
    ]


def test_compiled_forward_equals_eager_on_cuda(tmp_path, default_tokenizer):
    make_tiny_model("llama", tmp_path, default_tokenizer)
    params = SamplingParams(temperature=0.0, max_tokens=12, min_tokens=12)
    tokens = []
    for level in (0, 1):
        llm = LLM(
            str(tmp_path),
            dtype="float32",
            max_model_len=128,
            num_kv_blocks=64,
            compilation_config=level,
        )
        assert llm.engine_core.model_runner.device.type == "cuda"
        outputs = llm.generate(_prompts(1000), params, use_tqdm=False)
        tokens.append([o.outputs[0].token_ids for o in outputs])
        if level == 1:
            assert llm.engine_core.model_runner._forward.stats.num_traces == 1
    assert tokens[0] == tokens[1]


def test_deepseek_v3_greedy_on_cuda_matches_hf(tmp_path, default_tokenizer):
    hf_model = save_tiny_deepseek(
        "v3-yarn-grouped-mtp", tmp_path, seed=5, tokenizer=default_tokenizer
    )
    llm = LLM(
        model=str(tmp_path),
        dtype="float32",
        max_model_len=128,
        num_kv_blocks=64,
        block_size=4,
        max_num_batched_tokens=16,
    )
    assert llm.engine_core.model_runner.device.type == "cuda"
    prompts = _prompts(hf_model.config.vocab_size)
    params = SamplingParams(temperature=0.0, max_tokens=10, min_tokens=10)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    expected = [hf_greedy(hf_model, p, 10, exact=True) for p in prompts]
    assert [o.outputs[0].token_ids for o in outputs] == expected
