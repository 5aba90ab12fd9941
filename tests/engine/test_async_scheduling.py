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
        (o.outputs[0].token_ids, o.outputs[0].text, o.outputs[0].finish_reason,
         o.outputs[0].stop_reason, o.outputs[0].logprobs)
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
