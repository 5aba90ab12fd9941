"""Tool calls through the official openai client: a named function or "required" calls, forced
by structured outputs, whole and streamed; earlier calls and tool results sent back in a
conversation; the choices that cannot hold are 400s naming the field."""

from __future__ import annotations

import json
import re

import httpx
import pytest
from server_helpers import API_KEY, running_server, start_server

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 20},
                "unit": {"enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "The local time in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 20}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
ASK = [{"role": "user", "content": "What is the weather in Paris and what time is it there?"}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}


def _create(client, model_name, **kwargs):
    kwargs.setdefault("messages", ASK)
    return client.chat.completions.create(
        model=model_name, temperature=0.0, max_tokens=120, **kwargs
    )


def test_a_named_function_is_called_with_arguments_valid_under_its_schema(client, model_name):
    reply = _create(client, model_name, tools=[WEATHER, TIME], tool_choice=NAMED)
    choice = reply.choices[0]
    assert choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == "get_weather"
    arguments = json.loads(call.function.arguments)
    assert set(arguments) == {"city", "unit"} and arguments["unit"] in ("celsius", "fahrenheit")
    assert choice.finish_reason == "stop"  # OpenAI's for a forced function


def test_a_streamed_named_call_matches_the_whole_one(client, model_name):
    whole = _create(client, model_name, tools=[WEATHER, TIME], tool_choice=NAMED)
    stream = _create(client, model_name, tools=[WEATHER, TIME], tool_choice=NAMED, stream=True)
    deltas = [c.choices[0].delta.tool_calls for c in stream if c.choices]
    deltas = [d for d in deltas if d]
    first = deltas[0][0]
    assert (
        first.index == 0 and first.id.startswith("call_") and first.function.name == "get_weather"
    )
    assert all(d[0].id is None and d[0].function.name is None for d in deltas[1:])
    arguments = "".join(d[0].function.arguments for d in deltas)
    assert arguments == whole.choices[0].message.tool_calls[0].function.arguments


@pytest.mark.parametrize("parallel", [None, False])
def test_required_calls_name_the_tools_with_valid_arguments(client, model_name, parallel):
    extra = {} if parallel is None else {"parallel_tool_calls": parallel}
    reply = _create(client, model_name, tools=[WEATHER, TIME], tool_choice="required", **extra)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls"
    calls = choice.message.tool_calls
    assert len(calls) >= 1 and (parallel is None or len(calls) == 1)
    for call in calls:
        arguments = json.loads(call.function.arguments)
        assert call.function.name in ("get_weather", "get_time")
        expected = {"city", "unit"} if call.function.name == "get_weather" else {"city"}
        assert set(arguments) == expected
    assert len({c.id for c in calls}) == len(calls)
    stream = _create(client, model_name, tools=[WEATHER, TIME], tool_choice="required", stream=True, **extra)  # fmt: skip
    chunks = [c for c in stream if c.choices]
    streamed = [
        t for c in chunks if c.choices[0].delta.tool_calls for t in c.choices[0].delta.tool_calls
    ]
    assert [(t.function.name, t.function.arguments) for t in streamed] == [
        (c.function.name, c.function.arguments) for c in calls
    ]  # fmt: skip
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_a_conversation_with_earlier_calls_and_tool_results(client, model_name):
    messages = ASK + [
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21}'},
    ]
    reply = _create(client, model_name, messages=messages, tools=[WEATHER], tool_choice="none")
    assert reply.choices[0].message.content and not reply.choices[0].message.tool_calls
    plain = _create(client, model_name, tools=[WEATHER], tool_choice="none")
    assert plain.choices[0].finish_reason in ("stop", "length")


@pytest.mark.parametrize(
    ("body", "param", "message"),
    [
        ({"tool_choice": "required"}, "tool_choice", "tool_choice requires tools"),
        ({"tools": [WEATHER]}, "tool_choice", 'tool_choice "auto"'),
        ({"tools": [WEATHER], "tool_choice": "auto"}, "tool_choice", "needs a tool-call parser"),
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "x"}}},
            "tool_choice.function.name",
            r"must be one of \['get_weather'\]",
        ),
        (
            {
                "tools": [
                    WEATHER,
                    {"type": "function", "function": {"name": "f", "parameters": {"type": "nope"}}},
                ],
                "tool_choice": "required",
            },
            "tools.1.function.parameters",
            "not a JSON schema",
        ),
        (
            {"tools": [WEATHER, WEATHER], "tool_choice": "required"},
            "tools",
            "each function once",
        ),
        (
            {"tools": [WEATHER], "tool_choice": NAMED, "response_format": {"type": "json_object"}},
            "tool_choice",
            "conflicts",
        ),
        ({"tools": [{"type": "retrieval", "function": WEATHER["function"]}]}, "tools.0.type", ""),
    ],
)
def test_tool_choices_that_cannot_hold_are_400s(server, auth_headers, model_name, body, param, message):  # fmt: skip
    response = httpx.post(
        f"{server.url}/v1/chat/completions",
        headers=auth_headers,
        json={"model": model_name, "messages": ASK, "max_tokens": 8, **body},
        timeout=60,
    )
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param
    assert error["type"] == "invalid_request_error"
    assert re.search(message, error["message"]), error["message"]


# --- tool_choice "auto" with a tool-call parser ---------------------------------------------

FORCED_HERMES = (
    r'<tool_call>\n\{"name": "get_weather", "arguments": '
    r'\{"city": "[A-Z][a-z]{2,8}", "unit": "celsius"\}\}\n</tool_call>'
)


@pytest.fixture(scope="module")
def hermes_server():
    with running_server("--tool-call-parser", "hermes", "--enable-auto-tool-choice") as server:
        yield server


def test_auto_reads_the_calls_the_model_writes(hermes_server):
    """The default model does not write hermes calls by itself: a regex constraint makes it
    (auto leaves the output free, so a client constraint may hold), and the parser reads them."""
    import openai

    client = openai.OpenAI(base_url=f"{hermes_server.url}/v1", api_key=API_KEY, max_retries=0)
    model = client.models.list().data[0].id
    forced = {"structured_outputs": {"regex": FORCED_HERMES}}
    reply = client.chat.completions.create(
        model=model, messages=ASK, tools=[WEATHER, TIME], temperature=0.0, max_tokens=60,
        extra_body=forced,
    )  # fmt: skip
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments)["unit"] == "celsius"
    stream = client.chat.completions.create(
        model=model, messages=ASK, tools=[WEATHER, TIME], temperature=0.0, max_tokens=60,
        extra_body=forced, stream=True,
    )  # fmt: skip
    chunks = [c for c in stream if c.choices]
    calls = [
        t for c in chunks if c.choices[0].delta.tool_calls for t in c.choices[0].delta.tool_calls
    ]
    # The call's first delta carries its id and name, the later ones pieces of its arguments,
    # sent as the model writes them: together the whole reply's arguments.
    assert calls[0].function.name == "get_weather" and calls[0].id and calls[0].type == "function"
    assert len(calls) > 3 and all(t.index == 0 for t in calls)
    assert all(t.function.name is None and t.id is None for t in calls[1:])
    assert "".join(t.function.arguments for t in calls) == call.function.arguments
    assert not "".join(c.choices[0].delta.content or "" for c in chunks)
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    # Left free, the model answers in text: content, no calls.
    free = client.chat.completions.create(
        model=model, messages=ASK, tools=[WEATHER], tool_choice="auto", temperature=0.0, max_tokens=24
    )  # fmt: skip
    assert free.choices[0].message.content and not free.choices[0].message.tool_calls
    assert free.choices[0].finish_reason in ("stop", "length")


def test_enable_auto_tool_choice_needs_a_parser():
    with pytest.raises(pytest.fail.Exception, match="needs --tool-call-parser"):
        start_server("--enable-auto-tool-choice")
