"""The sampled rows' hidden states: a step where every request samples its only token (decode)
takes hidden[:n] as a view instead of a gather kernel; any other step gathers. Both give the
same tokens and logprobs."""

from __future__ import annotations

import dataclasses

import pytest

from v1_engine import LLM, SamplingParams

PROMPTS = ["The capital of France is", "def fib(n):"]


@pytest.fixture(scope="module")
def llm():
    return LLM(max_model_len=128, num_kv_blocks=32, block_size=8, enable_prefix_caching=False)


def _generate(llm, force_gather: bool):
    runner = llm.engine_core.model_runner
    prepare = runner._prepare_inputs
    seen = []

    def recorded(so, req_ids):
        inputs = prepare(so, req_ids)
        seen.append((so.total_num_scheduled_tokens, len(req_ids), inputs.logits_prefix))
        if force_gather:
            inputs = dataclasses.replace(inputs, logits_prefix=None)
        return inputs

    runner._prepare_inputs = recorded
    try:
        params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=2)
        outputs = llm.generate(PROMPTS, params, use_tqdm=False)
    finally:
        runner._prepare_inputs = prepare
    result = [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outputs]
    return result, seen


def test_decode_steps_slice_and_match_the_gather(llm):
    sliced, seen = _generate(llm, force_gather=False)
    gathered, _ = _generate(llm, force_gather=True)
    assert sliced == gathered
    assert all(len(tokens) == 6 for tokens, _ in sliced)
    # The prefill step (two multi-token prompts) gathers; each decode step (one token per
    # request, all sampling) slices its first rows.
    assert seen[0][2] is None and seen[0][0] > len(PROMPTS)
    decode = [prefix for tokens, reqs, prefix in seen[1:] if tokens == reqs]
    assert decode and all(prefix == len(PROMPTS) for prefix in decode)


def test_decode_steps_carry_the_feed_per_row(llm):
    """A decode step feeds each request the token the previous step sampled for it: feed_rows
    (what the decode graph's input kernel reads) names, per token, its source row of those
    tokens, agreeing with the (feed_dst, feed_src) scatter the other paths use; a step with a
    multi-token request has none."""
    runner = llm.engine_core.model_runner
    prepare = runner._prepare_inputs
    seen = []

    def recorded(so, req_ids):
        inputs = prepare(so, req_ids)
        seen.append(inputs)
        return inputs

    runner._prepare_inputs = recorded
    try:
        params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
        llm.generate(PROMPTS, params, use_tqdm=False)
    finally:
        runner._prepare_inputs = prepare
    assert seen[0].feed_rows is None  # the prefill step
    fed = [inputs for inputs in seen[1:] if inputs.feed_dst is not None]
    assert len(fed) >= 3
    for inputs in fed:
        rows = inputs.feed_rows.tolist()
        assert len(rows) == inputs.metadata.num_actual_tokens == len(PROMPTS)
        want = [-1] * len(rows)
        for dst, src in zip(inputs.feed_dst.tolist(), inputs.feed_src.tolist()):
            want[dst] = src
        assert rows == want and -1 not in rows  # every request consumes its sampled token
