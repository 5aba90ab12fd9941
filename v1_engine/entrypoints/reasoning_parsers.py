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

With `deepseek_r1`, a request's constraint (structured outputs, a forced tool call) holds from
the `</think>` on: the model reasons freely first (`StructuredOutputsParams.reasoning_end`),
unless the prompt closed the block already. An output constrained from its first token (`qwen3`,
or a closed prompt) is read the `qwen3` way: reasoning only where the constraint made it open
`<think>`, so a JSON answer stays content.

Both stream: a streamer holds back only what may be the start of a tag, so the reasoning and the
content go out as they are written, and a whole output fed at once gives the same split.
"""

from __future__ import annotations

from v1_engine.entrypoints.json_stream import partial_suffix


class ReasoningStreamer:
    """Splits one completion's text into (reasoning, content) pieces as it streams."""

    START, END = "<think>", "</think>"
    opens_in_prompt = True
    """Whether the output is reasoning from its first token (the template opened the block)."""

    def __init__(self, constrained: bool = False) -> None:
        if constrained:
            self.opens_in_prompt = False
        self._buffer = ""
        self._state = "start"
        """"start" (leading text undecided), "reasoning", or "content"."""

    def feed(self, text: str) -> tuple[str, str]:
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
        content, self._buffer = self._buffer, ""
        return reasoning, content

    def finish(self) -> tuple[str, str]:
        """The end of the output: what was held back."""
        text, self._buffer = self._buffer, ""
        if self._state == "reasoning" or (self._state == "start" and self.opens_in_prompt):
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
