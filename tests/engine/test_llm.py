"""End-to-end: the offline LLM through the real scheduler, KV cache, runner and sampler on CPU,
token-for-token against Hugging Face transformers."""

from __future__ import annotations

import pytest
import torch
from hf_reference import hf_greedy
from transformers import AutoModelForCausalLM

from v1_engine import LLM, SamplingParams

PROMPTS = [
    "The capital of France is",
    "Write a haiku about the sea.",
    "1, 2, 3, 4,",
    "def fibonacci(n):",
    (
        "Once upon a time, in a small village nestled between two mountains, there lived an old "
        "clockmaker who"
    ),
    "Q: What is the boiling point of water in Celsius?\nA:",
    "Hi",
    "List three primary colors:",
]
MAX_TOKENS = 20


@pytest.fixture(scope="module")
def llm():
    return LLM(max_model_len=512, num_kv_blocks=256)


@pytest.fixture(scope="module")
def prompt_ids(llm):
    tok = llm.get_tokenizer()
    return [tok.encode(p) for p in PROMPTS]


@pytest.fixture(scope="module")
def reference(hf_default_model, prompt_ids):
    return [hf_greedy(hf_default_model, ids, MAX_TOKENS, exact=False) for ids in prompt_ids]


def _free_blocks(llm: LLM) -> int:
    return llm.engine_core.scheduler.kv_cache_manager.num_free_blocks


def _greedy(**kw) -> SamplingParams:
    return SamplingParams(**{"temperature": 0.0, "max_tokens": MAX_TOKENS, **kw})


def test_default_model_greedy_matches_hf(llm, prompt_ids, reference):
    outputs = llm.generate(PROMPTS, _greedy(), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == reference
    for out, ids in zip(outputs, prompt_ids):
        assert out.prompt == PROMPTS[outputs.index(out)]
        assert out.prompt_token_ids == ids
        completion = out.outputs[0]
        assert completion.finish_reason in ("stop", "length")
        assert completion.text == llm.get_tokenizer().decode(
            completion.token_ids, skip_special_tokens=True
        )


def test_token_id_prompts(llm, prompt_ids, reference):
    outputs = llm.generate(prompt_ids, _greedy(), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == reference
    assert outputs[0].prompt is None


def test_chunked_prefill_same_tokens(prompt_ids, reference):
    llm = LLM(max_model_len=512, num_kv_blocks=256, max_num_batched_tokens=8)
    outputs = llm.generate(prompt_ids, _greedy(), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == reference
    assert _free_blocks(llm) == llm.engine_core.num_kv_blocks


def test_preemption_same_tokens(prompt_ids, reference):
    # 8 prompts need ~20 blocks of 4 tokens each at the end; 24 blocks force recompute.
    llm = LLM(max_model_len=128, num_kv_blocks=24, block_size=4, enable_prefix_caching=False)
    totals = _count_stats(llm)
    outputs = llm.generate(prompt_ids, _greedy(), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == reference
    assert totals["num_preempted_reqs"] > 0
    assert _free_blocks(llm) == llm.engine_core.num_kv_blocks


def test_prefix_cache_hits_shared_system_prompt(llm):
    system = (
        "You are a meticulous assistant. Answer briefly, cite no sources, and never use more "
        "than one sentence. Always be polite and precise. "
    ) * 3
    questions = ["What is 2+2?", "Name a fruit.", "What color is the sky?", "Say hi."]
    prompts = [system + q for q in questions]
    first = llm.generate(prompts[:1], _greedy(), use_tqdm=False)
    rest = llm.generate(prompts[1:], _greedy(), use_tqdm=False)
    assert first[0].num_cached_tokens == 0 or first[0].num_cached_tokens < 16
    system_len = len(llm.get_tokenizer().encode(system))
    block = llm.config.cache_config.block_size
    for out in rest:
        assert out.num_cached_tokens >= (system_len // block - 1) * block
    # Cached or not, the tokens are the same as a cold run's.
    cold = LLM(max_model_len=512, num_kv_blocks=256, enable_prefix_caching=False)
    expected = cold.generate(prompts, _greedy(), use_tqdm=False)
    got = first + rest
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in expected]
    assert _free_blocks(llm) == llm.engine_core.num_kv_blocks


def _count_stats(llm: LLM) -> dict[str, int]:
    """Sum the scheduler's per-step stats (counts since the previous step) from now on."""
    scheduler = llm.engine_core.scheduler
    totals = {"num_preempted_reqs": 0, "prefix_cache_queries": 0, "prefix_cache_hits": 0}
    original = scheduler.make_stats

    def counting_stats():
        stats = original()
        for name in totals:
            totals[name] += getattr(stats, name)
        return stats

    scheduler.make_stats = counting_stats
    return totals


def test_prefix_cache_hit_rate_reported():
    llm = LLM(max_model_len=512, num_kv_blocks=256)
    totals = _count_stats(llm)
    prefix = "Shared context: " + "alpha beta gamma delta " * 12
    llm.generate([prefix + "one"], _greedy(max_tokens=2), use_tqdm=False)
    assert totals["prefix_cache_hits"] == 0
    llm.generate([prefix + "two", prefix + "three"], _greedy(max_tokens=2), use_tqdm=False)
    queries, hits = totals["prefix_cache_queries"], totals["prefix_cache_hits"]
    assert queries > 0
    assert hits / queries > 0.5


@pytest.mark.parametrize("exact", [True])
def test_tiny_models_greedy_match_hf(tiny_model_dir, exact):
    hf = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    llm = LLM(model=str(tiny_model_dir), max_model_len=256, num_kv_blocks=128)
    generator = torch.Generator().manual_seed(7)
    prompts = [
        torch.randint(3, hf.config.vocab_size, (n,), generator=generator).tolist()
        for n in (1, 5, 17, 33, 64, 9)
    ]
    params = SamplingParams(temperature=0.0, max_tokens=12, min_tokens=12)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    expected = [hf_greedy(hf, p, 12, exact=True) for p in prompts]
    assert [o.outputs[0].token_ids for o in outputs] == expected


def test_seeded_sampling_reproducible(llm):
    params = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, seed=1234, max_tokens=16)
    a = llm.generate(PROMPTS[:3], params, use_tqdm=False)
    b = llm.generate(PROMPTS[::-1], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in a] == [o.outputs[0].token_ids for o in b][::-1][:3]
    c = llm.generate(
        PROMPTS[:3], SamplingParams(temperature=1.0, seed=99, max_tokens=16), use_tqdm=False
    )
    assert [o.outputs[0].token_ids for o in a] != [o.outputs[0].token_ids for o in c]


def test_n_completions_and_logprobs(llm):
    params = SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=6, logprobs=4)
    (out,) = llm.generate("Tell me a joke.", params, use_tqdm=False)
    assert [c.index for c in out.outputs] == [0, 1, 2]
    for completion in out.outputs:
        assert len(completion.logprobs) == len(completion.token_ids)
        for token_id, entry in zip(completion.token_ids, completion.logprobs):
            assert token_id in entry
            assert 4 <= len(entry) <= 5
            assert all(lp.logprob <= 0.0 for lp in entry.values())
        assert completion.cumulative_logprob == pytest.approx(
            sum(e[t].logprob for t, e in zip(completion.token_ids, completion.logprobs)), rel=1e-5
        )


def test_prompt_logprobs(llm, hf_default_model):
    ids = llm.get_tokenizer().encode("The quick brown fox jumps")
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=2)
    (out,) = llm.generate([ids], params, use_tqdm=False)
    assert out.prompt_logprobs[0] is None
    assert len(out.prompt_logprobs) == len(ids)
    with torch.no_grad():
        logits = hf_default_model(torch.tensor([ids])).logits[0].float()
    ref = torch.log_softmax(logits, dim=-1)
    for pos in range(1, len(ids)):
        entry = out.prompt_logprobs[pos]
        assert entry[ids[pos]].logprob == pytest.approx(ref[pos - 1, ids[pos]].item(), abs=1e-3)


def test_stop_strings_and_token_ids(llm):
    params = _greedy(max_tokens=40)
    (free,) = llm.generate(["1, 2, 3, 4,"], params, use_tqdm=False)
    text = free.outputs[0].text
    stop = text.strip()[3:6] if len(text.strip()) > 6 else text.strip()[:2]
    (stopped,) = llm.generate(["1, 2, 3, 4,"], _greedy(max_tokens=40, stop=[stop]), use_tqdm=False)
    assert stopped.outputs[0].finish_reason == "stop"
    assert stopped.outputs[0].stop_reason == stop
    assert stop not in stopped.outputs[0].text
    assert text.startswith(stopped.outputs[0].text)
    first_token = free.outputs[0].token_ids[2]
    (by_id,) = llm.generate(
        ["1, 2, 3, 4,"], _greedy(max_tokens=40, stop_token_ids=[first_token]), use_tqdm=False
    )
    assert by_id.outputs[0].token_ids == free.outputs[0].token_ids[:3]
    assert by_id.outputs[0].stop_reason == first_token


def test_logit_bias_and_allowed_token_ids(llm, prompt_ids, reference):
    """Biases steer the real model's greedy output; the unbiased rows of the same batch keep
    the transformers tokens; allowed_token_ids confines random sampling."""
    tok = llm.get_tokenizer()
    forced = tok.encode(" banana", add_special_tokens=False)[0]
    first = reference[0][0]
    params = [
        _greedy(max_tokens=5, logit_bias={forced: 100.0}),
        _greedy(max_tokens=5, logit_bias={first: -100.0}),
        _greedy(),
    ]
    out = llm.generate([prompt_ids[0]] * 3, params, use_tqdm=False)
    assert out[0].outputs[0].token_ids == [forced] * 5
    assert out[1].outputs[0].token_ids[0] != first
    assert out[2].outputs[0].token_ids == reference[0]
    allowed = sorted({forced, first, tok.encode(" the", add_special_tokens=False)[0]})
    sampled = SamplingParams(temperature=1.5, max_tokens=12, seed=3, allowed_token_ids=allowed)
    (restricted,) = llm.generate([prompt_ids[1]], sampled, use_tqdm=False)
    assert len(restricted.outputs[0].token_ids) == 12
    assert set(restricted.outputs[0].token_ids) <= set(allowed)


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"temperature": -0.5}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        # Token ids past the vocabulary: once an IndexError in the sampler that killed the
        # engine (min_tokens suppresses the stop ids on the device).
        ({"stop_token_ids": [10**7], "min_tokens": 2}, "stop_token_ids"),
        ({"logit_bias": {10**7: 1.0}}, "logit_bias"),
        ({"allowed_token_ids": [1, 10**7]}, "allowed_token_ids"),
        ({"logit_bias": {5: 250.0}}, "logit_bias"),
    ],
)
def test_bad_sampling_params_rejected_alone(llm, kwargs, field):
    before = _free_blocks(llm)
    with pytest.raises(ValueError, match=field):
        llm.generate(["Hello", "World"], [_greedy(), SamplingParams(**kwargs)], use_tqdm=False)
    assert not llm.engine_core.has_unfinished_requests()
    assert _free_blocks(llm) == before
    (ok,) = llm.generate(["Hello"], _greedy(max_tokens=3), use_tqdm=False)
    assert len(ok.outputs[0].token_ids) == 3


def test_bad_prompts_rejected(llm):
    with pytest.raises(ValueError, match="prompt"):
        llm.generate(["fine", ""], _greedy(), use_tqdm=False)
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate([[5] * 600], _greedy(), use_tqdm=False)
    assert not llm.engine_core.has_unfinished_requests()


def test_unknown_model_path():
    with pytest.raises(ValueError, match="model"):
        LLM(model="/nonexistent/model/dir")


def test_chat_uses_template(llm):
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    (out,) = llm.chat(messages, _greedy(max_tokens=16), use_tqdm=False)
    expected_prompt = llm.get_tokenizer().apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    )
    assert out.prompt == expected_prompt
    assert "Paris" in out.outputs[0].text


def test_chat_renders_tools_and_names_a_bad_one(llm):
    """`tools` reach the chat template (one that renders them, set for this test), as the
    server's do; a tool that is not a function tool is refused naming it."""
    tokenizer = llm.input_processor.tokenizer
    template = tokenizer.chat_template
    tokenizer.chat_template = (
        "{% for t in tools or [] %}TOOL {{ t.function.name }}\n{% endfor %}"
        "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
        "{% if add_generation_prompt %}assistant:{% endif %}"
    )
    try:
        tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {}}}]
        messages = [{"role": "user", "content": "Weather in Paris?"}]
        (out,) = llm.chat(messages, _greedy(max_tokens=4), use_tqdm=False, tools=tools)
        assert out.prompt == "TOOL get_weather\nuser: Weather in Paris?\nassistant:"
        (out,) = llm.chat(messages, _greedy(max_tokens=4), use_tqdm=False,
                          add_generation_prompt=False)  # fmt: skip
        assert out.prompt == "user: Weather in Paris?\n"
        with pytest.raises(ValueError, match=r"messages\[0\]: tools\[1\] must be"):
            llm.chat(messages, tools=[*tools, {"type": "retrieval"}], use_tqdm=False)
    finally:
        tokenizer.chat_template = template


def test_chat_template_kwargs_and_continue_final_message(llm):
    """chat_template_kwargs are the template's variables (Qwen3's enable_thinking here, in a
    template set for this test); continue_final_message leaves the last, assistant message open
    and the model continues it; what cannot hold is refused naming the field."""
    tokenizer = llm.input_processor.tokenizer
    template = tokenizer.chat_template
    tokenizer.chat_template = (
        "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
        "{% if add_generation_prompt %}assistant:"
        "{% if enable_thinking is defined and not enable_thinking %} <think></think>{% endif %}"
        "{% endif %}"
    )
    try:
        messages = [{"role": "user", "content": "Hi"}]
        (out,) = llm.chat(messages, _greedy(max_tokens=2), use_tqdm=False,
                          chat_template_kwargs={"enable_thinking": False})  # fmt: skip
        assert out.prompt == "user: Hi\nassistant: <think></think>"
        (out,) = llm.chat(messages, _greedy(max_tokens=2), use_tqdm=False)
        assert out.prompt == "user: Hi\nassistant:"
        with pytest.raises(ValueError, match=r"chat_template_kwargs may not set \['tools'\]"):
            llm.chat(messages, use_tqdm=False, chat_template_kwargs={"tools": []})
    finally:
        tokenizer.chat_template = template
    opened = [
        {"role": "user", "content": "What is the capital of France?"},
        {"role": "assistant", "content": "The capital of France is"},
    ]
    (out,) = llm.chat(opened, _greedy(max_tokens=8), use_tqdm=False,
                      add_generation_prompt=False, continue_final_message=True)  # fmt: skip
    assert out.prompt.endswith("<|im_start|>assistant\nThe capital of France is")
    assert "Paris" in out.outputs[0].text
    with pytest.raises(ValueError, match="continue_final_message cannot be combined"):
        llm.chat(opened, use_tqdm=False, continue_final_message=True)
    with pytest.raises(ValueError, match="continue_final_message needs an assistant message"):
        llm.chat(opened[:1], use_tqdm=False, add_generation_prompt=False,
                 continue_final_message=True)  # fmt: skip


def test_chat_with_a_template_for_the_call(llm):
    from v1_engine.engine.input_processor import load_chat_template

    template = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}<assistant>"
    messages = [{"role": "user", "content": "Hi"}]
    (out,) = llm.chat(messages, _greedy(max_tokens=2), use_tqdm=False, chat_template=template)
    assert out.prompt == "<user>Hi<assistant>"
    assert load_chat_template(template) == template
    with pytest.raises(ValueError, match="neither a file nor a Jinja template"):
        load_chat_template("chatml")
    with pytest.raises(ValueError, match="not a valid Jinja template"):
        load_chat_template("{% for m in messages %}")


def test_priority_policy_runs_the_most_urgent_first(llm):
    """One request at a time: they start in priority order (lower first), not in prompt
    order; the fcfs engine refuses a priority by name."""
    llm_by_priority = LLM(max_model_len=512, num_kv_blocks=256, max_num_seqs=1,
                          scheduling_policy="priority")  # fmt: skip
    prompts = ["one", "two", "three", "four"]
    params = SamplingParams(temperature=0.0, max_tokens=3)
    outputs = llm_by_priority.generate(prompts, params, use_tqdm=False, priority=[3, -1, 2, 0])
    started = sorted(range(4), key=lambda i: outputs[i].metrics.first_scheduled_time)
    assert started == [1, 3, 2, 0]
    assert [o.prompt for o in outputs] == prompts  # outputs still in prompt order
    with pytest.raises(ValueError, match=r"prompts\[0\]: priority must be 0 under the 'fcfs'"):
        llm.generate(prompts[:1], params, use_tqdm=False, priority=[1])
    with pytest.raises(ValueError, match="priority must hold one int per prompt"):
        llm.generate(prompts, params, use_tqdm=False, priority=[0])
    chats = [[{"role": "user", "content": p}] for p in prompts[:2]]
    replies = llm_by_priority.chat(chats, params, use_tqdm=False, priority=[1, 0])
    started = sorted(range(2), key=lambda i: replies[i].metrics.first_scheduled_time)
    assert started == [1, 0]
