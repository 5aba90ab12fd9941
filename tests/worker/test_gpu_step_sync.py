"""A step launches without waiting for the device: with CUDA sync debugging set to "error",
every host sync inside `execute_model` that PyTorch sees (a blocking copy, `.item()`,
`nonzero`) raises. Such a sync makes the host wait for the previous step's kernels, so the GPU
idles while the next step is prepared; async scheduling only pays off without them.

Sync debugging sees only the syncs PyTorch makes itself, not a wait on an event recorded after
this step's work. So each checked step also starts behind a GPU sleep of about a tenth of a
second, and the stream must still be busy when `execute_model` returns: the host waited for
nothing queued after the previous step. The penalized requests run min_tokens, whose
suppressed tokens once went in with a blocking scalar copy; the constrained ones a grammar and a
logit bias."""

from __future__ import annotations

import pytest
import torch

from v1_engine import LLM, SamplingParams, StructuredOutputsParams

pytestmark = pytest.mark.gpu

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a", "1, 2, 3,"]
SLEEP_CYCLES = 200_000_000
"""About 0.1 s at the H100 / H200 clocks: far longer than a step's host work after warm-up."""


@pytest.mark.parametrize("level", [0, 2])
def test_steps_launch_without_a_host_sync(tiny_llama_dir, level):
    llm = LLM(
        str(tiny_llama_dir),
        dtype="bfloat16",
        max_model_len=128,
        num_kv_blocks=64,
        max_num_seqs=8,
        compilation_config=level,
    )
    runner = llm.engine_core.model_runner
    assert llm.engine_core.async_scheduling
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    sampled = SamplingParams(
        temperature=0.8, top_k=20, top_p=0.9, min_p=0.05, max_tokens=12, ignore_eos=True
    )
    # Penalties and min_tokens copy their own host tensors (token ids, suppressed pairs).
    penalized = SamplingParams(
        temperature=0.8,
        repetition_penalty=1.1,
        presence_penalty=0.5,
        frequency_penalty=0.2,
        min_tokens=12,
        stop_token_ids=[5],
        max_tokens=12,
        ignore_eos=True,
    )
    # A grammar's bitmask and a logit bias each copy a host tensor too (the bitmask is filled
    # after the previous step's tokens reached the host, which they have by then).
    constrained = SamplingParams(
        temperature=0.8,
        max_tokens=12,
        ignore_eos=True,
        logit_bias={7: 2.0, 11: -5.0},
        structured_outputs=StructuredOutputsParams(regex="[a-z ]+"),
    )
    # Warm-up, every kind of request once: a kernel's first launch loads its module (CUDA's lazy
    # loading), which may wait for the device; that is once per process, not per step.
    kinds = (greedy, sampled, penalized, constrained)
    for params in kinds:
        llm.generate(PROMPTS, params, use_tqdm=False)

    execute = runner.execute_model
    calls = []
    waited = []

    def checked(scheduler_output):
        torch.cuda._sleep(SLEEP_CYCLES)
        torch.cuda.set_sync_debug_mode("error")
        try:
            step = execute(scheduler_output)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        if torch.cuda.current_stream().query():  # the sleep is over: the host waited for it
            waited.append(scheduler_output.total_num_scheduled_tokens)
        calls.append(scheduler_output.total_num_scheduled_tokens)
        return step

    runner.execute_model = checked
    try:
        for params in kinds:
            outputs = llm.generate(PROMPTS, params, use_tqdm=False)
            assert [len(o.outputs[0].token_ids) for o in outputs] == [12] * len(PROMPTS)
    finally:
        runner.execute_model = execute
    # Both prefill steps and decode steps went through the check.
    assert max(calls) > len(PROMPTS) and min(calls) <= len(PROMPTS)
    assert not waited, f"{len(waited)} of {len(calls)} steps waited for the GPU (tokens: {waited})"
