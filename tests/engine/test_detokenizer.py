"""IncrementalDetokenizer on the default model's byte-level BPE tokenizer."""

from __future__ import annotations

from typing import Any

import pytest

from v1_engine.engine.detokenizer import IncrementalDetokenizer
from v1_engine.sampling_params import SamplingParams

MIXED_TEXT = "Crème brûlée 😀👍🏽 naïve café, 日本語のテキスト and ёлка 🤖🎉!"
PROMPT = "<|im_start|>user\nSay something<|im_end|>\n<|im_start|>assistant\n"


class SlowTokenizer:
    """Hides the Rust backend so the detokenizer takes its sliding-window path."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer

    def decode(self, token_ids: list[int], **kwargs: Any) -> str:
        return self._tokenizer.decode(token_ids, **kwargs)


@pytest.fixture(params=["stream", "window"])
def tokenizer(request: pytest.FixtureRequest, smollm2_tokenizer: Any) -> Any:
    if request.param == "window":
        return SlowTokenizer(smollm2_tokenizer)
    return smollm2_tokenizer


def make(tokenizer: Any, smollm2_tokenizer: Any, **params: Any) -> IncrementalDetokenizer:
    prompt_ids = smollm2_tokenizer.encode(PROMPT)
    return IncrementalDetokenizer(tokenizer, prompt_ids, SamplingParams(**params))


def stream_text(
    detok: IncrementalDetokenizer, token_ids: list[int]
) -> tuple[list[str], str | None]:
    """Feed tokens one at a time; return the deltas seen by a streaming client, and the stop."""
    deltas = []
    for token_id in token_ids:
        stop = detok.update([token_id], stop_terminated=False)
        deltas.append(detok.get_next_output_text(finished=stop is not None, delta=True))
        if stop is not None:
            return deltas, stop
    deltas.append(detok.get_next_output_text(finished=True, delta=True))
    return deltas, None


def test_streaming_equals_full_decode(tokenizer: Any, smollm2_tokenizer: Any) -> None:
    token_ids = smollm2_tokenizer.encode(MIXED_TEXT)
    assert len(token_ids) > len(MIXED_TEXT.split())  # multi-byte characters span tokens
    detok = make(tokenizer, smollm2_tokenizer)
    deltas, stop = stream_text(detok, token_ids)
    assert stop is None
    assert detok.output_text == MIXED_TEXT
    assert detok.output_text == smollm2_tokenizer.decode(token_ids, skip_special_tokens=True)
    assert "".join(deltas) == MIXED_TEXT
    assert not any("\ufffd" in delta for delta in deltas)
    assert "" in deltas  # some tokens only carry part of a character


def test_first_token_keeps_its_leading_space(tokenizer: Any, smollm2_tokenizer: Any) -> None:
    token_ids = smollm2_tokenizer.encode(" Hello there")
    detok = make(tokenizer, smollm2_tokenizer)
    detok.update(token_ids, stop_terminated=False)
    assert detok.output_text == " Hello there"


def test_special_tokens_are_skipped_or_kept(tokenizer: Any, smollm2_tokenizer: Any) -> None:
    token_ids = smollm2_tokenizer.encode("Hi<|im_end|> there")
    skipped = make(tokenizer, smollm2_tokenizer)
    skipped.update(token_ids, stop_terminated=False)
    assert skipped.output_text == "Hi there"
    kept = make(tokenizer, smollm2_tokenizer, skip_special_tokens=False)
    kept.update(token_ids, stop_terminated=False)
    assert kept.output_text == "Hi<|im_end|> there"


def test_stop_token_text_is_not_added(tokenizer: Any, smollm2_tokenizer: Any) -> None:
    eos = smollm2_tokenizer.eos_token_id
    detok = make(tokenizer, smollm2_tokenizer, skip_special_tokens=False)
    assert detok.update(smollm2_tokenizer.encode("Done.") + [eos], stop_terminated=True) is None
    assert detok.output_text == "Done."


def test_stop_string_spanning_tokens(tokenizer: Any, smollm2_tokenizer: Any) -> None:
    text = "The quick brown fox jumps over the lazy dog"
    token_ids = smollm2_tokenizer.encode(text)
    detok = make(tokenizer, smollm2_tokenizer, stop=["n fox ju"])
    deltas, stop = stream_text(detok, token_ids)
    assert stop == "n fox ju"
    assert detok.output_text == "The quick brow"
    assert "".join(deltas) == "The quick brow"
    # It stopped at the token that completed the stop string, not later.
    assert len(deltas) == len(smollm2_tokenizer.encode("The quick brown fox jumps"))


def test_include_stop_str_in_output(tokenizer: Any, smollm2_tokenizer: Any) -> None:
    token_ids = smollm2_tokenizer.encode("The quick brown fox jumps over the lazy dog")
    detok = make(tokenizer, smollm2_tokenizer, stop=["n fox ju"], include_stop_str_in_output=True)
    deltas, stop = stream_text(detok, token_ids)
    assert stop == "n fox ju"
    assert detok.output_text == "The quick brown fox ju"
    assert "".join(deltas) == "The quick brown fox ju"


def test_stop_inside_a_multi_token_update_truncates(smollm2_tokenizer: Any) -> None:
    token_ids = smollm2_tokenizer.encode("alpha beta gamma delta beta")
    detok = make(smollm2_tokenizer, smollm2_tokenizer, stop=["delta", "gamma"])
    assert detok.update(token_ids, stop_terminated=False) == "gamma"
    assert detok.output_text == "alpha beta "


def test_stop_string_that_completes_first_wins(smollm2_tokenizer: Any) -> None:
    token_ids = smollm2_tokenizer.encode("one two three")
    detok = make(smollm2_tokenizer, smollm2_tokenizer, stop=["two three", "two"])
    assert detok.update(token_ids, stop_terminated=False) == "two"
    assert detok.output_text == "one "


def test_held_back_text_is_released_at_finish(tokenizer: Any, smollm2_tokenizer: Any) -> None:
    detok = make(tokenizer, smollm2_tokenizer, stop=["STOP NOW"])  # holds back 7 characters
    detok.update(smollm2_tokenizer.encode("Hello world"), stop_terminated=False)
    assert detok.get_next_output_text(finished=False, delta=True) == "Hell"
    assert detok.get_next_output_text(finished=False, delta=False) == "Hell"
    detok.update(smollm2_tokenizer.encode(" STOP"), stop_terminated=False)
    # "Hello world STOP" could still become "...STOP NOW": its last 7 characters wait.
    assert detok.get_next_output_text(finished=False, delta=True) == "o wor"
    assert detok.get_next_output_text(finished=False, delta=True) == ""
    assert detok.get_next_output_text(finished=True, delta=True) == "ld STOP"
    assert detok.get_next_output_text(finished=True, delta=False) == "Hello world STOP"


def test_full_and_delta_outputs(tokenizer: Any, smollm2_tokenizer: Any) -> None:
    detok = make(tokenizer, smollm2_tokenizer)
    pieces = ["Once", " upon", " a time"]
    deltas, fulls = [], []
    for piece in pieces:
        detok.update(smollm2_tokenizer.encode(piece), stop_terminated=False)
        fulls.append(detok.get_next_output_text(finished=False, delta=False))
        deltas.append(detok.get_next_output_text(finished=False, delta=True))
    assert deltas == pieces
    assert fulls == ["Once", "Once upon", "Once upon a time"]


def test_stop_strings_wait_for_min_tokens(smollm2_tokenizer: Any) -> None:
    token_ids = smollm2_tokenizer.encode("x, y, z")
    assert len(token_ids) == 5
    detok = make(smollm2_tokenizer, smollm2_tokenizer, stop=[","], min_tokens=2)
    # The comma of token 2 is within min_tokens and never counts; the next one stops.
    stops = [detok.update([t], stop_terminated=False) for t in token_ids[:4]]
    assert stops == [None, None, None, ","]
    assert detok.output_text == "x, y"
