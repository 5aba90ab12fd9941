"""The model's generation_config.json: its EOS ids are stopped on (as stop tokens, unless
ignore_eos) and its sampling settings are the defaults of what leaves them unset (LLM without
sampling_params, server requests), as vLLM's --generation-config auto; "vllm" keeps the
engine's defaults, a folder replaces the model's file."""

from __future__ import annotations

import json

import pytest

from v1_engine import LLM, SamplingParams
from v1_engine.models.generation_config import GenerationDefaults, load_generation_defaults

PROMPT = "The capital of France is"
KWARGS = {"max_model_len": 256, "num_kv_blocks": 64}


def _folder(tmp_path, **config):
    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "generation_config.json").write_text(json.dumps(config))
    return str(tmp_path)


def test_the_file_gives_eos_ids_and_sampling(tmp_path):
    model = _folder(tmp_path / "model", eos_token_id=[2, 7], temperature=0.6, top_p=0.9,
                    top_k=20, max_new_tokens=64, do_sample=True, bos_token_id=1)  # fmt: skip
    sampling = {"temperature": 0.6, "top_p": 0.9, "top_k": 20, "max_tokens": 64}
    assert load_generation_defaults("auto", model) == GenerationDefaults((2, 7), sampling)
    assert load_generation_defaults("vllm", model) == GenerationDefaults((2, 7), {})
    other = _folder(tmp_path / "other", eos_token_id=5, min_p=0.1)
    assert load_generation_defaults(other, model) == GenerationDefaults((5,), {"min_p": 0.1})
    assert load_generation_defaults("auto", str(tmp_path)) == GenerationDefaults()  # no file
    with pytest.raises(ValueError, match="generation_config must be 'auto', 'vllm' or a folder"):
        LLM(generation_config=str(tmp_path / "missing"), **KWARGS)


@pytest.fixture(scope="module")
def greedy_tokens():
    llm = LLM(generation_config="vllm", **KWARGS)
    (out,) = llm.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False)
    return out.outputs[0].token_ids


def test_the_engine_stops_on_the_files_eos_ids_and_samples_its_way(tmp_path, greedy_tokens):
    # The file names the third greedy token an EOS and asks for greedy decoding, 6 tokens.
    eos = greedy_tokens[2]
    assert eos not in greedy_tokens[:2]
    folder = _folder(tmp_path, eos_token_id=[2, eos], temperature=0.0, max_new_tokens=6)
    llm = LLM(generation_config=folder, **KWARGS)
    assert llm.get_default_sampling_params() == SamplingParams(temperature=0.0, max_tokens=6)
    (stopped,) = llm.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False)  # fmt: skip
    out = stopped.outputs[0]
    assert out.token_ids == greedy_tokens[:3] and out.finish_reason == "stop"
    assert out.stop_reason == eos
    ignoring = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    (full,) = llm.generate(PROMPT, ignoring, use_tqdm=False)
    assert full.outputs[0].token_ids == greedy_tokens
    # No sampling_params: the file's (greedy, 6 tokens), with its EOS again.
    late = _folder(tmp_path / "late", eos_token_id=2, temperature=0.0, max_new_tokens=6)
    (default,) = LLM(generation_config=late, **KWARGS).generate(PROMPT, use_tqdm=False)
    assert default.outputs[0].token_ids == greedy_tokens[:6]
