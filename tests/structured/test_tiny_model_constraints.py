"""Constraints hold whatever the model: a random-weight tiny Llama, whose unconstrained output
is noise, still produces only what each grammar allows and ends where the grammar ends. On the
CPU, and on a GPU at -O0 and -O2 (CUDA graphs, async scheduling: the bitmask is filled after
the previous step's tokens reach the host and applied outside the graph)."""

from __future__ import annotations

import json
import re

import pytest
import torch

from v1_engine import LLM, SamplingParams, StructuredOutputsParams

SCHEMA = {
    "type": "object",
    "properties": {
        "ok": {"type": "boolean"},
        "level": {"enum": ["low", "high"]},
        "code": {"type": "string", "pattern": "^[a-f]{2}$"},
    },
    "required": ["ok", "level", "code"],
    "additionalProperties": False,
}


def _run(llm: LLM) -> None:
    so = StructuredOutputsParams
    cases = [
        (so(json=SCHEMA), lambda t: set(json.loads(t)) == {"ok", "level", "code"}),
        (so(regex=r"[0-9]{3}-[A-Z]{2}"), lambda t: re.fullmatch(r"[0-9]{3}-[A-Z]{2}", t)),
        (so(choice=["alpha", "beta", "gamma delta"]), lambda t: t in ("alpha", "beta", "gamma delta")),
        (so(grammar='root ::= "(" [a-c] [a-c]? [a-c]? ")"'), lambda t: re.fullmatch(r"\([a-c]{1,3}\)", t)),
    ]  # fmt: skip
    prompts, params, checks = [], [], []
    for i, (spec, check) in enumerate(cases):
        for temperature in (0.0, 1.0):
            prompts.append(f"Request {i}:")
            params.append(
                SamplingParams(
                    temperature=temperature, seed=i, max_tokens=64, structured_outputs=spec
                )
            )
            checks.append(check)
    prompts.append("Unconstrained:")
    params.append(SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    outputs = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
    for out, check, p in zip(outputs, checks, params):
        assert out.finish_reason == "stop", (p.structured_outputs, out.text)
        assert check(out.text), (p.structured_outputs, out.text)
    assert len(outputs[-1].token_ids) == 8


def test_constraints_on_a_random_model_cpu(tiny_llama_dir):
    _run(LLM(str(tiny_llama_dir), max_model_len=256, num_kv_blocks=128))


@pytest.mark.gpu
@pytest.mark.parametrize("level", [0, 2])
def test_constraints_on_a_random_model_gpu(tiny_llama_dir, level):
    assert torch.cuda.is_available()
    llm = LLM(
        str(tiny_llama_dir),
        dtype="bfloat16",
        max_model_len=256,
        num_kv_blocks=128,
        max_num_seqs=16,
        compilation_config=level,
    )
    assert llm.engine_core.async_scheduling
    _run(llm)
    _run(llm)  # the grammars come from the compiler's cache the second time
