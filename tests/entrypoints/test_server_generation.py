"""Completions and chat through the official openai client against a real v1serve process."""

from __future__ import annotations

import json
import re

import httpx

PROMPT = "The capital of France is"
CHAT = [{"role": "user", "content": "Name three colors."}]
GREEDY_FIXED = {"temperature": 0.0}
NO_EOS = {"ignore_eos": True}


def count_tokens(server, auth_headers, **body) -> int:
    response = httpx.post(f"{server.url}/tokenize", json=body, headers=auth_headers, timeout=10)
    assert response.status_code == 200, response.text
    return response.json()["count"]


def test_models_version_health(server, client, model_name):
    models = client.models.list()
    assert [m.id for m in models.data] == [model_name]
    assert model_name == "SmolLM2-135M-Instruct"
    assert httpx.get(f"{server.url}/version").json()["version"]
    assert httpx.get(f"{server.url}/health").status_code == 200
    schema = httpx.get(f"{server.url}/openapi.json").json()
    assert "/v1/chat/completions" in schema["paths"] and "/tokenize" in schema["paths"]


def test_completion_usage_counts(server, client, model_name, auth_headers):
    result = client.completions.create(
        model=model_name, prompt=PROMPT, max_tokens=8, extra_body=NO_EOS, **GREEDY_FIXED
    )
    choice = result.choices[0]
    assert choice.finish_reason == "length"
    assert result.usage.completion_tokens == 8
    assert result.usage.prompt_tokens == count_tokens(server, auth_headers, prompt=PROMPT)
    assert result.usage.total_tokens == result.usage.prompt_tokens + 8
    assert choice.text.strip()


def test_completion_stream_matches_non_stream(client, model_name):
    kwargs = dict(model=model_name, prompt=PROMPT, max_tokens=12, **GREEDY_FIXED)
    full = client.completions.create(**kwargs)
    chunks = list(
        client.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs)
    )
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == full.choices[0].text
    finish = [
        c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
    ]
    assert finish == [full.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens


def test_chat_non_stream_and_stream_agree(server, client, model_name, auth_headers):
    kwargs = dict(model=model_name, messages=CHAT, max_completion_tokens=16, **GREEDY_FIXED)
    full = client.chat.completions.create(**kwargs)
    message = full.choices[0].message
    assert message.role == "assistant" and message.content
    prompt_tokens = count_tokens(server, auth_headers, messages=CHAT)
    assert full.usage.prompt_tokens == prompt_tokens
    stream = client.chat.completions.create(
        stream=True, stream_options={"include_usage": True}, **kwargs
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == message.content
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens == prompt_tokens


def test_max_tokens_alias_in_chat(client, model_name):
    result = client.chat.completions.create(
        model=model_name, messages=CHAT, max_tokens=5, extra_body=NO_EOS, **GREEDY_FIXED
    )
    assert result.usage.completion_tokens == 5
    assert result.choices[0].finish_reason == "length"


def test_stop_string_cuts_output(client, model_name):
    base = (
        client.completions.create(
            model=model_name, prompt=PROMPT, max_tokens=16, extra_body=NO_EOS, **GREEDY_FIXED
        )
        .choices[0]
        .text
    )
    words = base.split()
    assert len(words) >= 3, base
    stop = words[2]
    cut = client.completions.create(
        model=model_name, prompt=PROMPT, max_tokens=16, stop=[stop], **GREEDY_FIXED
    ).choices[0]
    assert cut.finish_reason == "stop"
    assert stop not in cut.text
    assert base.startswith(cut.text)
    assert cut.text == base[: base.index(stop)]


def test_seeded_sampling_is_reproducible(client, model_name):
    def sample(seed: int) -> str:
        return (
            client.completions.create(
                model=model_name,
                prompt="Once upon a time",
                max_tokens=8,
                temperature=1.0,
                seed=seed,
                extra_body=NO_EOS,
            )
            .choices[0]
            .text
        )

    first = sample(1234)
    assert sample(1234) == first
    assert len({first, sample(1), sample(2)}) > 1


def test_n_choices_and_usage(client, model_name):
    result = client.completions.create(
        model=model_name,
        prompt=PROMPT,
        max_tokens=6,
        n=3,
        temperature=1.0,
        seed=7,
        extra_body=NO_EOS,
    )
    assert sorted(c.index for c in result.choices) == [0, 1, 2]
    assert result.usage.completion_tokens == 18
    chat = client.chat.completions.create(
        model=model_name, messages=CHAT, max_tokens=4, n=2, temperature=1.0, extra_body=NO_EOS
    )
    assert [c.index for c in chat.choices] == [0, 1]
    assert chat.usage.completion_tokens == 8


def test_completion_logprobs_shape(client, model_name):
    result = client.completions.create(
        model=model_name,
        prompt=PROMPT,
        max_tokens=6,
        logprobs=3,
        extra_body=NO_EOS,
        **GREEDY_FIXED,
    )
    lp = result.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 6
    assert "".join(lp.tokens) == result.choices[0].text
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert logprob <= 0.0
        assert 1 <= len(top) <= 4
        assert max(top.values()) == logprob  # greedy picks the most likely token
        assert top[token] == logprob


def test_echo_with_logprobs_includes_prompt(client, model_name):
    result = client.completions.create(
        model=model_name, prompt=PROMPT, max_tokens=3, echo=True, logprobs=1, **GREEDY_FIXED
    )
    choice = result.choices[0]
    assert choice.text.startswith(PROMPT)
    lp = choice.logprobs
    num_prompt = result.usage.prompt_tokens
    assert len(lp.tokens) == num_prompt + result.usage.completion_tokens
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(v is not None and v <= 0 for v in lp.token_logprobs[1:])


def test_chat_logprobs_shape(client, model_name):
    result = client.chat.completions.create(
        model=model_name,
        messages=CHAT,
        max_tokens=5,
        logprobs=True,
        top_logprobs=2,
        **GREEDY_FIXED,
    )
    content = result.choices[0].logprobs.content
    assert len(content) == result.usage.completion_tokens
    for entry in content:
        assert len(entry.top_logprobs) == 2
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob
        assert entry.token == entry.top_logprobs[0].token
        assert entry.logprob == entry.top_logprobs[0].logprob


def test_sampling_extras_are_accepted(client, model_name):
    result = client.completions.create(
        model=model_name,
        prompt=PROMPT,
        max_tokens=8,
        temperature=0.8,
        top_p=0.9,
        seed=3,
        presence_penalty=0.5,
        frequency_penalty=0.5,
        extra_body={"top_k": 20, "min_p": 0.05, "repetition_penalty": 1.2, "min_tokens": 8},
    )
    assert result.usage.completion_tokens == 8


def test_logit_bias_and_allowed_token_ids(server, client, model_name, auth_headers):
    """OpenAI's logit_bias (string keys) forces or bans tokens, in completions and chat;
    vLLM's allowed_token_ids confines sampling."""

    def token_ids(text: str) -> list[int]:
        body = {"prompt": text, "add_special_tokens": False}
        response = httpx.post(f"{server.url}/tokenize", json=body, headers=auth_headers)
        return response.json()["tokens"]

    (banana,) = token_ids(" banana")
    forced = client.completions.create(
        model=model_name, prompt=PROMPT, max_tokens=3, logprobs=0, logit_bias={str(banana): 100},
        **GREEDY_FIXED,
    )  # fmt: skip
    assert forced.choices[0].logprobs.tokens == [" banana"] * 3
    free = client.completions.create(model=model_name, prompt=PROMPT, max_tokens=1, **GREEDY_FIXED)
    (first,) = token_ids(free.choices[0].text)
    banned = client.completions.create(
        model=model_name, prompt=PROMPT, max_tokens=1, logit_bias={str(first): -100},
        **GREEDY_FIXED,
    )  # fmt: skip
    assert banned.choices[0].text != free.choices[0].text
    chat = client.chat.completions.create(
        model=model_name, messages=CHAT, max_tokens=2, logit_bias={str(banana): 100},
        **GREEDY_FIXED,
    )  # fmt: skip
    assert chat.choices[0].message.content == " banana banana"
    allowed = token_ids(" red green blue")
    confined = client.completions.create(
        model=model_name, prompt=PROMPT, max_tokens=8, temperature=1.0, seed=5, logprobs=0,
        extra_body={"allowed_token_ids": allowed},
    )  # fmt: skip
    assert set(confined.choices[0].logprobs.tokens) <= {" red", " green", " blue"}


PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer", "minimum": 0},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}


def test_response_format_json_schema_and_json_object(client, model_name):
    """OpenAI's response_format, in chat (whole and streamed) and completions."""
    messages = [{"role": "user", "content": "Describe a person as JSON."}]
    schema_format = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    chat = client.chat.completions.create(
        model=model_name, messages=messages, max_tokens=60, response_format=schema_format,
        **GREEDY_FIXED,
    )  # fmt: skip
    person = json.loads(chat.choices[0].message.content)
    assert set(person) == {"name", "age"} and isinstance(person["age"], int)
    assert chat.choices[0].finish_reason == "stop"
    stream = client.chat.completions.create(
        model=model_name, messages=messages, max_tokens=60, response_format=schema_format,
        stream=True, **GREEDY_FIXED,
    )  # fmt: skip
    streamed = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert streamed == chat.choices[0].message.content
    ask = [{"role": "user", "content": "Give a JSON object with a name and an age."}]
    any_object = client.chat.completions.create(
        model=model_name, messages=ask, max_tokens=60, response_format={"type": "json_object"},
        **GREEDY_FIXED,
    )  # fmt: skip
    assert any_object.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(any_object.choices[0].message.content), dict)
    completion = client.completions.create(
        model=model_name, prompt="A person as JSON:", max_tokens=60,
        extra_body={"response_format": schema_format}, **GREEDY_FIXED,
    )  # fmt: skip
    assert set(json.loads(completion.choices[0].text)) == {"name", "age"}


def test_structured_outputs_extras(client, model_name):
    """vLLM's structured_outputs (regex / choice / grammar) and the older guided_* names."""
    regex = client.completions.create(
        model=model_name, prompt="A phone number:", max_tokens=20,
        extra_body={"structured_outputs": {"regex": "[0-9]{3}-[0-9]{4}"}}, **GREEDY_FIXED,
    )  # fmt: skip
    assert re.fullmatch(r"[0-9]{3}-[0-9]{4}", regex.choices[0].text)
    for extra in ({"structured_outputs": {"choice": ["Paris", "Rome"]}},
                  {"guided_choice": ["Paris", "Rome"]}):  # fmt: skip
        choice = client.completions.create(
            model=model_name, prompt=PROMPT, max_tokens=5, extra_body=extra, n=2,
            temperature=1.0,
        )  # fmt: skip
        assert {c.text for c in choice.choices} <= {"Paris", "Rome"}
    grammar = client.chat.completions.create(
        model=model_name, messages=CHAT, max_tokens=5, **GREEDY_FIXED,
        extra_body={"guided_grammar": 'root ::= "yes" | "no"'},
    )  # fmt: skip
    assert grammar.choices[0].message.content in ("yes", "no")


def test_request_id_header_is_used(server, auth_headers):
    body = {"prompt": PROMPT, "max_tokens": 2, "temperature": 0}
    headers = {**auth_headers, "X-Request-Id": "my-request-42"}
    response = httpx.post(f"{server.url}/v1/completions", json=body, headers=headers, timeout=60)
    assert response.status_code == 200
    assert response.headers["x-request-id"] == "my-request-42"
    assert response.json()["id"] == "cmpl-my-request-42"


def test_tokenize_detokenize_roundtrip(server, auth_headers):
    tokens = httpx.post(f"{server.url}/tokenize", json={"prompt": "Hello world"}).json()
    assert tokens["count"] == len(tokens["tokens"]) > 0
    assert tokens["max_model_len"] == 2048
    text = httpx.post(f"{server.url}/detokenize", json={"tokens": tokens["tokens"]}).json()
    assert text["prompt"] == "Hello world"
    bad = httpx.post(f"{server.url}/detokenize", json={"tokens": [1, 10**9, -1]})
    assert bad.status_code == 400
    error = bad.json()["error"]
    assert error["param"] == "tokens" and error["type"] == "invalid_request_error"
    assert error["message"] == "tokens must be token ids in [0, 49152), got [1000000000, -1]"
