"""Tool-call parsers for `tool_choice: "auto"`: the model decides whether to call a tool, in its
own format, and the parser reads the calls out of its text, whole or as it streams.

- `hermes` (Qwen2.5 / Qwen3, Hermes 2 / 3): `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`
  blocks; the text around them is content.
- `llama3_json` (Llama 3.1 - 3.3): the output is one JSON object `{"name": ..., "parameters":
  {...}}` (after `<|python_tag|>` where the tokenizer keeps it), or several separated by `;`.
- `mistral` (Mistral / Mixtral instruct, Mistral Small / Large, Ministral): after
  `[TOOL_CALLS]`, a JSON array of `{"name": ..., "arguments": {...}}` (tokenizers before v11) or
  `name[ARGS]{...}` calls one after the other (v11 and later); text before it is content.
- `pythonic` (Llama 3.2 / Llama 4, ToolACE and others): the output is a Python list of calls
  with literal keyword arguments, `[get_weather(city="Paris"), get_time(zone="CET")]` (inside
  `<|python_start|>` ... `<|python_end|>` where the tokenizer keeps them).
- `deepseek_v3` (DeepSeek-V3 / R1): `<｜tool▁calls▁begin｜>` then per call
  `<｜tool▁call▁begin｜>function<｜tool▁sep｜>name` and its arguments as a ```json block,
  `<｜tool▁call▁end｜>`; text before it is content.

One streaming implementation serves both uses: a whole text is fed at once. A streamer holds back
only what might still turn into a call (the start of a tag, a block whose call has not begun);
a block that does not hold a call (invalid JSON, cut by max_tokens before its arguments began)
goes out as content, as written.

Calls stream piecewise, as OpenAI's do: a call's first delta carries its name once the name and
the opening `{` of its arguments object are written, later deltas the arguments' text as it
grows (JSON parsers; the pythonic one sends each call whole at the end). The arguments are the
model's own JSON text, whole or streamed, so the pieces add up to the whole output's arguments.
From its first delta on, a call is a call: cut by max_tokens, its arguments are what was
written (the finish reason says "length"), and a block that turns out malformed after its
arguments began still ends that call rather than becoming content.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from v1_engine.entrypoints.json_stream import (
    WHITESPACE,
    CallObject,
    ValueEnd,
    literal,
    partial_suffix,
    skip,
)


@dataclass(frozen=True)
class ParsedCall:
    name: str
    arguments: str
    """The arguments object as JSON text."""


@dataclass(frozen=True)
class CallDelta:
    """A piece of the calls: `name` set begins a new call; `arguments` continues the current
    call's arguments text."""

    name: str | None
    arguments: str


@dataclass
class Parsed:
    """What a piece of output holds: content text to send, and the call deltas in it."""

    content: str = ""
    deltas: list[CallDelta] = field(default_factory=list)

    def extend(self, other: Parsed) -> None:
        self.content += other.content
        self.deltas.extend(other.deltas)

    @property
    def calls(self) -> list[ParsedCall]:
        """The deltas folded into whole calls (for a whole output)."""
        calls: list[ParsedCall] = []
        for delta in self.deltas:
            if delta.name is not None:
                calls.append(ParsedCall(delta.name, delta.arguments))
            elif calls:
                calls[-1] = ParsedCall(calls[-1].name, calls[-1].arguments + delta.arguments)
        return calls


def _call(obj: Any, arguments_keys: tuple[str, ...]) -> ParsedCall | None:
    """A call from a decoded JSON object with a string `name` and an arguments object."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    for key in arguments_keys:
        if key in obj:
            arguments = obj[key]
            if isinstance(arguments, str):
                return ParsedCall(obj["name"], arguments)
            return ParsedCall(obj["name"], json.dumps(arguments, ensure_ascii=False))
    return ParsedCall(obj["name"], "{}") if len(obj) == 1 else None


def _whole(call: ParsedCall) -> CallDelta:
    return CallDelta(call.name, call.arguments)


class _Announcer:
    """The deltas of the call being written: its name with the arguments so far, then the
    arguments' new text each time."""

    def __init__(self) -> None:
        self.sent: int | None = None
        """Arguments characters sent; None before the call's first delta."""
        self.count = 0
        """Calls begun so far."""

    def emit(self, out: Parsed, name: str, arguments: str) -> None:
        if self.sent is None:
            out.deltas.append(CallDelta(name, arguments))
            self.count += 1
        elif len(arguments) > self.sent:
            out.deltas.append(CallDelta(None, arguments[self.sent :]))
        self.sent = len(arguments)

    @property
    def begun(self) -> bool:
        """Whether the current call has sent its first delta."""
        return self.sent is not None

    def next_call(self) -> None:
        self.sent = None


class ToolStreamer:
    """Incremental parsing of one completion."""

    keeps_special_tokens = False
    """Whether the calls' markers are special tokens the detokenizer must keep (the request's
    skip_special_tokens is then turned off)."""

    def feed(self, text: str) -> Parsed:
        raise NotImplementedError

    def finish(self) -> Parsed:
        """The end of the output: what was held back, as calls or content."""
        raise NotImplementedError


class _ObjectCalls:
    """Call objects one after another in a text (between them only `separators`), each sent
    piecewise as it is written. `broken`: something other than a call object came next."""

    def __init__(self, arguments_keys: tuple[str, ...], separators: str, start: int = 0) -> None:
        self.arguments_keys = arguments_keys
        self.separators = separators
        self.pos = start
        """Where the next call object starts (after the last one's end)."""
        self.broken = False
        self.announcer = _Announcer()
        self._current: CallObject | None = None

    def advance(self, text: str, out: Parsed) -> None:
        while not self.broken:
            if self._current is None:
                i = skip(text, self.pos, self.separators)
                if i == len(text):
                    return
                if text[i] != "{":
                    self.broken = True
                    return
                self._current = CallObject(i, self.arguments_keys)
            call = self._current
            call.advance(text)
            arguments = call.arguments_text(text)
            if arguments is not None:
                assert call.name is not None
                self.announcer.emit(out, call.name, arguments)
            if call.failed:
                self.broken = True
                return
            if call.end is None:
                return
            if not self.announcer.begun:  # a whole object without an arguments object
                try:
                    whole = _call(json.loads(text[call.start : call.end]), self.arguments_keys)
                except ValueError:
                    whole = None
                if whole is None:
                    self.broken = True
                    return
                out.deltas.append(_whole(whole))
                self.announcer.count += 1
            self.announcer.next_call()
            self.pos, self._current = call.end, None


class HermesStreamer(ToolStreamer):
    OPEN, CLOSE = "<tool_call>", "</tool_call>"
    KEYS = ("arguments", "parameters")

    def __init__(self) -> None:
        self._buffer = ""
        self._inside = False
        self._block: _ObjectCalls | None = None

    def feed(self, text: str) -> Parsed:
        self._buffer += text
        out = Parsed()
        while True:
            if self._inside:
                assert self._block is not None
                end = self._buffer.find(self.CLOSE)
                block = self._buffer if end < 0 else self._buffer[:end]
                self._block.advance(block, out)
                if end < 0:
                    return out
                self._buffer = self._buffer[end + len(self.CLOSE) :]
                self._inside = False
                if not self._block.announcer.count:
                    call = self._parse_block(block)
                    if call is None:
                        out.content += self.OPEN + block + self.CLOSE
                    else:
                        out.deltas.append(_whole(call))
                continue
            start = self._buffer.find(self.OPEN)
            if start >= 0:
                out.content += self._buffer[:start]
                self._buffer = self._buffer[start + len(self.OPEN) :]
                self._inside = True
                self._block = _ObjectCalls(self.KEYS, WHITESPACE)
                continue
            keep = partial_suffix(self._buffer, self.OPEN)
            out.content += self._buffer[: len(self._buffer) - keep]
            self._buffer = self._buffer[len(self._buffer) - keep :]
            return out

    def finish(self) -> Parsed:
        text, self._buffer = self._buffer, ""
        if self._inside:
            self._inside = False
            assert self._block is not None
            if self._block.announcer.count:  # a call cut short: it stays a call
                return Parsed()
            return Parsed(content=self.OPEN + text)
        return Parsed(content=text)

    @classmethod
    def _parse_block(cls, block: str) -> ParsedCall | None:
        try:
            obj = json.loads(block)
        except ValueError:
            return None
        return _call(obj, cls.KEYS)


class Llama3JsonStreamer(ToolStreamer):
    TAG = "<|python_tag|>"
    START = "{"
    streams_calls = True
    """Calls go out as they are written (JSON objects); else held to the end and parsed whole."""

    def __init__(self) -> None:
        self._buffer = ""
        self._mode: str | None = None
        """None until the output's first characters decide: "json" (calls) or "text" (streamed
        as content)."""
        self._calls: _ObjectCalls | None = None

    def feed(self, text: str) -> Parsed:
        if self._mode == "text":
            return Parsed(content=text)
        self._buffer += text
        if self._mode is None:
            head = self._buffer.lstrip()
            if not head or (self.TAG.startswith(head) and head != self.TAG):
                return Parsed()  # not decidable yet
            self._mode = "json" if head.startswith((self.START, self.TAG)) else "text"
            if self._mode == "text":
                text, self._buffer = self._buffer, ""
                return Parsed(content=text)
            start = len(self._buffer) - len(head)
            if head.startswith(self.TAG):
                start += len(self.TAG)
            self._calls = _ObjectCalls(("parameters", "arguments"), WHITESPACE + ";", start)
        out = Parsed()
        if self.streams_calls:
            assert self._calls is not None
            self._calls.advance(self._buffer, out)
        return out

    def finish(self) -> Parsed:
        text, self._buffer = self._buffer, ""
        if self._mode != "json":
            return Parsed(content=text)
        assert self._calls is not None
        if self._calls.announcer.count:  # the calls sent stand; text after them is content
            calls = self._calls
            cut = (
                not calls.broken or calls.announcer.begun
            )  # nothing after the calls, or a cut call
            return Parsed(content="" if cut else text[calls.pos :].strip())
        calls = self._parse(text.strip().removeprefix(self.TAG))
        return Parsed(deltas=[_whole(c) for c in calls]) if calls else Parsed(content=text)

    @staticmethod
    def _parse(text: str) -> list[ParsedCall] | None:
        decoder = json.JSONDecoder()
        calls, position = [], 0
        while True:
            while position < len(text) and text[position] in " \t\r\n;":
                position += 1
            if position == len(text):
                return calls or None
            try:
                obj, position = decoder.raw_decode(text, position)
            except ValueError:
                return None
            call = _call(obj, ("parameters", "arguments"))
            if call is None:
                return None
            calls.append(call)


class _MarkerStreamer(ToolStreamer):
    """Content streams until MARKER; the text after it is calls, sent as `_stream` reads them;
    at the end, when none was read, `_parse` reads the held text whole (None: it was not calls,
    all content)."""

    MARKER = ""

    def __init__(self) -> None:
        self._buffer = ""
        self._held = False
        self._announcer = _Announcer()
        self._pos = 0
        """Where `_stream` stands in the held text (which starts with the marker)."""
        self._broken = False
        self._arguments: ValueEnd | None = None
        self._name = ""

    def feed(self, text: str) -> Parsed:
        self._buffer += text
        if self._held:
            return self._read()
        start = self._buffer.find(self.MARKER)
        if start >= 0:
            content, self._buffer = self._buffer[:start], self._buffer[start:]
            self._held, self._pos = True, len(self.MARKER)
            out = self._read()
            out.content = content
            return out
        keep = partial_suffix(self._buffer, self.MARKER)
        cut = len(self._buffer) - keep
        content, self._buffer = self._buffer[:cut], self._buffer[cut:]
        return Parsed(content=content)

    def finish(self) -> Parsed:
        text, self._buffer = self._buffer, ""
        if not self._held:
            return Parsed(content=text)
        self._held = False
        if self._announcer.count:  # the calls sent stand (a cut one too)
            return Parsed()
        calls = self._parse(text[len(self.MARKER) :])
        return Parsed(deltas=[_whole(c) for c in calls]) if calls else Parsed(content=text)

    def _read(self) -> Parsed:
        out = Parsed()
        while not self._broken:
            if self._arguments is None:
                start = self._call_start(self._buffer)
                if start is None:
                    break
                if start < 0:
                    self._broken = True
                    break
                self._arguments = ValueEnd(start)
            end = self._arguments.advance(self._buffer)
            self._announcer.emit(out, self._name, self._buffer[self._arguments.start : end or len(self._buffer)])  # fmt: skip
            if end is None:
                break
            after = self._call_end(self._buffer, end)
            if after is None:
                break
            self._pos = after
            self._announcer.next_call()
            self._arguments = None
        return out

    def _call_start(self, text: str) -> int | None:
        """From self._pos: the index of the next call's arguments object (setting self._name and
        self._pos past what was read), -1 when what follows is not a call, None while unknown."""
        raise NotImplementedError

    def _call_end(self, text: str, end: int) -> int | None:
        """Where the next call may start, after a call whose arguments end at `end`."""
        return end

    @staticmethod
    def _parse(text: str) -> list[ParsedCall] | None:
        raise NotImplementedError


class MistralStreamer(_MarkerStreamer):
    MARKER = "[TOOL_CALLS]"
    ARGS = "[ARGS]"
    KEYS = ("arguments", "parameters")
    keeps_special_tokens = True

    def __init__(self) -> None:
        super().__init__()
        self._array: _ObjectCalls | None = None
        """The JSON array form (tokenizers before v11), once the text after the marker shows it."""

    def _read(self) -> Parsed:
        if self._array is None and not self._announcer.count:
            i = skip(self._buffer, self._pos)
            if i < len(self._buffer) and self._buffer[i] == "[":
                self._array = _ObjectCalls(self.KEYS, WHITESPACE + ",", i + 1)
                self._array.announcer = self._announcer
        if self._array is None:
            return super()._read()
        out = Parsed()
        self._array.advance(self._buffer, out)
        return out

    def _call_start(self, text: str) -> int | None:
        i = skip(text, self._pos)
        if i == len(text):
            return None
        after_marker = literal(text, i, self.MARKER)  # between calls of v11
        if after_marker is None:
            return None
        i = max(i, after_marker)
        args = text.find(self.ARGS, i)
        if args < 0:
            return None
        value = skip(text, args + len(self.ARGS))
        if value == len(text):
            return None
        self._name = text[i:args].strip()
        return value if self._name and text[value] == "{" else -1

    @classmethod
    def _parse(cls, text: str) -> list[ParsedCall] | None:
        text = text.strip()
        if text.startswith("["):  # the JSON array of tokenizers before v11
            try:
                objs = json.loads(text)
            except ValueError:
                return None
            objs = objs if isinstance(objs, list) else [objs]
            calls = [_call(obj, cls.KEYS) for obj in objs]
            return None if not calls or None in calls else calls  # type: ignore[return-value]
        return None  # name[ARGS]{...} calls are read as they stream


class DeepSeekV3Streamer(_MarkerStreamer):
    MARKER = "<｜tool▁calls▁begin｜>"
    CALL_BEGIN, SEP, CALL_END = "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>", "<｜tool▁call▁end｜>"
    END = "<｜tool▁calls▁end｜>"
    FENCE = "```json"
    keeps_special_tokens = True

    def _call_start(self, text: str) -> int | None:
        i = skip(text, self._pos)
        if i == len(text):
            return None
        begin = literal(text, i, self.CALL_BEGIN)
        if begin is None or begin < 0:
            return begin  # the calls' end marker, or not a call
        sep = text.find(self.SEP, begin)
        newline = text.find("\n", sep + len(self.SEP)) if sep >= 0 else -1
        if newline < 0:
            return None
        if text[begin:sep].strip() != "function":
            return -1
        fence = literal(text, skip(text, newline), self.FENCE)
        if fence is None or fence < 0:
            return fence
        value = skip(text, fence)
        if value == len(text):
            return None
        self._name = text[sep + len(self.SEP) : newline].strip()
        return value if self._name and text[value] == "{" else -1

    def _call_end(self, text: str, end: int) -> int | None:
        close = text.find(self.CALL_END, end)
        return None if close < 0 else close + len(self.CALL_END)

    @staticmethod
    def _parse(text: str) -> list[ParsedCall] | None:
        return None  # the calls are read as they stream


class PythonicStreamer(Llama3JsonStreamer):
    """The Llama3JsonStreamer's decision (the output's first characters), on `[` or the tag;
    the calls are read whole at the end (Python syntax)."""

    TAG = "<|python_start|>"
    END = "<|python_end|>"
    START = "["
    streams_calls = False

    @classmethod
    def _parse(cls, text: str) -> list[ParsedCall] | None:
        import ast

        text = text.strip().removesuffix(cls.END).strip()
        try:
            tree = ast.parse(text, mode="eval").body
        except SyntaxError:
            return None
        if not isinstance(tree, ast.List) or not tree.elts:
            return None
        calls = []
        for node in tree.elts:
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)) or node.args:
                return None
            try:
                arguments = {kw.arg: ast.literal_eval(kw.value) for kw in node.keywords}
            except ValueError:
                return None
            if None in arguments:  # **kwargs
                return None
            calls.append(ParsedCall(node.func.id, json.dumps(arguments, ensure_ascii=False)))
        return calls


TOOL_PARSERS: dict[str, type[ToolStreamer]] = {
    "deepseek_v3": DeepSeekV3Streamer,
    "hermes": HermesStreamer,
    "llama3_json": Llama3JsonStreamer,
    "mistral": MistralStreamer,
    "pythonic": PythonicStreamer,
}


def parse_tool_calls(parser: str, text: str) -> Parsed:
    """A whole output's content and calls."""
    streamer = TOOL_PARSERS[parser]()
    parsed = streamer.feed(text)
    parsed.extend(streamer.finish())
    return parsed
