"""A thinking model's reasoning split off into `reasoning_content` (--reasoning-parser), whole and
streamed through the official openai client, also before a tool call; a constraint that holds
after the reasoning (deepseek_r1); chat_template_kwargs and continue_final_message on
/v1/chat/completions and /tokenize. The default model does not think: with the qwen3 parser (a
constraint holds from the first token) a regex makes it write the <think> block."""

from __future__ import annotations

import json
import re

import httpx
import openai
import pytest
from server_helpers import API_KEY, running_server

ASK = [{"role": "user", "content": "What is two plus two?"}]
THINK = r"<think>[a-z ]{4,40}</think>The answer is [0-9]\."
WEATHER = {
    "type": "function",
    "function": {"name": "get_weather", "parameters": {"type": "object"}},
}
THINK_THEN_CALL = (
    r'<think>[a-z ]{4,30}</think><tool_call>\n\{"name": "get_weather", "arguments": '
    r'\{"city": "[A-Z][a-z]{2,8}"\}\}\n</tool_call>'
)


@pytest.fixture(scope="module")
def server():
    with running_server("--reasoning-parser", "qwen3", "--tool-call-parser", "hermes") as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0)


# The default model's template with another system prompt: the deepseek_r1 server takes it from
# --chat-template (a file).
TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a careful assistant.<|im_end|>\n' }}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


@pytest.fixture(scope="module")
def r1_client(tmp_path_factory):
    template = tmp_path_factory.mktemp("template") / "chat_template.jinja"
    template.write_text(TEMPLATE)
    with running_server("--reasoning-parser", "deepseek_r1", "--chat-template", str(template),
                        "--trust-request-chat-template") as s:  # fmt: skip
        yield openai.OpenAI(base_url=f"{s.url}/v1", api_key=API_KEY, max_retries=0)


def test_the_chat_template_flag_replaces_the_models(r1_client, client):
    def prompt(c):
        url = str(c.base_url).removesuffix("/v1/")
        body = {"messages": ASK}
        tokens = httpx.post(f"{url}/tokenize", json=body, timeout=30,
                            headers={"Authorization": f"Bearer {API_KEY}"}).json()["tokens"]  # fmt: skip
        detokenized = httpx.post(f"{url}/detokenize", json={"tokens": tokens}, timeout=30,
                                 headers={"Authorization": f"Bearer {API_KEY}"})  # fmt: skip
        return detokenized.json()["prompt"]

    assert prompt(r1_client).startswith("<|im_start|>system\nYou are a careful assistant.")
    assert "careful" not in prompt(client)  # the other server keeps the model's template


REQUEST_TEMPLATE = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"


def _post(client, path, body):
    url = str(client.base_url).removesuffix("/v1/")
    return httpx.post(f"{url}{path}", json=body, timeout=60,
                      headers={"Authorization": f"Bearer {API_KEY}"})  # fmt: skip


def test_a_request_brings_its_chat_template_where_the_server_trusts_it(r1_client, client):
    body = {"messages": ASK, "chat_template": REQUEST_TEMPLATE}
    tokens = _post(r1_client, "/tokenize", body).json()["tokens"]
    prompt = _post(r1_client, "/detokenize", {"tokens": tokens}).json()["prompt"]
    assert prompt == "[user] What is two plus two?\n"
    response = _create(r1_client, max_tokens=4, extra_body={"chat_template": REQUEST_TEMPLATE})
    assert response.usage.prompt_tokens == len(tokens)
    # Refused without --trust-request-chat-template, and a template that is not Jinja text.
    for c, template, words in [
        (client, REQUEST_TEMPLATE, "--trust-request-chat-template"),
        (r1_client, "/etc/hostname", "Jinja text"),
        (r1_client, "{% for m in messages %}", "not a valid Jinja template"),
    ]:
        for path in ("/tokenize", "/v1/chat/completions"):
            r = _post(c, path, {"messages": ASK, "chat_template": template, "model": None})
            assert r.status_code == 400, r.text
            error = r.json()["error"]
            assert error["param"] == "chat_template" and words in error["message"], error
    assert _create(r1_client, max_tokens=2).choices  # the server serves on


def _create(client, **kwargs):
    kwargs.setdefault("messages", ASK)
    kwargs.setdefault("max_tokens", 48)
    model = client.models.list().data[0].id
    return client.chat.completions.create(model=model, temperature=0.0, **kwargs)


def _streamed(client, **kwargs):
    chunks = [c for c in _create(client, stream=True, **kwargs) if c.choices]
    reasoning = "".join(getattr(c.choices[0].delta, "reasoning_content", None) or "" for c in chunks)  # fmt: skip
    content = "".join(c.choices[0].delta.content or "" for c in chunks)
    return chunks, reasoning, content


def _reasoning_tokens(usage):
    return usage.completion_tokens_details.reasoning_tokens


def test_the_reasoning_is_split_off_whole_and_streamed(client):
    forced = {"structured_outputs": {"regex": THINK}}
    response = _create(client, extra_body=forced, logprobs=True)
    message = response.choices[0].message
    assert re.fullmatch(r"[a-z ]{4,40}", message.reasoning_content), message
    assert re.fullmatch(r"The answer is [0-9]\.", message.content), message
    # usage counts the tokens up to and with the one that completes </think>.
    pieces = [t.token for t in response.choices[0].logprobs.content]
    written = ["".join(pieces[: i + 1]) for i in range(len(pieces))]
    upto_end = next(i + 1 for i, text in enumerate(written) if "</think>" in text)
    assert 4 < upto_end < response.usage.completion_tokens
    assert _reasoning_tokens(response.usage) == upto_end
    chunks, reasoning, content = _streamed(client, extra_body=forced)
    assert (reasoning, content) == (message.reasoning_content, message.content)
    last = list(_create(client, stream=True, extra_body=forced,
                        stream_options={"include_usage": True}))[-1]  # fmt: skip
    assert _reasoning_tokens(last.usage) == upto_end
    hidden = {**forced, "include_reasoning": False}
    plain = _create(client, extra_body=hidden).choices[0].message
    assert (plain.reasoning_content, plain.content) == (None, message.content)
    assert _streamed(client, extra_body=hidden)[1:] == ("", message.content)
    # The reasoning went out piecewise, before any of the answer.
    kinds = [
        "r" if getattr(c.choices[0].delta, "reasoning_content", None) else "c"
        for c in chunks
        if getattr(c.choices[0].delta, "reasoning_content", None) or c.choices[0].delta.content
    ]
    assert kinds.count("r") > 1 and "".join(kinds).lstrip("r").strip("c") == ""


def test_without_the_opening_tag_all_is_content(client):
    """qwen3: an output that does not open <think> (thinking off) is all content."""
    response = _create(client, max_tokens=16)
    message = response.choices[0].message
    assert message.content and message.reasoning_content is None
    assert _reasoning_tokens(response.usage) == 0
    _, reasoning, content = _streamed(client, max_tokens=16)
    assert (reasoning, content) == ("", message.content)


def test_an_output_without_the_closing_tag_is_all_reasoning(r1_client):
    """deepseek_r1: the template opens the block in the prompt, so until </think> the output
    is reasoning (here the whole output, which never closes it)."""
    response = _create(r1_client, max_tokens=16)
    message = response.choices[0].message
    assert message.reasoning_content and message.content is None
    assert _reasoning_tokens(response.usage) == response.usage.completion_tokens == 16
    _, reasoning, content = _streamed(r1_client, max_tokens=16)
    assert (reasoning, content) == (message.reasoning_content, "")


def test_a_tool_call_after_the_reasoning(client):
    forced = {"structured_outputs": {"regex": THINK_THEN_CALL}}
    choice = _create(client, tools=[WEATHER], extra_body=forced, max_tokens=80).choices[0]
    assert choice.finish_reason == "tool_calls"
    assert re.fullmatch(r"[a-z ]{4,30}", choice.message.reasoning_content)
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather" and set(json.loads(call.function.arguments)) == {"city"}  # fmt: skip
    chunks, reasoning, _ = _streamed(client, tools=[WEATHER], extra_body=forced, max_tokens=80)
    calls = [t for c in chunks for t in c.choices[0].delta.tool_calls or []]
    assert reasoning == choice.message.reasoning_content
    assert calls[0].function.name == "get_weather"
    assert "".join(t.function.arguments for t in calls) == call.function.arguments


def test_a_constraint_holds_after_the_reasoning(r1_client):
    """deepseek_r1: the model reasons freely and the constraint holds from </think> on (the
    default model never writes it here, so its output is the unconstrained one, all
    reasoning); where the prompt closed the block already, the constraint holds at once and
    the JSON answer is content."""
    json_mode = {"type": "json_object"}
    client = r1_client
    free = _create(client, max_tokens=24).choices[0].message
    thinking = _create(client, response_format=json_mode, max_tokens=24).choices[0].message
    assert thinking.reasoning_content == free.reasoning_content and thinking.content is None
    closed = [*ASK, {"role": "assistant", "content": "<think>easy</think>"}]
    reply = _create(client, messages=closed, response_format=json_mode, max_tokens=24, extra_body={
        "add_generation_prompt": False, "continue_final_message": True})  # fmt: skip
    message = reply.choices[0].message
    assert message.reasoning_content is None and message.content.lstrip().startswith("{")


def test_template_options(client, server):
    opened = [*ASK, {"role": "assistant", "content": "Two plus two is"}]
    headers = {"Authorization": f"Bearer {API_KEY}"}
    tokens = httpx.post(
        f"{server.url}/tokenize", headers=headers, timeout=30,
        json={"messages": opened, "add_generation_prompt": False, "continue_final_message": True},
    ).json()["tokens"]  # fmt: skip
    closed = httpx.post(
        f"{server.url}/tokenize", headers=headers, timeout=30,
        json={"messages": opened, "add_generation_prompt": False},
    ).json()["tokens"]  # fmt: skip
    assert closed[: len(tokens)] == tokens and len(closed) > len(tokens)  # no end of turn
    reply = _create(client, messages=opened, max_tokens=8, extra_body={
        "add_generation_prompt": False, "continue_final_message": True,
        "chat_template_kwargs": {"enable_thinking": False},
    })  # fmt: skip
    assert reply.usage.prompt_tokens == len(tokens)
    for extra, field, words in [
        ({"continue_final_message": True}, "continue_final_message", "add_generation_prompt"),
        ({"chat_template_kwargs": {"add_generation_prompt": False}}, "chat_template_kwargs", "may not set"),
        ({"chat_template_kwargs": ["x"]}, "chat_template_kwargs", "dict"),
    ]:  # fmt: skip
        with pytest.raises(openai.BadRequestError) as info:
            _create(client, messages=opened, extra_body=extra)
        error = info.value.body
        assert error["param"].startswith(field) and words in error["message"], error
    # The server still serves.
    assert _create(client, max_tokens=4).choices[0].message.content


def test_forced_calls_wait_for_the_reasoning_whole_and_streamed(r1_client):
    """deepseek_r1 with tool_choice "required": the calls' constraint waits for </think>, which
    the default model does not write within max_tokens: no call, the reasoning kept whole,
    streamed too (the "required" stream sends its message at the end)."""
    message = _create(r1_client, tools=[WEATHER], tool_choice="required", max_tokens=16).choices[0].message  # fmt: skip
    assert message.reasoning_content and not message.tool_calls and message.content is None
    _, reasoning, content = _streamed(r1_client, tools=[WEATHER], tool_choice="required", max_tokens=16)  # fmt: skip
    assert (reasoning, content) == (message.reasoning_content, "")
