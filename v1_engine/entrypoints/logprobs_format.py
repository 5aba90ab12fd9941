"""Engine logprobs ({token_id: Logprob} per position) in the two OpenAI shapes.

Completions: parallel lists (tokens, token_logprobs, top_logprobs, text_offset).
Chat: one object per token with its top alternatives.
"""

from __future__ import annotations

from typing import Any

from v1_engine.entrypoints.protocol_openai import (
    ChatTokenLogprob,
    CompletionLogprobs,
    TopLogprob,
)
from v1_engine.outputs import Logprob


def token_text(tokenizer: Any, token_id: int, logprob: Logprob | None) -> str:
    if logprob is not None and logprob.decoded_token is not None:
        return logprob.decoded_token
    return tokenizer.decode([token_id])


def _top_sorted(row: dict[int, Logprob], num_top: int) -> list[tuple[int, Logprob]]:
    """The row's entries, most likely first, cut to num_top."""
    return sorted(row.items(), key=lambda kv: kv[1].logprob, reverse=True)[:num_top]


def append_completion_logprobs(
    target: CompletionLogprobs,
    token_ids: list[int],
    rows: list[dict[int, Logprob] | None],
    num_top: int,
    tokenizer: Any,
    text_start: int,
) -> int:
    """Extend `target` with one entry per token; return the text offset after the last one.

    A None row (the first prompt token, which nothing predicts) gives None entries, as OpenAI's
    echo does. The sampled token always appears in its own top_logprobs dict.
    """
    offset = text_start
    for token_id, row in zip(token_ids, rows):
        chosen = row.get(token_id) if row is not None else None
        text = token_text(tokenizer, token_id, chosen)
        target.tokens.append(text)
        target.text_offset.append(offset)
        offset += len(text)
        if row is None:
            target.token_logprobs.append(None)
            target.top_logprobs.append(None)
            continue
        target.token_logprobs.append(chosen.logprob if chosen is not None else None)
        top = {token_text(tokenizer, t, lp): lp.logprob for t, lp in _top_sorted(row, num_top)}
        if chosen is not None:
            top.setdefault(text, chosen.logprob)
        target.top_logprobs.append(top)
    return offset


def chat_logprobs(
    token_ids: list[int], rows: list[dict[int, Logprob]], num_top: int, tokenizer: Any
) -> list[ChatTokenLogprob]:
    """One entry per sampled token, with exactly min(num_top, available) alternatives."""
    entries = []
    for token_id, row in zip(token_ids, rows):
        chosen = row.get(token_id)
        text = token_text(tokenizer, token_id, chosen)
        top = [
            TopLogprob(
                token=token_text(tokenizer, t, lp),
                logprob=lp.logprob,
                bytes=list(token_text(tokenizer, t, lp).encode()),
            )
            for t, lp in _top_sorted(row, num_top)
        ]
        entries.append(
            ChatTokenLogprob(
                token=text,
                logprob=chosen.logprob if chosen is not None else float("-inf"),
                bytes=list(text.encode()),
                top_logprobs=top,
            )
        )
    return entries
