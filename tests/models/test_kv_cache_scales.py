"""FP8 KV-cache scales from a checkpoint: the names quantizers write them under, the errors a bad
one gives, and that an fp8 cache quantizes with them (on the scaled-init tiny Llama of
model_helpers.save_scaled_tiny_llama)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from model_helpers import load_ours, save_scaled_tiny_llama
from safetensors.torch import load_file, save_file

PROMPT = list(range(3, 40, 3))


def _with_extra_tensors(src: Path, dst: Path, extra: dict[str, torch.Tensor]) -> Path:
    """A copy of the checkpoint at src with `extra` tensors added to its weights file."""
    shutil.copytree(src, dst)
    (weights_file,) = dst.glob("*.safetensors")
    tensors = load_file(weights_file)
    save_file({**tensors, **extra}, weights_file, metadata={"format": "pt"})
    return dst


def test_checkpoint_kv_cache_scales_set_the_attention_scales(scaled_dir, tmp_path):
    """Per-layer KV-cache scales in the three names quantizers write load into each layer's
    Attention.k_scale / v_scale; q/prob scales are ignored; a 16-bit model loads them too."""
    extra = {
        "model.layers.0.self_attn.k_scale": torch.tensor(0.25),
        "model.layers.0.self_attn.v_scale": torch.tensor([0.5]),
        "model.layers.1.self_attn.k_proj.output_scale": torch.tensor(2.0),
        "model.layers.1.self_attn.v_proj.output_scale": torch.tensor(4.0),
        "model.layers.1.self_attn.q_scale": torch.tensor(3.0),
    }
    path = _with_extra_tensors(scaled_dir, tmp_path / "kv-scales", extra)
    model = load_ours(path)
    scales = [(a.k_scale.item(), a.v_scale.item()) for a in model.attention_layers()]
    assert scales == [(0.25, 0.5), (2.0, 4.0)]

    legacy = _with_extra_tensors(
        scaled_dir, tmp_path / "legacy", {"model.layers.1.self_attn.kv_scale": torch.tensor(8.0)}
    )
    model = load_ours(legacy)
    assert [(a.k_scale.item(), a.v_scale.item()) for a in model.attention_layers()] == [
        (1.0, 1.0),
        (8.0, 8.0),
    ]


@pytest.mark.parametrize(
    ("value", "message"),
    [(torch.ones(2), "only one scale per layer"), (torch.tensor(-1.0), "positive finite")],
)
def test_bad_checkpoint_kv_cache_scale_names_the_weight(scaled_dir, tmp_path, value, message):
    name = "model.layers.0.self_attn.k_scale"
    path = _with_extra_tensors(scaled_dir, tmp_path / "bad", {name: value})
    with pytest.raises(ValueError, match=message) as info:
        load_ours(path)
    assert name in str(info.value)


def test_fp8_kv_cache_quantizes_with_the_checkpoint_scales(tmp_path, default_tokenizer):
    """With kv_cache_dtype fp8 the scales are what the cache write divides by: a scale far too
    small saturates every cached value at +-448 and the logits move far from the 16-bit
    cache's, while a fitting scale keeps them close."""
    from v1_engine import LLM, SamplingParams

    def first_logprobs(path: Path, kv_cache_dtype: str) -> dict[int, float]:
        llm = LLM(str(path), dtype="float32", kv_cache_dtype=kv_cache_dtype, max_model_len=64)
        params = SamplingParams(temperature=0.0, max_tokens=3, logprobs=5, ignore_eos=True)
        out = llm.generate([PROMPT], params, use_tqdm=False)[0].outputs[0]
        return {t: lp.logprob for t, lp in out.logprobs[-1].items()}

    def distance(a: dict[int, float], b: dict[int, float]) -> float:
        shared = set(a) & set(b)
        return max((abs(a[t] - b[t]) for t in shared), default=float("inf")) + len(set(a) ^ set(b))

    def scaled(name: str, value: float) -> Path:
        extra = {
            f"model.layers.{i}.self_attn.{kind}_scale": torch.tensor(value)
            for i in range(2)
            for kind in ("k", "v")
        }
        return _with_extra_tensors(base, tmp_path / name, extra)

    base = tmp_path / "base"
    save_scaled_tiny_llama(base, vocab_size=len(default_tokenizer), tokenizer=default_tokenizer)
    full = first_logprobs(base, "auto")
    fitting = first_logprobs(scaled("fitting", 0.05), "fp8")
    saturating = first_logprobs(scaled("saturating", 1e-6), "fp8")
    assert distance(fitting, full) < distance(saturating, full)
    assert distance(saturating, full) > 0.5
