"""Reading JSON and tagged text as it streams: where a value ends, the parts of a
`{"name": ..., "arguments": {...}}` call object as they are written, and the suffix of a text
that may still become a tag. The tool-call and reasoning parsers build on these."""

from __future__ import annotations

import json
from typing import Any

WHITESPACE = " \t\r\n"


def skip(text: str, i: int, chars: str = WHITESPACE) -> int:
    """The first index at or after `i` whose character is not one of `chars`."""
    while i < len(text) and text[i] in chars:
        i += 1
    return i


class ValueEnd:
    """Where the JSON value that starts at `start` ends, found as the text grows (the text is
    assumed well-formed; a malformed value shows at the end, when the whole text is checked)."""

    def __init__(self, start: int) -> None:
        self.start = start
        self.end: int | None = None
        self._pos = start
        self._depth = 0
        self._in_string = False
        self._escape = False

    def advance(self, text: str) -> int | None:
        """The index after the value, or None while it is unfinished."""
        if self.end is not None:
            return self.end
        i, n = self._pos, len(text)
        if i == self.start and i < n and text[i] not in '{["':  # a number, true, false, null
            while i < n and text[i] not in ",:}] \t\r\n":
                i += 1
            if i < n:
                self.end = i
            return self.end
        while i < n:
            c = text[i]
            i += 1
            if self._in_string:
                if self._escape:
                    self._escape = False
                elif c == "\\":
                    self._escape = True
                elif c == '"':
                    self._in_string = False
                    if self._depth == 0:
                        self.end = i
                        return i
            elif c == '"':
                self._in_string = True
            elif c in "{[":
                self._depth += 1
            elif c in "}]":
                self._depth -= 1
                if self._depth == 0:
                    self.end = i
                    return i
        self._pos = i
        return None


class CallObject:
    """One `{"name": ..., <arguments key>: {...}}` object read as it is written: the name once
    its string is complete, and where its arguments object starts and (later) ends."""

    def __init__(self, start: int, arguments_keys: tuple[str, ...]) -> None:
        self.start = start
        self.arguments_keys = arguments_keys
        self.name: str | None = None
        self.arguments: ValueEnd | None = None
        """The arguments value, when it is an object (another kind is not streamed)."""
        self.end: int | None = None
        self.failed = False
        """Not a call object as written so far."""
        self._pos = start
        self._state = "open"
        self._key: Any = None
        self._value: ValueEnd | None = None

    def advance(self, text: str) -> None:
        while self.end is None and not self.failed:
            if self._value is not None:
                end = self._value.advance(text)
                if end is None:
                    return
                if self._key == "name":
                    self.name = json.loads(text[self._value.start : end])
                self._value, self._pos, self._state = None, end, "after"
                continue
            i = skip(text, self._pos)
            if i == len(text):
                return
            c, state = text[i], self._state
            if state == "open":
                self.failed = c != "{"
                self._pos, self._state = i + 1, "first key"
            elif state in ("first key", "key"):
                if c == "}" and state == "first key":
                    self.end = i + 1
                    return
                if c != '"':
                    self.failed = True
                    return
                key = ValueEnd(i)
                end = key.advance(text)
                if end is None:
                    return
                self._key = json.loads(text[i:end])
                self._pos, self._state = end, "colon"
            elif state == "colon":
                self.failed = c != ":"
                self._pos, self._state = i + 1, "value"
            elif state == "value":
                self._value = ValueEnd(i)
                if self._key == "name":
                    self.failed = c != '"'
                elif self._key in self.arguments_keys and c == "{" and self.arguments is None:
                    self.arguments = self._value
            else:  # after a value
                if c == "}":
                    self.end = i + 1
                else:
                    self.failed = c != ","
                    self._pos, self._state = i + 1, "key"

    def arguments_text(self, text: str) -> str | None:
        """The arguments written so far, once the call may begin (name and arguments started)."""
        if self.name is None or self.arguments is None:
            return None
        return text[self.arguments.start : self.arguments.end or len(text)]


def literal(text: str, i: int, literal: str) -> int | None:
    """The index after `literal` at text[i]; -1 when the text there differs from it; None
    while the text ends inside it."""
    if text.startswith(literal, i):
        return i + len(literal)
    return None if literal.startswith(text[i:]) else -1


def partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0
