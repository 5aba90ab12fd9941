"""The Llama-family model against Hugging Face transformers, on tiny random-weight models.

Prompts of different lengths run packed in one flat batch over a paged KV cache with
non-contiguous blocks; every position's logits must match HF's own forward.
"""

from __future__ import annotations

import pytest
import torch
from model_helpers import TINY_VARIANTS, PagedModelDriver, load_ours, save_tiny_hf_model

from v1_engine.models import resolve_model_path

PROMPT_LENS = (7, 2, 13, 24)
FIRST_CHUNK_LENS = (3, 1, 8, 5)
TOLERANCE = 1e-4


@pytest.fixture(scope="module", params=sorted(TINY_VARIANTS))
def model_pair(request, tmp_path_factory):
    """(HF model, our model loaded from its saved directory through the loader)."""
    path = tmp_path_factory.mktemp(request.param)
    hf_model = save_tiny_hf_model(request.param, path)
    return hf_model, load_ours(resolve_model_path(str(path)))


def _prompts(vocab_size: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(7)
    return [torch.randint(0, vocab_size, (n,), generator=generator).tolist() for n in PROMPT_LENS]


@torch.no_grad()
def _hf_logits(hf_model, prompt: list[int]) -> torch.Tensor:
    return hf_model(torch.tensor([prompt])).logits[0].float()


def test_packed_prefill_matches_hf(model_pair):
    hf_model, ours = model_pair
    prompts = _prompts(hf_model.config.vocab_size)
    driver = PagedModelDriver(ours, block_size=4)
    logits = driver.step([(f"r{i}", p) for i, p in enumerate(prompts)])
    for prompt, got in zip(prompts, logits):
        torch.testing.assert_close(got, _hf_logits(hf_model, prompt), atol=TOLERANCE, rtol=0)


def test_two_chunks_attend_to_cached_context(model_pair):
    hf_model, ours = model_pair
    prompts = _prompts(hf_model.config.vocab_size)
    driver = PagedModelDriver(ours, block_size=4)
    first = driver.step(
        [(f"r{i}", p[:n]) for i, (p, n) in enumerate(zip(prompts, FIRST_CHUNK_LENS))]
    )
    second = driver.step(
        [(f"r{i}", p[n:]) for i, (p, n) in enumerate(zip(prompts, FIRST_CHUNK_LENS))]
    )
    for prompt, head, tail in zip(prompts, first, second):
        torch.testing.assert_close(
            torch.cat([head, tail]), _hf_logits(hf_model, prompt), atol=TOLERANCE, rtol=0
        )


def test_tied_embeddings_share_one_tensor(model_pair):
    hf_model, ours = model_pair
    tied = ours.lm_head.weight is ours.model.embed_tokens.weight
    assert tied == hf_model.config.tie_word_embeddings
    torch.testing.assert_close(ours.lm_head.weight, hf_model.lm_head.weight, atol=0, rtol=0)


def test_attention_layers_in_order(model_pair):
    _, ours = model_pair
    names = [layer.layer_name for layer in ours.attention_layers()]
    assert names == ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"]


def test_greedy_decode_matches_hf_generate(tmp_path):
    from hf_reference import hf_greedy

    hf_model = save_tiny_hf_model("qwen3", tmp_path, seed=3)
    ours = load_ours(tmp_path)
    prompts = _prompts(hf_model.config.vocab_size)[:3]
    num_new = 8
    driver = PagedModelDriver(ours, block_size=4)
    outputs: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
    steps = [(f"r{i}", p) for i, p in enumerate(prompts)]
    for _ in range(num_new):
        logits = driver.step(steps)
        for (rid, _), req_logits in zip(steps, logits):
            outputs[rid].append(int(req_logits[-1].argmax()))
        steps = [(rid, [outputs[rid][-1]]) for rid, _ in steps]
    for i, prompt in enumerate(prompts):
        expected = hf_greedy(hf_model, prompt, num_new, exact=False)
        assert len(expected) == num_new, "the reference stopped early; pick another seed"
        assert outputs[f"r{i}"] == expected
