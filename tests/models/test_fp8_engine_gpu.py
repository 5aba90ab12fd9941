"""Online FP8 models in the CUDA engine at -O2: greedy tokens against the eager FP8 model, and
the FP8 decode passes (fp8_gated_mlp, fp8_dynamic_linear, fp8_norm_linear) with forced launch
tables against the engine without them, on a tiny Llama whose every K is a multiple of 128."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from model_helpers import save_scaled_tiny_llama

PROMPT = list(range(3, 40, 3))


def save_cuda_sized_llama(path: Path, tokenizer) -> None:
    """hidden 256, head_dim 64, intermediate 384: every K a multiple of 128, as CUDA needs."""
    save_scaled_tiny_llama(
        path, hidden_size=256, intermediate_size=384, head_dim=64, vocab_size=len(tokenizer),
        tokenizer=tokenizer,
    )  # fmt: skip


ENGINE_PROMPTS = [PROMPT, PROMPT[:3], PROMPT[1:]]


def run_fp8_engines(path, pass_lists: list[list[str]]) -> tuple[list, dict, int]:
    """Greedy tokens of the FP8 model at -O2 for each list of fusion passes (one engine each),
    with the last engine's pass matches and its layer count."""
    from v1_engine import LLM, SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    kwargs = {"dtype": "bfloat16", "quantization": "fp8", "max_model_len": 128, "num_kv_blocks": 64}
    runs = []
    for passes in pass_lists:
        config = {"level": 2, "fusion_passes": passes}
        llm = LLM(str(path), compilation_config=config, max_num_seqs=4, **kwargs)
        outputs = llm.generate(ENGINE_PROMPTS, params, use_tqdm=False)
        runs.append([o.outputs[0].token_ids for o in outputs])
        matches = llm.engine_core.model_runner._forward.stats.pass_matches
        layers = llm.engine_core.model_runner.hf_config.num_hidden_layers
        del llm
        torch.cuda.empty_cache()
    return runs, matches, layers


def assert_tokens_follow(got: list, want: list) -> None:
    """The first token of every prompt agrees, and most of the rest: a dropped rounding can only
    flip near ties, after which the continuations differ."""
    assert [g[0] for g in got] == [w[0] for w in want]
    agree = sum(
        next((i for i, (a, b) in enumerate(zip(g, w)) if a != b), len(g)) for g, w in zip(got, want)
    )
    assert agree >= len(got) * 6, (got, want)


def set_table_entries(monkeypatch, entries) -> None:
    """FP8 decode table entries (kind, (N, K)) at M buckets 1..4, 128-deep K steps."""
    from v1_engine.kernels import fp8_launch

    for bucket in (1, 2, 4):
        for kind, shape in entries:
            key = (bucket, *shape)
            launch = fp8_launch.fp8_launch_config(kind, *key) | {"block_k": 128}
            monkeypatch.setitem(fp8_launch.FP8_TUNED_LAUNCH[kind], key, launch)


@pytest.mark.gpu
def test_fp8_model_compiled_with_graphs_on_cuda_follows_eager(tmp_path, default_tokenizer):
    """Online FP8 at -O2 (torch.compile + piecewise and decode CUDA graphs) on CUDA: the CUTLASS
    and Triton ops trace and capture, and greedy tokens follow the eager FP8 model's."""
    from v1_engine import LLM, SamplingParams

    save_cuda_sized_llama(tmp_path, default_tokenizer)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    prompts = [PROMPT, PROMPT[:3], PROMPT[1:]]
    kwargs = {"dtype": "bfloat16", "quantization": "fp8", "max_model_len": 128, "num_kv_blocks": 64}
    eager = LLM(str(tmp_path), enforce_eager=True, **kwargs)
    want = [o.outputs[0].token_ids for o in eager.generate(prompts, params, use_tqdm=False)]
    del eager
    llm = LLM(str(tmp_path), compilation_config=2, max_num_seqs=4, **kwargs)
    decode = llm.engine_core.model_runner.graphs.decode
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert decode is not None and decode.num_replays > 0
    assert_tokens_follow(got, want)  # bf16 activations: near ties may flip


@pytest.mark.gpu
def test_fp8_decode_ops_in_the_engine_follow_the_quantized_chain_gpu(
    tmp_path, default_tokenizer, monkeypatch
):
    """-O2 with the FP8 decode passes and table entries for this model's shapes at M 1..4
    (kernels/triton_gemv_fp8_decode.py's "weight_only" and "gated" kinds): the decode graphs run the
    kernels that skip the activation quant, and the greedy tokens follow the engine without
    the decode passes."""
    from v1_engine.config import CompilationConfig
    from v1_engine.kernels import triton_gemv_fp8_decode as decode

    save_cuda_sized_llama(tmp_path, default_tokenizer)
    calls = {"fp8_weight_only_gemm": 0, "fp8_gated_gemm": 0}
    for name in calls:
        kernel = getattr(decode, name)

        def counted(*args, _kernel=kernel, _name=name, **kwargs):
            calls[_name] += 1
            return _kernel(*args, **kwargs)

        monkeypatch.setattr(decode, name, counted)
    # o_proj, down, gate_up
    entries = [("weight_only", (256, 256)), ("weight_only", (256, 384)), ("gated", (768, 256))]
    set_table_entries(monkeypatch, entries)
    decode_passes = ["fp8_gated_mlp", "fp8_dynamic_linear"]
    chain = [
        p
        for p in CompilationConfig().effective_fusion_passes("cuda")
        if p not in decode_passes and p != "fp8_norm_linear"
    ]
    (want, got), matches, layers = run_fp8_engines(tmp_path, [chain, chain + decode_passes])
    assert matches["fp8_gated_mlp"] == layers and matches["fp8_dynamic_linear"] == layers
    assert calls["fp8_gated_gemm"] > 0 and calls["fp8_weight_only_gemm"] > 0
    assert_tokens_follow(got, want)


@pytest.mark.gpu
def test_fp8_norm_linear_in_the_engine_follows_the_quantized_chain_gpu(
    tmp_path, default_tokenizer, monkeypatch
):
    """-O2 with the default passes (fp8_norm_linear among them) against them without it, with
    table entries for this model's shapes at M 1..4 ("norm" for qkv, "norm_gated" for gate_up,
    "weight_only" for down): the decode graphs fold every residual add + RMSNorm into the GEMM
    after it, and the greedy tokens follow the engine without the pass."""
    import json

    from v1_engine.config import CompilationConfig
    from v1_engine.kernels import triton_gemv_fp8_decode as decode

    save_cuda_sized_llama(tmp_path, default_tokenizer)
    config = json.loads((tmp_path / "config.json").read_text())
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    qkv_rows = (heads + 2 * kv_heads) * config["head_dim"]
    calls = {"gated": 0, "plain": 0}
    kernel = decode.fp8_add_norm_gemm

    def counted(*args, **kwargs):
        calls["gated" if kwargs.get("gated") else "plain"] += 1
        return kernel(*args, **kwargs)

    monkeypatch.setattr(decode, "fp8_add_norm_gemm", counted)
    entries = [("norm", (qkv_rows, 256)), ("norm_gated", (768, 256)), ("weight_only", (256, 384))]
    set_table_entries(monkeypatch, entries)
    default = CompilationConfig().effective_fusion_passes("cuda")
    assert "fp8_gated_mlp" in default and "fp8_norm_linear" in default
    chain = [name for name in default if name != "fp8_norm_linear"]
    (want, got), matches, layers = run_fp8_engines(tmp_path, [chain, default])
    assert matches["fp8_norm_linear"] == 2 * layers - 1  # all but layer 0's input norm
    assert calls["plain"] > 0 and calls["gated"] > 0
    assert_tokens_follow(got, want)
