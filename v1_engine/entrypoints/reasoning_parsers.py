"""Reasoning parsers (`--reasoning-parser`): a thinking model's reasoning, which it writes in a
`<think>` ... `</think>` block before its answer, split off into the message's
`reasoning_content`; the answer after it is the content (and what a tool-call parser reads).

- `deepseek_r1` (DeepSeek-R1 and its distills, Qwen3 "thinking" 2507 models, QwQ): the chat
  template opens the block in the prompt, so the output is reasoning from its first token until
  `</think>` (a leading `<think>` the model writes itself is dropped). An output cut before
  `</think>` is all reasoning.
- `qwen3` (Qwen3 hybrid models): the output is reasoning only when it starts with `<think>`;
  otherwise (thinking turned off, `chat_template_kwargs: {"enable_thinking": false}`) all of it
  is content.

A request's constraint (structured outputs, a forced tool call) holds from the `</think>` on,
so the model reasons freely first (`StructuredOutputsParams.reasoning_end`), unless the prompt
closed the block already: with `deepseek_r1` from the first token on; with `qwen3` where the
first token is `<think>` (`reasoning_start`: that row allows it besides the constraint's first
tokens; any other first token starts the constrained answer), if the tokenizer has it as one
token, else the constraint holds from the first token. An output constrained from its first
token is read the `qwen3` way: reasoning only where the constraint made it open `<think>`, so a
JSON answer stays content.

Both stream: a streamer holds back only what may be the start of a tag, so the reasoning and the
content go out as they are written, and a whole output fed at once gives the same split. Fed the
tokens with the text, a streamer also counts the reasoning's tokens (`usage.
completion_tokens_details.reasoning_tokens`): the tokens of every piece inside the block, the end
tag's with them.
"""

from __future__ import annotations

from collections.abc import Sequence

from v1_engine.entrypoints.json_stream import partial_suffix


class ReasoningStreamer:
    """Splits one completion's text into (reasoning, content) pieces as it streams."""

    START, END = "<think>", "</think>"
    opens_in_prompt = True
    """Whether the output is reasoning from its first token (the template opened the block)."""

    def __init__(self, constrained: bool = False, end_ids: Sequence[int] = ()) -> None:
        if constrained:
            self.opens_in_prompt = False
        self._buffer = ""
        self._state = "start"
        """"start" (leading text undecided), "reasoning", or "content"."""
        self._end_ids = list(end_ids)
        """The end tag's token ids: where a piece that closes the block stops counting."""
        self.reasoning_tokens = 0
        """Tokens of the reasoning fed so far, the end tag's included."""
        self._undecided_tokens = 0
        """Tokens fed while the leading text is undecided ("start")."""
        self._closed_now = False
        """Whether the last piece closed the block."""

    def feed(self, text: str, token_ids: Sequence[int] = ()) -> tuple[str, str]:
        """The (reasoning, content) of the next piece of text; `token_ids`, the tokens it was
        decoded from, are counted into `reasoning_tokens` where they are reasoning."""
        before = self._state
        reasoning, content = self._split(text)
        if self._state == "start":
            self._undecided_tokens += len(token_ids)
        elif self._state == "reasoning":
            self.reasoning_tokens += self._undecided_tokens + len(token_ids)
            self._undecided_tokens = 0
        elif before != "content":
            if reasoning or self._closed_now:
                self.reasoning_tokens += self._undecided_tokens + self._to_end(token_ids)
            self._undecided_tokens = 0
        return reasoning, content

    def _to_end(self, token_ids: Sequence[int]) -> int:
        """How many of the closing piece's tokens are reasoning: up to and with the end tag's
        where they are among them (all of them otherwise)."""
        ids, end = list(token_ids), self._end_ids
        for i in range(len(ids) - len(end) + 1 if end else 0):
            if ids[i : i + len(end)] == end:
                return i + len(end)
        return len(ids)

    def _split(self, text: str) -> tuple[str, str]:
        self._closed_now = False
        self._buffer += text
        reasoning = ""
        if self._state == "start":
            head = self._buffer.lstrip()
            if not head or (self.START.startswith(head) and head != self.START):
                return "", ""  # may still become the opening tag
            if head.startswith(self.START):
                self._buffer = head[len(self.START) :]
                self._state = "reasoning"
            else:
                self._state = "reasoning" if self.opens_in_prompt else "content"
        if self._state == "reasoning":
            end = self._buffer.find(self.END)
            if end < 0:
                keep = partial_suffix(self._buffer, self.END)
                cut = len(self._buffer) - keep
                reasoning, self._buffer = self._buffer[:cut], self._buffer[cut:]
                return reasoning, ""
            reasoning = self._buffer[:end]
            self._buffer = self._buffer[end + len(self.END) :]
            self._state = "content"
            self._closed_now = True
        content, self._buffer = self._buffer, ""
        return reasoning, content

    def finish(self) -> tuple[str, str]:
        """The end of the output: what was held back."""
        text, self._buffer = self._buffer, ""
        if self._state == "reasoning" or (self._state == "start" and self.opens_in_prompt):
            self.reasoning_tokens += self._undecided_tokens
            self._undecided_tokens = 0
            return text, ""
        return "", text

    @property
    def in_reasoning(self) -> bool:
        """Whether the output is (or may still be) inside the reasoning block."""
        return self._state != "content"


class DeepSeekR1Streamer(ReasoningStreamer):
    opens_in_prompt = True


class Qwen3Streamer(ReasoningStreamer):
    opens_in_prompt = False


REASONING_PARSERS: dict[str, type[ReasoningStreamer]] = {
    "deepseek_r1": DeepSeekR1Streamer,
    "qwen3": Qwen3Streamer,
}


def parse_reasoning(parser: str, text: str, constrained: bool = False) -> tuple[str | None, str]:
    """A whole output's reasoning (None when it has none) and content."""
    streamer = REASONING_PARSERS[parser](constrained)
    reasoning, content = streamer.feed(text)
    more_reasoning, more_content = streamer.finish()
    return (reasoning + more_reasoning) or None, content + more_content
