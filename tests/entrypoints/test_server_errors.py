"""Bad requests get a 4xx with an OpenAI-style error body that names the problem."""

from __future__ import annotations

import httpx
import openai
import pytest

PROMPT = "Hello"


def post(server, path: str, auth_headers, **kwargs) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", headers=auth_headers, timeout=30, **kwargs)


def assert_error(response: httpx.Response, status: int, param: str | None = None) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["message"]
    if param is not None:
        assert error["param"] == param, error
    return error


def test_malformed_json(server, auth_headers):
    response = post(
        server,
        "/v1/completions",
        {**auth_headers, "Content-Type": "application/json"},
        content=b'{"prompt": "hi", "max_tokens": ',
    )
    error = assert_error(response, 400)
    assert "JSON" in error["message"]


@pytest.mark.parametrize("value", [b"NaN", b"Infinity"])
def test_non_finite_temperature(server, auth_headers, value):
    """Python's JSON parser takes NaN / Infinity; the request is still a 400 naming the field."""
    response = post(
        server,
        "/v1/completions",
        {**auth_headers, "Content-Type": "application/json"},
        content=b'{"prompt": "hi", "max_tokens": 2, "temperature": ' + value + b"}",
    )
    error = assert_error(response, 400, "temperature")
    assert "finite" in error["message"]


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"prompt": PROMPT, "max_tokens": "many"}, "max_tokens"),
        ({"prompt": PROMPT, "temperature": [1]}, "temperature"),
        ({"prompt": PROMPT, "max_token": 5}, "max_token"),
        ({"prompt": PROMPT, "max_tokens": -3}, "max_tokens"),
        ({"prompt": PROMPT, "n": 0}, "n"),
        ({"prompt": PROMPT, "n": 1000}, "n"),
        ({"prompt": PROMPT, "temperature": -1.0}, "temperature"),
        ({"prompt": PROMPT, "top_p": 1.5}, "top_p"),
        ({"max_tokens": 4}, "prompt"),
        ({"prompt": PROMPT, "logit_bias": {"abc": 1}}, "logit_bias.abc"),
        ({"prompt": PROMPT, "logit_bias": {"5": 101}}, "logit_bias"),
        ({"prompt": PROMPT, "logit_bias": {"99999999": 1}}, "logit_bias"),
        ({"prompt": PROMPT, "allowed_token_ids": []}, "allowed_token_ids"),
        ({"prompt": PROMPT, "top_k": 10**30}, "top_k"),
        ({"prompt": PROMPT, "stream_options": {"include_usage": True}}, "stream_options"),
        # The default fcfs policy has no use for a priority.
        ({"prompt": PROMPT, "priority": 3}, "priority"),
        ({"prompt": PROMPT, "priority": 3, "stream": True}, "priority"),
        # Past the vocabulary: once an engine-killing IndexError in the sampler.
        ({"prompt": PROMPT, "stop_token_ids": [99999999], "min_tokens": 2}, "stop_token_ids"),
        (
            {"prompt": PROMPT, "stream": True, "stop_token_ids": [99999999], "min_tokens": 2},
            "stop_token_ids",
        ),
    ],
)
def test_invalid_completion_fields(server, auth_headers, body, param):
    error = assert_error(post(server, "/v1/completions", auth_headers, json=body), 400, param)
    assert param in error["message"]
    # The engine took no harm: the next request is served.
    good = post(server, "/v1/completions", auth_headers, json={"prompt": PROMPT, "max_tokens": 2})
    assert good.status_code == 200, good.text


def test_invalid_chat_fields(server, auth_headers):
    bad_role = {"messages": [{"role": "wizard", "content": "hi"}]}
    assert_error(post(server, "/v1/chat/completions", auth_headers, json=bad_role), 400)
    empty = {"messages": []}
    assert_error(post(server, "/v1/chat/completions", auth_headers, json=empty), 400, "messages")
    top = {"messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 99}
    assert_error(post(server, "/v1/chat/completions", auth_headers, json=top), 400)


def test_response_format_text_is_the_default(client, model_name):
    """{"type": "text"} constrains nothing: the same greedy completion as without it."""
    request = {
        "model": model_name,
        "messages": [{"role": "user", "content": "Name a colour."}],
        "max_tokens": 8,
        "temperature": 0.0,
    }
    plain = client.chat.completions.create(**request)
    text = client.chat.completions.create(**request, response_format={"type": "text"})
    assert plain.choices[0].message.content
    assert text.choices[0].message.content == plain.choices[0].message.content
    assert text.usage.completion_tokens == plain.usage.completion_tokens


@pytest.mark.parametrize(
    ("body", "param", "message"),
    [
        (
            {"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": 3}}}},
            "response_format.json_schema.schema",
            "is not a JSON schema it supports",
        ),
        (
            {"response_format": {"type": "json_schema"}},
            "response_format.json_schema",
            "is required",
        ),
        ({"response_format": {"type": "xml"}}, "response_format.type", "'json_schema'"),
        ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs", "one"),
        ({"structured_outputs": {"regex": "(a"}}, "structured_outputs.regex", "regular"),
        ({"guided_regex": "(a"}, "guided_regex", "is not a regular expression"),
        ({"guided_choice": []}, "guided_choice", "non-empty list"),
        ({"guided_grammar": "root ::= nothing"}, "guided_grammar", "is not a grammar"),
        (
            {"response_format": {"type": "json_object"}, "guided_json": {"type": "object"}},
            "response_format",
            "each constrain the output",
        ),
    ],
)
def test_bad_output_constraints_are_refused_by_name(server, auth_headers, body, param, message):
    request = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **body}
    response = post(server, "/v1/chat/completions", auth_headers, json=request)
    error = assert_error(response, 400, param)
    assert message in error["message"], error
    good = post(server, "/v1/completions", auth_headers, json={"prompt": PROMPT, "max_tokens": 2})
    assert good.status_code == 200, good.text


def test_prompt_longer_than_context(client, model_name):
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=model_name, prompt="hello " * 3000, max_tokens=4)
    assert info.value.status_code == 400
    assert "maximum context length is 2048" in info.value.message


def test_max_tokens_beyond_context(client, model_name):
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=model_name, prompt=PROMPT, max_tokens=5000)
    assert info.value.body["param"] == "max_tokens"


def test_streaming_request_errors_before_the_stream(client, model_name):
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(
            model=model_name,
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=-1,
            stream=True,
        )


def test_unknown_model_is_404(client):
    with pytest.raises(openai.NotFoundError) as info:
        client.completions.create(model="no-such-model", prompt=PROMPT, max_tokens=2)
    assert info.value.body["param"] == "model"
    assert "no-such-model" in info.value.message


@pytest.mark.parametrize("key", [None, "wrong-key"])
def test_missing_or_wrong_api_key_is_401(server, key):
    headers = {} if key is None else {"Authorization": f"Bearer {key}"}
    response = httpx.post(
        f"{server.url}/v1/completions", json={"prompt": PROMPT}, headers=headers, timeout=10
    )
    error = assert_error(response, 401)
    assert "API key" in error["message"]
    assert httpx.get(f"{server.url}/v1/models", headers=headers).status_code == 401


def test_openai_client_with_wrong_key(server):
    bad = openai.OpenAI(base_url=f"{server.url}/v1", api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()


def test_unknown_route_is_404_json(server):
    assert_error(httpx.get(f"{server.url}/v2/nothing"), 404)
