"""GPU A/B helpers for fusion passes: one engine per pass list on a 2-layer model of
Llama-3-8B's widths (dummy weights, bf16, -O2), where the skinny kernels and the decode fusions
really run, compared on greedy tokens and their logprobs."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from v1_engine import LLM, SamplingParams

ROOT = Path(__file__).resolve().parents[2]


def llama8b_widths_dir(path: Path, tokenizer, layers: int = 2) -> Path:
    config = json.loads((ROOT / "benchmarks/configs/llama3-8b/config.json").read_text())
    config["num_hidden_layers"] = layers
    (path / "config.json").write_text(json.dumps(config))
    tokenizer.save_pretrained(path)
    return path


def greedy_runs(model_dir: Path, pass_lists: list[list[str]], **llm_kwargs) -> list[tuple]:
    """For each pass list: (completions of 3 prompts batched then the first alone, the
    engine's pass match counts)."""
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(10, 100000, (n,), generator=gen).tolist() for n in (3, 17, 40)]
    # top 5: a disagreement then says whether it was a near-tie (see assert_same_greedy)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=5)
    runs = []
    for passes in pass_lists:
        llm = LLM(
            str(model_dir),
            dtype="bfloat16",
            load_format="dummy",
            max_model_len=128,
            num_kv_blocks=64,
            max_num_seqs=4,
            compilation_config={"level": 2, "fusion_passes": passes},
            **llm_kwargs,
        )
        matches = dict(llm.engine_core.model_runner._forward.stats.pass_matches)
        outs = llm.generate(prompts, params, use_tqdm=False)
        outs += llm.generate(prompts[:1], params, use_tqdm=False)
        runs.append(([o.outputs[0] for o in outs], matches))
        del llm
        torch.cuda.empty_cache()
    return runs


def assert_same_greedy(got: list, want: list, min_agree: int = 4, tol: float = 0.05) -> None:
    """Same tokens for at least `min_agree` steps of each completion, with logprobs within `tol`
    while they agree. An earlier flip passes only as a near-tie (dummy weights leave tokens one
    bf16 rounding of a logit apart, which any reordered sum flips): both tokens in both runs'
    top 5, each token's logprob the same in both runs within `tol`, and the two within `tol` of
    each other in each run. A wrong result shows a gap or a token missing from a top 5."""
    for a, b in zip(got, want):
        agree = next(
            (i for i, (x, y) in enumerate(zip(a.token_ids, b.token_ids)) if x != y),
            len(b.token_ids),
        )
        if agree < min_agree:
            flip = (a.token_ids, b.token_ids, _disagreement(a, b, agree))
            assert _near_tie(a, b, agree, tol), flip
        for step in range(agree):
            token = a.token_ids[step]
            la, lb = a.logprobs[step][token].logprob, b.logprobs[step][token].logprob
            assert abs(la - lb) < tol, (step, la, lb)


def _near_tie(got, want, step: int, tol: float) -> bool:
    """Whether the flip at `step` is a near-tie (see assert_same_greedy)."""
    tokens = (got.token_ids[step], want.token_ids[step])
    tops = (got.logprobs[step], want.logprobs[step])
    if any(token not in top for token in tokens for top in tops):
        return False
    same = all(abs(tops[0][t].logprob - tops[1][t].logprob) < tol for t in tokens)
    close = all(abs(top[tokens[0]].logprob - top[tokens[1]].logprob) < tol for top in tops)
    return same and close


def _disagreement(got, want, step: int) -> str:
    """Each side's top-5 logprobs of both tokens at the first step where they differ: a gap
    within bf16 roundings means a near-tie that any reordered sum flips, a large one a wrong
    result."""
    x, y = got.token_ids[step], want.token_ids[step]

    def logprob(completion, token: int) -> str:
        entry = completion.logprobs[step].get(token)
        return "not in top 5" if entry is None else f"{entry.logprob:.4f}"

    return (
        f"step {step}: got {x} (got's logprob {logprob(got, x)}, want's {logprob(want, x)}), "
        f"want {y} (got's logprob {logprob(got, y)}, want's {logprob(want, y)})"
    )
