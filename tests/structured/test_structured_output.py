"""Structured outputs: the spec checks, the bitmask against xgrammar's own, a matcher across
steps, and the default model constrained end to end (offline and through the core process)."""

from __future__ import annotations

import asyncio
import json
import re
from concurrent.futures import Future

import pytest
import torch

from v1_engine import LLM, SamplingParams
from v1_engine.sample.metadata import SamplingMetadata
from v1_engine.sample.sampler import Sampler
from v1_engine.structured_output import (
    BITS,
    GrammarCompilerService,
    RequestGrammar,
    StructuredOutputsParams,
    allocate_bitmask,
    apply_token_bitmask,
)

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "city": {"enum": ["Paris", "London", "Rome"]},
    },
    "required": ["name", "age", "city"],
    "additionalProperties": False,
}


# ---- the spec ----------------------------------------------------------------------------


def test_spec_takes_exactly_one_constraint() -> None:
    assert StructuredOutputsParams(json=PERSON).spec() == ("json", json.dumps(PERSON))
    assert StructuredOutputsParams(json_object=True).spec() == ("json_object", "")
    assert StructuredOutputsParams(regex="a+").spec() == ("regex", "a+")
    kind, text = StructuredOutputsParams(choice=["yes", 'say "no"']).spec()
    assert kind == "grammar" and text == 'root ::= "yes" | "say \\"no\\""'
    with pytest.raises(ValueError, match="exactly one of json, json_object, regex, choice"):
        StructuredOutputsParams().spec()
    with pytest.raises(ValueError, match=r"got \['choice', 'regex'\]"):
        StructuredOutputsParams(regex="a", choice=["b"]).spec()


@pytest.mark.parametrize(
    ("params", "message"),
    [
        ({"json": "{not json"}, "structured_outputs.json is not valid JSON"),
        ({"json": {"type": "objekt"}}, "structured_outputs.json is not a JSON schema it supports"),
        ({"regex": "(ab"}, "structured_outputs.regex is not a regular expression"),
        ({"grammar": "root ::= missing"}, "structured_outputs.grammar is not a grammar"),
        ({"grammar": ""}, "structured_outputs.grammar must be a non-empty string"),
        ({"choice": []}, "structured_outputs.choice must be a non-empty list"),
        ({"choice": ["a", ""]}, "structured_outputs.choice must be a non-empty list"),
    ],
)
def test_bad_specs_name_their_field(params: dict, message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        SamplingParams(structured_outputs=StructuredOutputsParams(**params)).verify()


# ---- the bitmask -------------------------------------------------------------------------


def apply_token_bitmask_ref(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """The oracle: unpack each int32 word's bits (bit i of word w = token 32 w + i)."""
    vocab = logits.shape[-1]
    shifts = torch.arange(BITS, dtype=torch.int32, device=bitmask.device)
    allowed = ((bitmask.unsqueeze(-1) >> shifts) & 1).flatten(1)[:, :vocab]
    return logits.masked_fill(allowed == 0, float("-inf"))


@pytest.mark.parametrize("vocab", [32, 70, 1000, 49152])
def test_bitmask_apply_matches_the_reference(vocab: int) -> None:
    gen = torch.Generator().manual_seed(vocab)
    bitmask = torch.randint(-(2**31), 2**31, (3, -(-vocab // BITS)), generator=gen)
    bitmask = bitmask.to(torch.int32)
    logits = torch.randn(3, vocab, generator=gen)
    expected = apply_token_bitmask_ref(logits, bitmask)
    assert torch.isneginf(expected).any() and torch.isfinite(expected).any()
    assert torch.equal(apply_token_bitmask(logits.clone(), bitmask), expected)
    assert torch.equal(apply_token_bitmask(logits.clone(), allocate_bitmask(3, vocab)), logits)


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 5, 64])
def test_bitmask_apply_on_cuda(rows: int) -> None:
    vocab = 128256  # Llama-3's
    gen = torch.Generator().manual_seed(rows)
    bitmask = torch.randint(-(2**31), 2**31, (rows, vocab // BITS), generator=gen)
    bitmask = bitmask.to(torch.int32)
    logits = torch.randn(rows, vocab, generator=gen)
    expected = apply_token_bitmask_ref(logits, bitmask)
    result = apply_token_bitmask(logits.cuda(), bitmask.cuda())
    assert torch.equal(result.cpu(), expected)


def test_a_grammar_that_fails_to_compile_allows_only_eos() -> None:
    failed: Future = Future()
    failed.set_exception(RuntimeError("boom"))
    for eos in (0, 31, 63, 95):  # bit 31 is the int32 sign bit
        grammar = RequestGrammar(failed, eos_token_id=eos)
        bitmask = allocate_bitmask(2, 100)
        grammar.fill_bitmask([], bitmask, 1)
        logits = apply_token_bitmask(torch.zeros(2, 100), bitmask)
        assert torch.isfinite(logits[0]).all()
        assert torch.isfinite(logits[1]).nonzero().flatten().tolist() == [eos]


@pytest.fixture(scope="module")
def compiler(default_model_dir) -> GrammarCompilerService:
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(default_model_dir).vocab_size
    return GrammarCompilerService(default_model_dir, vocab)


def test_matcher_follows_the_outputs_it_is_given(compiler, default_tokenizer) -> None:
    """Tokens accepted lazily, step by step, leave exactly the grammar's continuations."""
    params = StructuredOutputsParams(choice=[" Paris", " Rome"])
    future = compiler.submit(params)
    assert compiler.submit(StructuredOutputsParams(choice=[" Paris", " Rome"])) is future
    grammar = RequestGrammar(future, default_tokenizer.eos_token_id)
    vocab = compiler.vocab_size
    paris = default_tokenizer.encode(" Paris", add_special_tokens=False)
    rome = default_tokenizer.encode(" Rome", add_special_tokens=False)
    bitmask = allocate_bitmask(1, vocab)
    grammar.fill_bitmask([], bitmask, 0)
    first = torch.isfinite(apply_token_bitmask(torch.zeros(1, vocab), bitmask))[0]
    assert first[paris[0]] and first[rome[0]]
    outputs = list(paris)
    bitmask = allocate_bitmask(1, vocab)
    grammar.fill_bitmask(outputs, bitmask, 0)
    assert grammar.num_accepted == len(paris)
    allowed = torch.isfinite(apply_token_bitmask(torch.zeros(1, vocab), bitmask))[0]
    assert allowed.nonzero().flatten().tolist() == [default_tokenizer.eos_token_id]
    # Async scheduling samples a request once more after its stop token, before the scheduler
    # has seen it: the matcher, terminated, allows EOS again instead of failing the step.
    outputs.append(default_tokenizer.eos_token_id)
    for _ in range(2):
        bitmask = allocate_bitmask(1, vocab)
        grammar.fill_bitmask(outputs, bitmask, 0)
        allowed = torch.isfinite(apply_token_bitmask(torch.zeros(1, vocab), bitmask))[0]
        assert allowed.nonzero().flatten().tolist() == [default_tokenizer.eos_token_id]
        outputs.append(default_tokenizer.eos_token_id)


def test_the_constraint_waits_for_the_end_of_the_reasoning(compiler, default_tokenizer) -> None:
    """With reasoning_end, every token is allowed until those tokens occur in the output; the
    grammar holds from the token after them, also when drafts cross the end."""
    params = StructuredOutputsParams(choice=[" Paris", " Rome"])
    end = default_tokenizer.encode("</think>", add_special_tokens=False)
    assert len(end) > 1  # the default model has no single token for it: a sequence to find
    vocab = compiler.vocab_size
    grammar = RequestGrammar(compiler.submit(params), default_tokenizer.eos_token_id, end)

    def allowed(bitmask, row):
        return torch.isfinite(apply_token_bitmask(torch.zeros(1, vocab), bitmask[row : row + 1]))[0]  # fmt: skip

    first = allocate_bitmask(1, vocab)
    RequestGrammar(compiler.submit(params), default_tokenizer.eos_token_id).fill_bitmask([], first, 0)  # fmt: skip
    thinking = default_tokenizer.encode("Hmm, maybe Rome", add_special_tokens=False)
    for n in range(len(thinking) + len(end)):  # the reasoning and then its end, token by token
        bitmask = allocate_bitmask(1, vocab)
        grammar.fill_bitmask((thinking + end)[:n], bitmask, 0)
        assert allowed(bitmask, 0).all() and grammar.start is None, n
    # Drafts that cross the end: rows free up to the draft that ends it, then the grammar's
    # first row; the drafts after it are not verified.
    drafts = [*end, *default_tokenizer.encode(" Paris", add_special_tokens=False)]
    assert grammar.valid_prefix(thinking, drafts) == end
    bitmask = allocate_bitmask(1 + len(end), vocab)
    grammar.fill_bitmasks(thinking, end, bitmask, 0)
    assert all(allowed(bitmask, r).all() for r in range(len(end)))
    assert torch.equal(bitmask[len(end)], first[0])
    # Once the end is in the output, the grammar holds after it.
    outputs = thinking + end
    bitmask = allocate_bitmask(1, vocab)
    grammar.fill_bitmask(outputs, bitmask, 0)
    assert grammar.start == len(outputs) and torch.equal(bitmask[0], first[0])
    paris = default_tokenizer.encode(" Paris", add_special_tokens=False)
    assert grammar.valid_prefix(outputs, [*paris, 5]) == paris  # the grammar's own check again
    bitmask = allocate_bitmask(1, vocab)
    grammar.fill_bitmask(outputs + paris, bitmask, 0)
    assert allowed(bitmask, 0).nonzero().flatten().tolist() == [default_tokenizer.eos_token_id]


def test_a_first_token_may_open_the_reasoning(compiler, default_tokenizer) -> None:
    """With reasoning_start (Qwen3 hybrids): the first row allows the opening token besides the
    grammar's first tokens; after it the output is free until the end, then constrained; any
    other first token starts the constrained output at once."""
    params = StructuredOutputsParams(choice=[" Paris", " Rome"])
    eos, vocab = default_tokenizer.eos_token_id, compiler.vocab_size
    (opening,) = default_tokenizer.encode("Okay", add_special_tokens=False)
    end = default_tokenizer.encode("</think>", add_special_tokens=False)
    paris = default_tokenizer.encode(" Paris", add_special_tokens=False)

    def allowed(grammar, outputs):
        bitmask = allocate_bitmask(1, vocab)
        grammar.fill_bitmask(outputs, bitmask, 0)
        return set(torch.isfinite(apply_token_bitmask(torch.zeros(1, vocab), bitmask))[0].nonzero().flatten().tolist())  # fmt: skip

    def make():
        return RequestGrammar(compiler.submit(params), eos, end, reasoning_start=opening)

    first = allowed(RequestGrammar(compiler.submit(params), eos), [])
    assert opening not in first and paris[0] in first
    thinks = make()
    assert allowed(thinks, []) == first | {opening}
    assert thinks.valid_prefix([], [opening]) == []  # a first token is never drafted
    thought = [opening, *default_tokenizer.encode(" maybe Rome", add_special_tokens=False)]
    assert len(allowed(thinks, thought)) == vocab and thinks.start is None
    assert allowed(thinks, thought + end) == first and thinks.start == len(thought + end)
    assert allowed(thinks, thought + end + paris) == {eos}
    answers = make()  # no opening token: the grammar held from the first token
    assert allowed(answers, paris[:1]) == allowed(RequestGrammar(compiler.submit(params), eos), paris[:1])  # fmt: skip
    assert answers.start == 0 and answers.num_accepted == 1


def test_the_grammar_cache_is_bounded(compiler, monkeypatch) -> None:
    import v1_engine.structured_output as so

    monkeypatch.setattr(so, "MAX_CACHED_GRAMMARS", 3)
    first = compiler.submit(StructuredOutputsParams(regex="a0"))
    for i in range(1, 4):
        compiler.submit(StructuredOutputsParams(regex=f"a{i}"))
    assert len(compiler._futures) == 3
    assert compiler.submit(StructuredOutputsParams(regex="a3")) is not first
    assert compiler.submit(StructuredOutputsParams(regex="a0")) is not first  # compiled again
    assert compiler.submit(StructuredOutputsParams(regex="a0")).result() is not None


def test_sampler_masks_greedy_and_random_rows() -> None:
    vocab = 64
    logits = torch.randn(3, vocab)
    bitmask = torch.zeros(3, 2, dtype=torch.int32)
    bitmask[0, 1] = 1 << 3  # token 35
    bitmask[1, 0] = (1 << 5) | (1 << 9)  # tokens 5 and 9
    bitmask[2] = -1  # unconstrained
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=2.0), SamplingParams()]
    metadata = SamplingMetadata.build(
        params, [[0]] * 3, [[], [], []], [None] * 3, [None] * 3, vocab, torch.device("cpu")
    )
    metadata.grammar_bitmask = bitmask
    for _ in range(20):
        sampled = Sampler()(logits, metadata).sampled_token_ids.tolist()
        assert sampled[0] == 35 and sampled[1] in (5, 9)


# ---- end to end on the default model -----------------------------------------------------


@pytest.fixture(scope="module")
def llm():
    return LLM(max_model_len=512, num_kv_blocks=256)


def _check_person(text: str) -> dict:
    person = json.loads(text)
    assert set(person) == {"name", "age", "city"}
    assert isinstance(person["name"], str) and len(person["name"]) <= 20
    assert isinstance(person["age"], int) and 0 <= person["age"] <= 150
    assert person["city"] in ("Paris", "London", "Rome")
    return person


def test_constrained_batch_on_the_default_model(llm) -> None:
    """A mixed batch: each constraint holds, greedy and sampled, and the unconstrained row is
    the same as alone; every output ends complete (stop, not length)."""
    so = StructuredOutputsParams
    greedy = {"temperature": 0.0, "max_tokens": 80}
    params = [
        SamplingParams(**greedy, structured_outputs=so(json=PERSON)),
        SamplingParams(temperature=1.0, seed=7, max_tokens=80, structured_outputs=so(json=PERSON)),
        SamplingParams(**greedy, structured_outputs=so(json_object=True)),
        SamplingParams(**greedy, structured_outputs=so(regex=r"[0-9]{3}-[A-Z]{2}")),
        SamplingParams(**greedy, structured_outputs=so(choice=["Paris", "London", "Rome"])),
        SamplingParams(**greedy, structured_outputs=so(grammar='root ::= "yes" | "no"')),
        SamplingParams(**greedy),
    ]
    prompts = [
        "Describe a person as JSON:",
        "A person, as JSON:",
        "A JSON object with a name and an age:",
        "Code:",
        "The capital of France is",
        "Is the sky blue?",
        "The capital of France is",
    ]
    outputs = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
    for out in outputs[:6]:
        assert out.finish_reason == "stop", out
    _check_person(outputs[0].text)
    _check_person(outputs[1].text)
    assert isinstance(json.loads(outputs[2].text), dict)
    assert re.fullmatch(r"[0-9]{3}-[A-Z]{2}", outputs[3].text)
    assert outputs[4].text in ("Paris", "London", "Rome")
    assert outputs[5].text in ("yes", "no")
    (alone,) = llm.generate([prompts[6]], params[6], use_tqdm=False)
    assert outputs[6].token_ids == alone.outputs[0].token_ids
    # The same seed and spec give the same sampled object.
    (again,) = llm.generate([prompts[1]], params[1], use_tqdm=False)
    assert again.outputs[0].text == outputs[1].text


def test_an_opening_token_frees_the_output_in_the_engine(llm) -> None:
    """reasoning_start through the engine: a first token that opens the reasoning leaves the
    output free (here "Okay" forced by logit_bias, again and again, which the grammar refuses
    after it), another starts the constrained answer."""
    tokenizer = llm.get_tokenizer()
    (opening,) = tokenizer.encode("Okay", add_special_tokens=False)
    end = tokenizer.encode("</think>", add_special_tokens=False)
    choice = [" Paris", " Rome"]
    so = StructuredOutputsParams
    base = {"temperature": 0.0, "max_tokens": 6}
    params = [
        SamplingParams(**base, logit_bias={opening: 100},
                       structured_outputs=so(choice=choice, reasoning_end=end, reasoning_start=opening)),
        SamplingParams(**base, logit_bias={opening: 100}, structured_outputs=so(choice=choice)),
        SamplingParams(**base, logit_bias={opening: -100},
                       structured_outputs=so(choice=choice, reasoning_end=end, reasoning_start=opening)),
    ]  # fmt: skip
    prompt = "The capital of France is"
    thinking, plain, answer = [o.outputs[0] for o in llm.generate([prompt] * 3, params, use_tqdm=False)]  # fmt: skip
    assert thinking.token_ids == [opening] * 6 and thinking.finish_reason == "length"
    assert plain.text in choice and answer.text in choice and answer.finish_reason == "stop"


def test_constrained_requests_survive_chunked_prefill_and_preemption(llm) -> None:
    """A preempted request's matcher starts again from its outputs when it comes back: the
    same tokens as without preemption, and every block returned."""
    small = LLM(
        max_model_len=256, num_kv_blocks=24, block_size=4, max_num_batched_tokens=32,
        enable_prefix_caching=False,
    )  # fmt: skip
    scheduler = small.engine_core.scheduler
    preempted = []
    make_stats = scheduler.make_stats

    def counting_stats():
        stats = make_stats()
        preempted.append(stats.num_preempted_reqs)
        return stats

    scheduler.make_stats = counting_stats
    so = StructuredOutputsParams(json=PERSON)
    params = SamplingParams(temperature=0.0, max_tokens=60, structured_outputs=so)
    prompts = [f"Person number {i}, described as JSON with name, age and city:" for i in range(6)]
    outputs = small.generate(prompts, params, use_tqdm=False)
    assert sum(preempted) > 0
    reference = llm.generate(prompts, params, use_tqdm=False)
    for out, ref in zip(outputs, reference):
        assert out.outputs[0].token_ids == ref.outputs[0].token_ids
        if out.outputs[0].finish_reason == "stop":
            _check_person(out.outputs[0].text)
    assert scheduler.kv_cache_manager.num_free_blocks == small.engine_core.num_kv_blocks


def test_a_slow_grammar_holds_back_only_its_own_request(llm, monkeypatch) -> None:
    """The compile runs while the request waits; the scheduler admits it once done, and the
    other requests step on meanwhile (the runner never blocks on a compile)."""
    import threading

    from v1_engine.structured_output import GrammarCompilerService

    release = threading.Event()
    compile_grammar = GrammarCompilerService._compile

    def slow_compile(self, kind, text):
        release.wait(timeout=30)
        return compile_grammar(self, kind, text)

    monkeypatch.setattr(GrammarCompilerService, "_compile", slow_compile)
    runner = llm.engine_core.model_runner
    execute = runner.execute_model
    steps: list[tuple[set[bool], set[bool]]] = []  # (new requests, scheduled), by constrained

    def counting(so):
        states = runner.input_batch.states
        new = {r.sampling_params.structured_outputs is not None for r in so.scheduled_new_reqs}
        out = execute(so)
        ran = {states[r].sampling_params.structured_outputs is not None
               for r in so.num_scheduled_tokens if r in states}  # fmt: skip
        steps.append((new, ran | new))
        if len(steps) == 8:
            release.set()
        return out

    monkeypatch.setattr(runner, "execute_model", counting)
    spec = StructuredOutputsParams(regex="[0-9]{2}-(slow|grammar)")
    params = [
        SamplingParams(temperature=0.0, max_tokens=10, structured_outputs=spec),
        SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True),
    ]
    outputs = llm.generate(["Code:", "Hello"], params, use_tqdm=False)
    assert re.fullmatch(r"[0-9]{2}-(slow|grammar)", outputs[0].outputs[0].text)
    assert len(outputs[1].outputs[0].token_ids) == 5
    admitted = next(i for i, (new, _) in enumerate(steps) if True in new)
    last_plain = max(i for i, (_, ran) in enumerate(steps) if False in ran)
    assert admitted >= 8 > last_plain  # the plain request finished while the compile waited


def test_structured_outputs_cross_to_the_core_process() -> None:
    from v1_engine import AsyncEngine

    engine = AsyncEngine(max_model_len=512, num_kv_blocks=128)
    try:
        so = StructuredOutputsParams(choice=["alpha", "beta"])
        params = SamplingParams(temperature=0.0, max_tokens=10, structured_outputs=so)

        async def run() -> str:
            outs = [o async for o in engine.generate("Pick one:", params, "so-1")]
            return "".join(o.outputs[0].text for o in outs)

        assert asyncio.run(run()) in ("alpha", "beta")
        bad = SamplingParams(structured_outputs=StructuredOutputsParams(regex="(x"))

        async def run_bad() -> None:
            async for _ in engine.generate("x", bad, "so-2"):
                pass

        with pytest.raises(ValueError, match="structured_outputs.regex"):
            asyncio.run(run_bad())
        assert engine.is_healthy()
    finally:
        engine.shutdown()
