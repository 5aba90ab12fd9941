"""Speculative decoding with n-gram drafts: the proposer, the acceptance rule, the config, and
the default model end to end on the CPU (in process and in a real engine-core process), where
output with drafts must equal output without them token for token."""

from __future__ import annotations

import asyncio
import json
import re

import numpy as np
import pytest

from v1_engine import LLM, AsyncEngine, SamplingParams, StructuredOutputsParams
from v1_engine.config import EngineConfig
from v1_engine.entrypoints.cli import engine_kwargs, make_parser
from v1_engine.metrics.base import StatLoggerBase
from v1_engine.spec_decode.draft_counter import DraftCounter
from v1_engine.spec_decode.ngram import DraftBackoff, propose_ngram
from v1_engine.spec_decode.verify import accept_drafts

SPEC = {"method": "ngram", "num_speculative_tokens": 4}
CODE = (
    "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\n"
    "def mul(a, b):\n    return a * b\n"
)
PROMPTS = [
    "Here is some code:\n" + CODE + "\nRewrite the code above with type hints:\n",
    "Write the numbers from 1 to 30 separated by commas.",
    "Repeat after me three times: the quick brown fox jumps over the lazy dog.",
    "Tell me about the ocean.",
]
ENGINE_KWARGS = {"max_model_len": 1024, "num_kv_blocks": 256}


# --- the proposer and the acceptance rule ----------------------------------------------------


def propose(tokens: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    return propose_ngram(np.array(tokens, dtype=np.int64), min_n, max_n, k).tolist()


def reference_propose(tokens: np.ndarray, min_n: int, max_n: int, num_drafts: int) -> np.ndarray:
    """propose_ngram's rule with vectorized numpy (the first implementation): each occurrence of
    the last token extended backwards to its match length."""
    length = len(tokens)
    if num_drafts < 1 or length < min_n + 1:
        return tokens[:0]
    ends = np.flatnonzero(tokens[: length - 1] == tokens[length - 1])
    if not len(ends):
        return tokens[:0]
    max_n = min(max_n, length - 1)
    match_len = np.ones(len(ends), dtype=np.int64)
    alive = np.ones(len(ends), dtype=bool)
    for j in range(1, max_n):
        starts = ends - j
        ok = alive & (starts >= 0)
        ok[ok] = tokens[starts[ok]] == tokens[length - 1 - j]
        match_len += ok
        alive = ok
        if not alive.any():
            break
    best = int(match_len.max())
    if best < min_n:
        return tokens[:0]
    candidates = ends[match_len == best]
    full = candidates[candidates + num_drafts < length]
    end = int(full[-1] if len(full) else candidates[-1])
    return tokens[end + 1 : end + 1 + num_drafts]


def test_the_bytes_search_proposes_what_the_numpy_rule_does():
    """Random token runs over small vocabularies (many matches, runs, suffixes near the start),
    and tokens whose bytes repeat across token boundaries (256 + 1 = 0x0101: a byte pattern may
    match misaligned)."""
    rng = np.random.default_rng(3)
    cases = 0
    for trial in range(3000):
        vocab = [2, 3, 5, 50, 257][trial % 5]
        length = int(rng.integers(1, 60))
        tokens = rng.integers(0, vocab, length).astype(np.int64)
        if vocab == 257:
            tokens = np.where(tokens % 2 == 0, 257, 1).astype(np.int64)
        if trial % 7 == 0:
            tokens = tokens.astype(np.int32)
        min_n = int(rng.integers(1, 4))
        max_n = int(rng.integers(min_n, 6))
        k = int(rng.integers(0, 7))
        got = propose_ngram(tokens, min_n, max_n, k)
        want = reference_propose(tokens, min_n, max_n, k)
        assert got.tolist() == want.tolist(), (tokens.tolist(), min_n, max_n, k)
        cases += bool(len(want))
    assert cases > 1000  # most cases propose something


def test_the_longest_suffix_match_proposes_what_followed_it():
    tokens = [5, 1, 2, 3, 9, 9, 7, 2, 3, 4, 8, 1, 2, 3]
    # [1, 2, 3] ends the tokens and occurred at 1..3: what followed it is the draft.
    assert propose(tokens, 2, 4, 4) == [9, 9, 7, 2]
    # Only 2-grams: [2, 3] occurred at 2..3 and 7..8; the later one has 4 tokens after it.
    assert propose(tokens, 2, 2, 4) == [4, 8, 1, 2]
    assert propose(tokens, 2, 2, 5) == [4, 8, 1, 2, 3]
    # Six drafts: only the earlier occurrence has six tokens after it.
    assert propose(tokens, 2, 2, 6) == [9, 9, 7, 2, 3, 4]
    # The longest match (3) is shorter than prompt_lookup_min: nothing.
    assert propose(tokens, 4, 5, 4) == []


def test_no_match_or_too_few_tokens_proposes_nothing():
    assert propose([1, 2, 3, 4], 1, 3, 4) == []
    assert propose([7, 7], 2, 3, 4) == []  # a 2-gram needs an earlier occurrence
    assert propose([7, 7], 1, 3, 4) == [7]  # the run: 7 followed 7
    assert propose([1, 2, 1, 2], 2, 4, 0) == []


def test_kept_tokens_stop_at_the_first_wrong_draft():
    assert accept_drafts([5, 6, 7], [5, 6]) == [5, 6, 7]  # both right: the bonus token too
    assert accept_drafts([5, 6, 7], [5, 9]) == [5, 6]  # the model's own token replaces 9
    assert accept_drafts([4, 6, 7], [5, 6]) == [4]
    assert accept_drafts([4], []) == [4]
    with pytest.raises(AssertionError):
        accept_drafts([4, 5], [1, 2])


def test_backoff_skips_drafts_after_failures_and_resets_on_a_kept_one():
    backoff = DraftBackoff(max_pause=4)

    def steps(n: int) -> list[bool]:
        return [backoff.allow() for _ in range(n)]

    backoff.record(4, 0)  # one miss: draft again at once
    assert steps(1) == [True]
    backoff.record(0, 0)  # a step without drafts changes nothing
    backoff.record(4, 0)  # two misses in a row: skip 1
    assert steps(2) == [False, True]
    backoff.record(3, 0)  # three: skip 2
    assert steps(3) == [False, False, True]
    backoff.record(4, 0)
    assert steps(5) == [False] * 4 + [True]
    backoff.record(4, 0)  # capped at max_pause
    assert steps(5) == [False] * 4 + [True]
    backoff.record(4, 1)  # a kept draft resets: the next miss pauses nothing
    backoff.record(4, 0)
    assert steps(1) == [True]
    off = DraftBackoff(max_pause=0)
    for _ in range(5):
        off.record(4, 0)
    assert off.allow()


# --- the config --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ({"method": "eagle"}, r"speculative_config.method must be one of \(None, 'ngram'\)"),
        ({"method": "ngram"}, r"num_speculative_tokens must be an int in \[1, 16\], got None"),
        ({"method": "ngram", "num_speculative_tokens": 17}, r"in \[1, 16\], got 17"),
        ({"num_speculative_tokens": 3}, "num_speculative_tokens needs a method"),
        (
            {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 5},
            r"prompt_lookup_min \(5\) must be <= prompt_lookup_max \(4\)",
        ),
        ({"method": "ngram", "num_speculative_tokens": 2, "lookahead": 1}, "unknown .*lookahead"),
        (
            {"method": "ngram", "num_speculative_tokens": 2, "draft_backoff": -1},
            r"speculative_config.draft_backoff must be an int >= 0, got -1",
        ),
        ("ngram", "speculative_config must be a dict"),
    ],
)
def test_bad_speculative_config_is_refused_by_name(value, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig.from_kwargs(speculative_config=value)


def test_async_scheduling_cannot_be_forced_with_drafts():
    with pytest.raises(ValueError, match="async_scheduling cannot be combined"):
        EngineConfig.from_kwargs(speculative_config=SPEC, async_scheduling=True)


def test_cli_flag_reaches_the_engine_config():
    args = make_parser().parse_args(["--speculative-config", json.dumps(SPEC)])
    config = EngineConfig.from_kwargs(**engine_kwargs(args))
    assert config.speculative_config.method == "ngram"
    assert config.speculative_config.num_speculative_tokens == 4
    assert not EngineConfig.from_kwargs(
        **engine_kwargs(make_parser().parse_args([]))
    ).speculative_config.enabled
    with pytest.raises(SystemExit):
        make_parser().parse_args(["--speculative-config", "[1]"])


# --- the default model, in process -----------------------------------------------------------


@pytest.fixture(scope="module")
def plain():
    return LLM(**ENGINE_KWARGS)


@pytest.fixture(scope="module")
def spec():
    llm = LLM(speculative_config=SPEC, **ENGINE_KWARGS)
    assert not llm.engine_core.async_scheduling
    return llm


def _free_blocks(llm: LLM) -> int:
    return llm.engine_core.scheduler.kv_cache_manager.num_free_blocks


def _cases(plain: LLM) -> tuple[list[str], list[SamplingParams]]:
    """Every prompt greedy, then the sampling features that read the drafts as outputs."""
    greedy = SamplingParams(temperature=0.0, max_tokens=72)
    code_tokens = plain.generate(PROMPTS[:1], greedy, use_tqdm=False)[0].outputs[0].token_ids
    prompts = list(PROMPTS) + [PROMPTS[0]] * 5 + [PROMPTS[3]]
    params = [greedy] * len(PROMPTS) + [
        SamplingParams(temperature=0.0, max_tokens=48, repetition_penalty=1.2, frequency_penalty=0.3),
        # Random sampling with top_k=1 is deterministic: the random path's rows must line up.
        SamplingParams(temperature=0.8, top_k=1, max_tokens=48, presence_penalty=0.5),
        SamplingParams(temperature=0.0, max_tokens=40, logprobs=3),
        # Stops on a token the greedy output reaches a third of the way in, mid-verify.
        SamplingParams(temperature=0.0, max_tokens=72, stop_token_ids=[code_tokens[25]]),
        SamplingParams(temperature=0.0, max_tokens=7),
        # min_tokens holds EOS back at every draft position too.
        SamplingParams(temperature=0.0, max_tokens=40, min_tokens=30),
    ]  # fmt: skip
    return prompts, params


def test_greedy_output_is_the_output_without_drafts(plain, spec):
    prompts, params = _cases(plain)
    expected = plain.generate(prompts, params, use_tqdm=False)
    counter = DraftCounter(spec)
    got = spec.generate(prompts, params, use_tqdm=False)
    for e, g, p in zip(expected, got, params):
        assert g.outputs[0].token_ids == e.outputs[0].token_ids, (g.prompt[:30], p)
        assert g.outputs[0].finish_reason == e.outputs[0].finish_reason
        assert g.outputs[0].text == e.outputs[0].text
    # Logprobs of drafted tokens come from the verify step's rows: the same values.
    e_lp, g_lp = expected[6].outputs[0].logprobs, got[6].outputs[0].logprobs
    assert len(g_lp) == len(e_lp) == 40
    for e_row, g_row in zip(e_lp, g_lp):
        assert list(g_row) == list(e_row)
        for token_id in e_row:
            assert g_row[token_id].logprob == pytest.approx(e_row[token_id].logprob, abs=1e-4)
            assert g_row[token_id].rank == e_row[token_id].rank
    stopped = got[7].outputs[0]
    assert stopped.finish_reason == "stop" and len(stopped.token_ids) <= 26
    assert len(got[9].outputs[0].token_ids) >= 30
    # The drafts were used: many verified, a good share kept, so fewer steps than tokens.
    assert counter.drafts > 20
    assert counter.accepted > 0.3 * counter.draft_tokens
    assert _free_blocks(spec) == spec.engine_core.num_kv_blocks


def test_min_tokens_counts_the_drafts_before_each_position(plain, spec):
    """Forced by logit_bias, the output is a pure function of min_tokens, and its repeats are
    drafted: a verify position that did not count the drafts before it as outputs would hold
    EOS back too long (penalties read the same per-position outputs)."""
    x = 3458
    eos = spec.get_tokenizer().eos_token_id
    counter = DraftCounter(spec)
    for min_tokens in (9, 13, 14):
        # EOS leads X but is held back for min_tokens tokens: X x min_tokens, then EOS.
        held = SamplingParams(
            temperature=0.0, max_tokens=40, logit_bias={eos: 100.0, x: 60.0}, min_tokens=min_tokens
        )
        for llm in (plain, spec):
            outputs = llm.generate(["Hello"], held, use_tqdm=False)
            assert outputs[0].outputs[0].token_ids == [x] * min_tokens + [eos]
    assert counter.accepted > 10


def test_chunked_prefill_and_a_small_budget(plain):
    """Prompts chunked over steps of 24 tokens; drafts cut to what the budget leaves."""
    llm = LLM(speculative_config=SPEC, max_num_batched_tokens=24, **ENGINE_KWARGS)
    params = SamplingParams(temperature=0.0, max_tokens=40)
    expected = plain.generate(PROMPTS, params, use_tqdm=False)
    counter = DraftCounter(llm)
    got = llm.generate(PROMPTS, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in expected]
    assert counter.accepted > 0
    assert _free_blocks(llm) == llm.engine_core.num_kv_blocks


def test_seeded_sampling_does_not_depend_on_the_batch(spec):
    """A seeded request's draws come from its own generator, a row per verified position: its
    tokens are the same alone or among others (and drafts are kept at temperature 0.7)."""
    seeded = SamplingParams(temperature=0.7, seed=11, max_tokens=48)
    alone = spec.generate(PROMPTS[:1], seeded, use_tqdm=False)[0].outputs[0].token_ids
    counter = DraftCounter(spec)
    others = SamplingParams(temperature=1.0, max_tokens=30)
    batch = spec.generate(PROMPTS, [seeded, others, others, others], use_tqdm=False)
    assert batch[0].outputs[0].token_ids == alone
    assert counter.accepted > 0


def test_grammar_requests_verify_only_drafts_their_grammar_allows(plain, spec):
    """A constrained request is drafted too (the drafts cut where its grammar refuses them, the
    matcher rolled back after each verify); output and constraint as without drafts."""
    scheduler = spec.engine_core.scheduler
    drafted: dict[str, int] = {}
    original = scheduler.schedule

    def recording():
        output = original()
        for req_id, drafts in output.scheduled_spec_token_ids.items():
            drafted[req_id] = drafted.get(req_id, 0) + len(drafts)
        return output

    so = StructuredOutputsParams
    regex = r"(def [a-z]{3}\(\): pass\n){4}"
    item = {
        "type": "object",
        "properties": {"fruit": {"enum": ["apple", "pear"]}, "ripe": {"type": "boolean"}},
        "required": ["fruit", "ripe"],
    }
    schema = {"type": "array", "items": item, "minItems": 4, "maxItems": 4}
    params = [
        SamplingParams(temperature=0.0, max_tokens=60, structured_outputs=so(regex=regex)),
        SamplingParams(temperature=0.0, max_tokens=140, structured_outputs=so(json=schema)),
        SamplingParams(temperature=0.0, max_tokens=40),
    ]
    expected = plain.generate(PROMPTS[:3], params, use_tqdm=False)
    scheduler.schedule = recording
    try:
        outputs = spec.generate(PROMPTS[:3], params, use_tqdm=False)
    finally:
        scheduler.schedule = original
    assert [o.outputs[0].token_ids for o in outputs] == [o.outputs[0].token_ids for o in expected]
    assert re.fullmatch(regex, outputs[0].outputs[0].text)
    fruits = json.loads(outputs[1].outputs[0].text)
    assert len(fruits) == 4 and all(set(f) == {"fruit", "ripe"} for f in fruits)
    assert drafted.get(outputs[0].request_id, 0) > 0
    assert drafted.get(outputs[1].request_id, 0) > 0


# --- the default model in an engine-core process -----------------------------------------------


class SpecStats(StatLoggerBase):
    def __init__(self) -> None:
        self.draft_tokens = self.accepted = 0

    def record(self, scheduler_stats, outputs, now) -> None:
        if scheduler_stats is not None:
            self.draft_tokens += scheduler_stats.spec_num_draft_tokens
            self.accepted += scheduler_stats.spec_num_accepted_tokens


def test_async_engine_streams_drafted_tokens_from_the_core_process(plain):
    stats = SpecStats()
    params = SamplingParams(temperature=0.0, max_tokens=60)
    expected = [o.outputs[0].token_ids for o in plain.generate(PROMPTS, params, use_tqdm=False)]

    async def run():
        async with AsyncEngine(
            stat_loggers=[stats], speculative_config=SPEC, **ENGINE_KWARGS
        ) as engine:

            async def one(i: int) -> tuple[list[int], int]:
                tokens, deltas = [], 0
                async for out in engine.generate(PROMPTS[i], params, f"r{i}"):
                    tokens.extend(out.outputs[0].token_ids)
                    deltas += 1
                return tokens, deltas

            return await asyncio.gather(*(one(i) for i in range(len(PROMPTS))))

    results = asyncio.run(run())
    assert [tokens for tokens, _ in results] == expected
    # Kept drafts arrive together: the code prompt streams fewer deltas than tokens.
    code_tokens, code_deltas = results[0]
    assert code_deltas < len(code_tokens)
    assert stats.accepted > 0 and stats.draft_tokens >= stats.accepted
