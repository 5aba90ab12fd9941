"""The reasoning parsers: a thinking model's <think> block split off from its answer, whole and
streamed in any pieces (held back only while a tag may form), the same split either way."""

from __future__ import annotations

import pytest

from v1_engine.entrypoints.reasoning_parsers import REASONING_PARSERS, parse_reasoning

CASES = [
    # (parser, constrained, text, reasoning, content)
    # DeepSeek-R1: the template opened the block, the output closes it.
    ("deepseek_r1", False, "First, 2 + 2 = 4.\n</think>\n\nThe answer is 4.", "First, 2 + 2 = 4.\n", "\n\nThe answer is 4."),
    ("deepseek_r1", False, "<think>\nhmm</think>4", "\nhmm", "4"),  # it opened the block itself
    ("deepseek_r1", False, "Still thinking about </thi", "Still thinking about </thi", ""),  # cut: all reasoning
    ("deepseek_r1", False, "</think>Direct.", None, "Direct."),  # empty reasoning
    ("deepseek_r1", False, "a < b and </b> is not the end</think>ok", "a < b and </b> is not the end", "ok"),
    # Qwen3: reasoning only when the output opens <think>.
    ("qwen3", False, "<think>\nLet me see.\n</think>\n\nParis.", "\nLet me see.\n", "\n\nParis."),
    ("qwen3", False, "Paris.", None, "Paris."),  # thinking turned off
    ("qwen3", False, "  <thin", None, "  <thin"),  # a partial tag at the end goes out as content
    ("qwen3", False, "<think>cut short", "cut short", ""),
    ("qwen3", False, "The tag </think> alone means nothing here.", None, "The tag </think> alone means nothing here."),
    # Constrained from the first token: reasoning only where the constraint opened <think>.
    ("deepseek_r1", True, '{"answer": 4}', None, '{"answer": 4}'),
    ("deepseek_r1", True, "<think>two and two</think>4", "two and two", "4"),
]  # fmt: skip


@pytest.mark.parametrize(("parser", "constrained", "text", "reasoning", "content"), CASES)
def test_reasoning_and_content_whole_and_streamed(parser, constrained, text, reasoning, content):
    assert parse_reasoning(parser, text, constrained) == (reasoning, content)
    for piece in (1, 2, 3, 7):
        streamer = REASONING_PARSERS[parser](constrained)
        got_reasoning = got_content = ""
        for i in range(0, len(text), piece):
            r, c = streamer.feed(text[i : i + piece])
            got_reasoning, got_content = got_reasoning + r, got_content + c
        r, c = streamer.finish()
        assert (got_reasoning + r or None, got_content + c) == (reasoning, content), piece


def test_streaming_holds_back_only_a_possible_tag():
    r1 = REASONING_PARSERS["deepseek_r1"]()
    assert r1.feed("Okay, so") == ("Okay, so", "")  # reasoning from the first token
    assert r1.feed(" 4</th") == (" 4", "")  # "</th" may close the block
    assert r1.in_reasoning
    assert r1.feed("ink>\n\nFour") == ("", "\n\nFour")
    assert not r1.in_reasoning
    assert r1.feed(" <think> stays") == ("", " <think> stays")  # after the block: content
    qwen = REASONING_PARSERS["qwen3"]()
    assert qwen.feed("<thi") == ("", "")  # may open the block
    assert qwen.feed("nk>why") == ("why", "")
    assert REASONING_PARSERS["qwen3"]().feed("Hello") == ("", "Hello")


# (parser, pieces of (text, token ids), reasoning tokens); the end tag is token 99.
TOKEN_CASES = [
    ("deepseek_r1", [("a", [1]), ("b", [2]), ("</think>", [99]), ("x", [3])], 3),
    ("deepseek_r1", [("ab", [1, 2]), ("c</think>x", [3, 99, 4])], 4),  # the closing piece cut
    ("deepseek_r1", [("</th", [7]), ("ink>", [8]), ("x", [3])], 2),  # a tag of two other tokens
    ("deepseek_r1", [("<th", [5])], 1),  # cut undecided: reasoning
    ("deepseek_r1", [("a", [1]), ("b", [2])], 2),  # never closed: all
    ("qwen3", [("<th", [5]), ("ink>", [6]), ("a", [1]), ("</think>", [99]), ("b", [2])], 4),
    ("qwen3", [(" ", [9]), ("<t", [5]), ("x", [3]), ("y", [4])], 0),  # no <think>: none
    ("qwen3", [("<think>a</think>b", [5, 1, 99, 2])], 3),
]


@pytest.mark.parametrize(("parser", "pieces", "expected"), TOKEN_CASES)
def test_the_reasoning_tokens_are_counted(parser, pieces, expected):
    streamer = REASONING_PARSERS[parser](end_ids=[99])
    for text, ids in pieces:
        streamer.feed(text, ids)
    streamer.finish()
    assert streamer.reasoning_tokens == expected
