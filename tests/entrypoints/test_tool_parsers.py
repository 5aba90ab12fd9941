"""The tool-call parsers of tool_choice "auto": calls and content read from whole outputs, and
the same read from the output streamed in any pieces (held back only while a call may form; a
call's arguments sent piecewise as they are written)."""

from __future__ import annotations

import pytest

from v1_engine.entrypoints.tool_parsers import (
    TOOL_PARSERS,
    CallDelta,
    Parsed,
    ParsedCall,
    parse_tool_calls,
)

HERMES = [
    # (text, content, calls)
    (
        ('Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
        '</tool_call>\n<tool_call>{"name": "now", "arguments": {}}</tool_call>'),
        "Let me look.\n\n",
        [ParsedCall("get_weather", '{"city": "Paris"}'), ParsedCall("now", "{}")],
    ),
    ("No tools needed: 2 < 3 and <tool is not a tag.", "No tools needed: 2 < 3 and <tool is not a tag.", []),
    # Not JSON inside the tags: the block is content, as written.
    ("<tool_call>{name: x}</tool_call> done", "<tool_call>{name: x}</tool_call> done", []),
    # Cut by max_tokens inside a block before the arguments began: content too.
    ('ok <tool_call>{"name": "get_weather", "argu', 'ok <tool_call>{"name": "get_weather", "argu', []),
    # Cut after they began: a call, with the arguments as written.
    ('ok <tool_call>{"name": "get_weather", "arguments": {"ci', "ok ", [ParsedCall("get_weather", '{"ci')]),
    # The arguments as the model wrote them (no reformatting); the keys in any order; an
    # arguments string; a call without arguments.
    ('<tool_call>{"name":"f","arguments":{"a":[1,{"b":"}"}]}}</tool_call>', "", [ParsedCall("f", '{"a":[1,{"b":"}"}]}')]),
    ('<tool_call>{"arguments": {"x": "\\\\"}, "name": "g"}</tool_call>', "", [ParsedCall("g", '{"x": "\\\\"}')]),
    ('<tool_call>{"name": "h", "arguments": "{\\"x\\": 1}"}</tool_call>', "", [ParsedCall("h", '{"x": 1}')]),
    ('<tool_call>{"name": "now"}</tool_call>.', ".", [ParsedCall("now", "{}")]),
    # A partial opening tag at the end is not held forever.
    ("ends with <tool_", "ends with <tool_", []),
]  # fmt: skip
LLAMA3 = [
    (
        (
            '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo"}}; '
            '{"name": "now", "parameters": {}}'
        ),
        "",
        [ParsedCall("get_weather", '{"city": "Oslo"}'), ParsedCall("now", "{}")],
    ),
    ('  {"name": "now", "arguments": {"tz": "UTC"}}', "", [ParsedCall("now", '{"tz": "UTC"}')]),
    ("The answer is 4.", "The answer is 4.", []),
    ('{"result": 4}', '{"result": 4}', []),  # JSON, but not a call
    ('{"name": "now", "parameters": {', "", [ParsedCall("now", "{")]),  # cut: the call stands
    ('{"name": "now", "parameters": {}} and more', "and more", [ParsedCall("now", "{}")]),
]

MISTRAL = [
    (  # v11+ tokenizers: name[ARGS]{...}, one after the other
        'Checking.[TOOL_CALLS]get_weather[ARGS]{"city": "Lyon", "days": [1, 2]}[TOOL_CALLS]now[ARGS]{}',
        "Checking.",
        [ParsedCall("get_weather", '{"city": "Lyon", "days": [1, 2]}'), ParsedCall("now", "{}")],
    ),
    (  # older tokenizers: a JSON array
        '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Nice"}}, {"name": "now", "arguments": {}}]',
        "",
        [ParsedCall("get_weather", '{"city": "Nice"}'), ParsedCall("now", "{}")],
    ),
    ("No call [TOOL", "No call [TOOL", []),  # a partial marker at the end goes out
    ('[TOOL_CALLS]get_weather[ARGS]{"city', "", [ParsedCall("get_weather", '{"city')]),  # cut
    ("[TOOL_CALLS]not a call", "[TOOL_CALLS]not a call", []),
]
PYTHONIC = [
    (
        '[get_weather(city="San Francisco", units=["c", "f"]), now()]',
        "",
        [
            ParsedCall("get_weather", '{"city": "San Francisco", "units": ["c", "f"]}'),
            ParsedCall("now", "{}"),
        ],
    ),
    (
        "<|python_start|>[add(a=1, b=2.5, exact=True)]<|python_end|>",
        "",
        [ParsedCall("add", '{"a": 1, "b": 2.5, "exact": true}')],
    ),
    ("[1, 2, 3]", "[1, 2, 3]", []),  # a list, but not of calls
    ("[f(x)]", "[f(x)]", []),  # positional / non-literal arguments: not a call
    ("[f(a=", "[f(a=", []),
    ("Paris is the capital.", "Paris is the capital.", []),
]
DS = (
    "<｜tool▁calls▁begin｜>",
    "<｜tool▁call▁begin｜>",
    "<｜tool▁sep｜>",
    "<｜tool▁call▁end｜>",
    "<｜tool▁calls▁end｜>",
)
DEEPSEEK = [
    (
        (f"Let me check.{DS[0]}{DS[1]}function{DS[2]}get_weather\n```json\n{{\"city\": \"Rome\"}}\n```{DS[3]}"
         f"{DS[1]}function{DS[2]}now\n```json\n{{}}\n```{DS[3]}{DS[4]}"),
        "Let me check.",
        [ParsedCall("get_weather", '{"city": "Rome"}'), ParsedCall("now", "{}")],
    ),
    (f"{DS[0]}{DS[1]}function{DS[2]}get_weather\n```json\n{{\"ci", "", [ParsedCall("get_weather", '{"ci')]),  # cut
    (f"{DS[0]}{DS[1]}function{DS[2]}get_weather\n```js", None, []),  # cut before: all content
    ("Plain answer.", "Plain answer.", []),
]  # fmt: skip
DEEPSEEK[2] = (DEEPSEEK[2][0], DEEPSEEK[2][0], [])


def _streamed(parser: str, text: str, piece: int) -> Parsed:
    streamer = TOOL_PARSERS[parser]()
    out = Parsed()
    for i in range(0, len(text), piece):
        out.extend(streamer.feed(text[i : i + piece]))
    out.extend(streamer.finish())
    return out


@pytest.mark.parametrize(
    ("parser", "text", "content", "calls"),
    [("hermes", *case) for case in HERMES]
    + [("llama3_json", *case) for case in LLAMA3]
    + [("mistral", *case) for case in MISTRAL]
    + [("pythonic", *case) for case in PYTHONIC]
    + [("deepseek_v3", *case) for case in DEEPSEEK],
)
def test_calls_and_content_whole_and_streamed(parser, text, content, calls):
    whole = parse_tool_calls(parser, text)
    assert (whole.content, whole.calls) == (content, calls)
    for piece in (1, 2, 5, 13):
        streamed = _streamed(parser, text, piece)
        assert (streamed.content, streamed.calls) == (content, calls), piece


def test_streaming_holds_back_only_what_may_become_a_call():
    hermes = TOOL_PARSERS["hermes"]()
    assert hermes.feed("Sure, <tool").content == "Sure, "  # "<tool" may open a call
    assert hermes.feed("s are nice").content == "<tools are nice"
    got = hermes.feed('<tool_call>{"name": "f", "arguments": {}}')
    assert got.content == "" and got.deltas == [CallDelta("f", "{}")]  # before the closing tag
    got = hermes.feed("</tool_call> after")
    assert got.deltas == [] and got.content == " after"
    llama = TOOL_PARSERS["llama3_json"]()
    assert llama.feed(" ").content == ""  # undecided
    assert llama.feed("Hello").content == " Hello"  # text: streamed from now on
    assert llama.feed(" world").content == " world"


def test_parsers_whose_markers_are_special_tokens_keep_them_in_the_text():
    from v1_engine.entrypoints.protocol_openai import ChatCompletionRequest

    tools = [{"type": "function", "function": {"name": "now", "parameters": {"type": "object"}}}]
    body = ChatCompletionRequest(
        model="m", messages=[{"role": "user", "content": "hi"}], tools=tools
    )
    assert body.to_sampling_params(16, tool_call_parser="mistral").skip_special_tokens is False
    assert body.to_sampling_params(16, tool_call_parser="deepseek_v3").skip_special_tokens is False
    assert body.to_sampling_params(16, tool_call_parser="hermes").skip_special_tokens is True
    no_tools = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}])
    assert no_tools.to_sampling_params(16, tool_call_parser="mistral").skip_special_tokens is True


STREAMED_ARGUMENTS = [
    # (parser, text up to the point where the first call's arguments are half written, the rest)
    ("hermes", 'Sure.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par', 'is", "days": 3}}\n</tool_call>'),
    ("llama3_json", '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Par', 'is", "days": 3}}'),
    ("mistral", '[TOOL_CALLS]get_weather[ARGS]{"city": "Par', 'is", "days": 3}'),
    ("mistral", '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Par', 'is", "days": 3}}]'),
    ("deepseek_v3", f'{DS[0]}{DS[1]}function{DS[2]}get_weather\n```json\n{{"city": "Par', 'is", "days": 3}\n```' + DS[3] + DS[4]),
]  # fmt: skip


@pytest.mark.parametrize(("parser", "head", "tail"), STREAMED_ARGUMENTS)
def test_a_calls_arguments_stream_as_they_are_written(parser, head, tail):
    """The call's name goes out with the first piece of its arguments, before the call is
    complete; each later feed sends only the new arguments text; the pieces add up to the
    arguments as written, which is also what the whole output gives."""
    streamer = TOOL_PARSERS[parser]()
    first = streamer.feed(head)
    assert first.deltas == [CallDelta("get_weather", '{"city": "Par')]
    pieces = []
    for ch in tail:
        got = streamer.feed(ch)
        assert all(d.name is None for d in got.deltas) and got.content == ""
        pieces += [d.arguments for d in got.deltas]
    assert streamer.finish() == Parsed()
    assert '{"city": "Par' + "".join(pieces) == '{"city": "Paris", "days": 3}'
    assert pieces[:3] == ["i", "s", '"']  # one delta a character, no hold-back
    assert parse_tool_calls(parser, head + tail).calls == [
        ParsedCall("get_weather", '{"city": "Paris", "days": 3}')
    ]


def test_deltas_fold_into_calls():
    parsed = Parsed(
        deltas=[CallDelta("a", "{"), CallDelta(None, '"x": 1'), CallDelta(None, "}"), CallDelta("b", "{}")]
    )  # fmt: skip
    assert parsed.calls == [ParsedCall("a", '{"x": 1}'), ParsedCall("b", "{}")]
