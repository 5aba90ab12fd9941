"""Incremental detokenization and stop strings, one instance per running completion.

Tokens arrive a few at a time; text is only appended once the bytes decoded so far form whole
characters, so a multi-byte character split across byte-level or byte-fallback tokens never
shows up as U+FFFD. Fast tokenizers use `tokenizers.decoders.DecodeStream`; others decode a
small sliding window of ids (the prefix/read-offset scheme).

Stop strings are searched in the newly added text plus the tail that could complete one. While
the completion runs, the last len(longest stop string) - 1 characters are held back from the
user because they might turn out to be the start of a stop string that must be cut.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tokenizers.decoders import DecodeStream

from v1_engine.sampling_params import SamplingParams

# Prompt tokens fed to the decoder first, so the first output token decodes in context (e.g. a
# leading-space marker is kept as a space instead of being stripped at start of text).
_NUM_CONTEXT_TOKENS = 6
_INVALID_PREFIX = "Invalid prefix encountered"


class IncrementalDetokenizer:
    def __init__(
        self, tokenizer: Any, prompt_token_ids: Sequence[int], sampling_params: SamplingParams
    ) -> None:
        self._params = sampling_params
        self._stops = list(sampling_params.stop or ())
        context = list(prompt_token_ids[-_NUM_CONTEXT_TOKENS:])
        skip = sampling_params.skip_special_tokens
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is not None:
            self._decoder: _StreamDecoder | _WindowDecoder = _StreamDecoder(backend, context, skip)
        else:
            self._decoder = _WindowDecoder(tokenizer, context, skip)
        self._text = ""
        self._num_output_tokens = 0
        self._last_output_offset = 0
        self._stop_buffer_length = 0
        if self._stops and not sampling_params.include_stop_str_in_output:
            self._stop_buffer_length = max(len(stop) for stop in self._stops) - 1

    @property
    def output_text(self) -> str:
        return self._text

    def update(self, new_token_ids: list[int], stop_terminated: bool) -> str | None:
        """Append the text of new tokens; return the stop string that ended the text, if any.

        `stop_terminated` says the last token is a stop token (EOS or a stop_token_id): its text
        is never added. On a stop string the text is cut before it (or after it, with
        include_stop_str_in_output) and the engine must finish the request.
        """
        self._num_output_tokens += len(new_token_ids)
        if stop_terminated:
            new_token_ids = new_token_ids[:-1]
        num_chars_before = len(self._text)
        for token_id in new_token_ids:
            self._text += self._decoder.step(token_id)
        if not self._stops or self._num_output_tokens <= self._params.min_tokens:
            return None
        return self._check_stop_strings(len(self._text) - num_chars_before)

    def get_next_output_text(self, finished: bool, delta: bool) -> str:
        """The full text so far, or what was not returned before; held-back text is released
        only when finished."""
        length = len(self._text) if finished else len(self._text) - self._stop_buffer_length
        if not delta:
            return self._text[: max(length, 0)]
        if length <= self._last_output_offset:
            return ""
        start, self._last_output_offset = self._last_output_offset, length
        return self._text[start:length]

    def _check_stop_strings(self, num_new_chars: int) -> str | None:
        """Find the stop string that completed first in the new text, and cut the text there.

        Earliest end wins: with tokens fed one character at a time it would have stopped there.
        Between two stop strings ending at the same place, the longer one is cut.
        """
        if num_new_chars == 0:
            return None
        best: tuple[int, int, str] | None = None
        for stop in self._stops:
            # A match must end inside the new text, so it starts at most len(stop)-1 before it.
            search_from = max(0, len(self._text) - num_new_chars - len(stop) + 1)
            start = self._text.find(stop, search_from)
            if start == -1:
                continue
            candidate = (start + len(stop), start, stop)
            if best is None or candidate[:2] < best[:2]:
                best = candidate
        if best is None:
            return None
        end, start, stop = best
        self._text = self._text[: end if self._params.include_stop_str_in_output else start]
        return stop


class _StreamDecoder:
    """Wraps the Rust DecodeStream, which buffers ids until they decode to whole characters."""

    def __init__(self, backend: Any, context: list[int], skip_special_tokens: bool) -> None:
        self._backend = backend
        self._skip_special_tokens = skip_special_tokens
        self._stream = DecodeStream(ids=context, skip_special_tokens=skip_special_tokens)

    def step(self, token_id: int) -> str:
        try:
            chunk = self._stream.step(self._backend, token_id)
        except Exception as error:
            # The stream refuses a token whose decoding rewrites the text it already returned
            # (context-dependent decoders); restarting without context keeps the text going.
            if _INVALID_PREFIX not in str(error):
                raise
            self._stream = DecodeStream(skip_special_tokens=self._skip_special_tokens)
            chunk = self._stream.step(self._backend, token_id)
        return chunk or ""


class _WindowDecoder:
    """Decodes ids[prefix_offset:] and ids[prefix_offset:read_offset] and returns the growth.

    The text is released only when it does not end in U+FFFD (an incomplete character).
    """

    def __init__(self, tokenizer: Any, context: list[int], skip_special_tokens: bool) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._ids = list(context)
        self._prefix_offset = 0
        self._read_offset = len(self._ids)

    def step(self, token_id: int) -> str:
        self._ids.append(token_id)
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        full_text = self._decode(self._ids[self._prefix_offset :])
        if len(full_text) <= len(prefix_text) or full_text.endswith("\ufffd"):
            return ""
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        return full_text[len(prefix_text) :]

    def _decode(self, token_ids: list[int]) -> str:
        return self._tokenizer.decode(
            token_ids,
            skip_special_tokens=self._skip_special_tokens,
            clean_up_tokenization_spaces=False,
        )
