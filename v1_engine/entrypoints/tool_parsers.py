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
only what might still turn into a call (the start of a tag, an unfinished block); a block that
does not hold a call (invalid JSON, cut by max_tokens) goes out as content, as written.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class ParsedCall:
    name: str
    arguments: str
    """The arguments object as JSON text."""


@dataclass
class Parsed:
    """What a piece of output holds: content text to send, and calls completed in it."""

    content: str = ""
    calls: list[ParsedCall] = field(default_factory=list)

    def extend(self, other: Parsed) -> None:
        self.content += other.content
        self.calls.extend(other.calls)


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


class HermesStreamer(ToolStreamer):
    OPEN, CLOSE = "<tool_call>", "</tool_call>"

    def __init__(self) -> None:
        self._buffer = ""
        self._inside = False

    def feed(self, text: str) -> Parsed:
        self._buffer += text
        out = Parsed()
        while True:
            if self._inside:
                end = self._buffer.find(self.CLOSE)
                if end < 0:
                    return out
                block = self._buffer[:end]
                self._buffer = self._buffer[end + len(self.CLOSE) :]
                self._inside = False
                call = self._parse_block(block)
                if call is None:
                    out.content += self.OPEN + block + self.CLOSE
                else:
                    out.calls.append(call)
                continue
            start = self._buffer.find(self.OPEN)
            if start >= 0:
                out.content += self._buffer[:start]
                self._buffer = self._buffer[start + len(self.OPEN) :]
                self._inside = True
                continue
            keep = _partial_suffix(self._buffer, self.OPEN)
            out.content += self._buffer[: len(self._buffer) - keep]
            self._buffer = self._buffer[len(self._buffer) - keep :]
            return out

    def finish(self) -> Parsed:
        text, self._buffer = self._buffer, ""
        if self._inside:
            self._inside = False
            return Parsed(content=self.OPEN + text)
        return Parsed(content=text)

    @staticmethod
    def _parse_block(block: str) -> ParsedCall | None:
        try:
            obj = json.loads(block)
        except ValueError:
            return None
        return _call(obj, ("arguments", "parameters"))


class Llama3JsonStreamer(ToolStreamer):
    TAG = "<|python_tag|>"
    START = "{"

    def __init__(self) -> None:
        self._buffer = ""
        self._mode: str | None = None
        """None until the output's first characters decide: "json" (held to the end) or
        "text" (streamed as content)."""

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
        return Parsed()

    def finish(self) -> Parsed:
        text, self._buffer = self._buffer, ""
        if self._mode != "json":
            return Parsed(content=text)
        calls = self._parse(text.strip().removeprefix(self.TAG))
        return Parsed(calls=calls) if calls else Parsed(content=text)

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
    """Content streams until MARKER; from there the rest of the output is held and read as calls
    at the end (`_parse` of the text after the marker; None: it was not calls, all content)."""

    MARKER = ""

    def __init__(self) -> None:
        self._buffer = ""
        self._held = False

    def feed(self, text: str) -> Parsed:
        self._buffer += text
        if self._held:
            return Parsed()
        start = self._buffer.find(self.MARKER)
        if start >= 0:
            content, self._buffer = self._buffer[:start], self._buffer[start:]
            self._held = True
            return Parsed(content=content)
        keep = _partial_suffix(self._buffer, self.MARKER)
        cut = len(self._buffer) - keep
        content, self._buffer = self._buffer[:cut], self._buffer[cut:]
        return Parsed(content=content)

    def finish(self) -> Parsed:
        text, self._buffer = self._buffer, ""
        if not self._held:
            return Parsed(content=text)
        self._held = False
        calls = self._parse(text[len(self.MARKER) :])
        return Parsed(calls=calls) if calls else Parsed(content=text)

    @staticmethod
    def _parse(text: str) -> list[ParsedCall] | None:
        raise NotImplementedError


class MistralStreamer(_MarkerStreamer):
    MARKER = "[TOOL_CALLS]"
    ARGS = "[ARGS]"
    keeps_special_tokens = True

    @classmethod
    def _parse(cls, text: str) -> list[ParsedCall] | None:
        text = text.strip()
        if text.startswith("["):  # the JSON array of tokenizers before v11
            try:
                objs = json.loads(text)
            except ValueError:
                return None
            objs = objs if isinstance(objs, list) else [objs]
            calls = [_call(obj, ("arguments", "parameters")) for obj in objs]
            return None if not calls or None in calls else calls  # type: ignore[return-value]
        decoder = json.JSONDecoder()
        calls, position = [], 0
        while position < len(text):  # name[ARGS]{...}, repeated (maybe after another marker)
            if text.startswith(cls.MARKER, position):
                position += len(cls.MARKER)
            args = text.find(cls.ARGS, position)
            if args < 0:
                return None
            name = text[position:args].strip()
            try:
                arguments, position = decoder.raw_decode(text, args + len(cls.ARGS))
            except ValueError:
                return None
            if not name or not isinstance(arguments, dict):
                return None
            calls.append(ParsedCall(name, json.dumps(arguments, ensure_ascii=False)))
            while position < len(text) and text[position].isspace():
                position += 1
        return calls or None


class DeepSeekV3Streamer(_MarkerStreamer):
    MARKER = "<｜tool▁calls▁begin｜>"
    CALL_BEGIN, SEP, CALL_END = "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>", "<｜tool▁call▁end｜>"
    END = "<｜tool▁calls▁end｜>"
    keeps_special_tokens = True

    @classmethod
    def _parse(cls, text: str) -> list[ParsedCall] | None:
        text = text.strip().removesuffix(cls.END).strip()
        calls = []
        for block in text.split(cls.CALL_BEGIN)[1:]:
            block = block.split(cls.CALL_END)[0]
            kind, sep, rest = block.partition(cls.SEP)
            if not sep or kind.strip() != "function":
                return None
            name, _, arguments = rest.partition("\n")
            arguments = arguments.strip().removeprefix("```json").removesuffix("```").strip()
            try:
                obj = json.loads(arguments)
            except ValueError:
                return None
            if not name.strip() or not isinstance(obj, dict):
                return None
            calls.append(ParsedCall(name.strip(), json.dumps(obj, ensure_ascii=False)))
        return calls or None


class PythonicStreamer(Llama3JsonStreamer):
    """The Llama3JsonStreamer's decision (the output's first characters), on `[` or the tag."""

    TAG = "<|python_start|>"
    END = "<|python_end|>"
    START = "["

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


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


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
