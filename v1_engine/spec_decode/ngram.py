"""N-gram (prompt lookup) drafts: where the request's newest tokens occurred before in its own
prompt or output, the tokens that followed them then are proposed as the next ones.

No draft model: the proposal is a search over the request's token ids on the host, at
O(tokens) per request (one vectorized comparison with the last token, then only its matches
are extended backwards).
"""

from __future__ import annotations

import numpy as np


def propose_ngram(tokens: np.ndarray, min_n: int, max_n: int, num_drafts: int) -> np.ndarray:
    """Up to `num_drafts` tokens to follow `tokens` (1-D int array), or an empty array.

    The longest suffix of `tokens` of length n in [min_n, max_n] that also occurs earlier is
    looked up; among its earlier occurrences the latest one with `num_drafts` tokens after it
    wins (recent context predicts best), else the latest one. The tokens after it are the draft.
    """
    length = len(tokens)
    if num_drafts < 1 or length < min_n + 1:
        return tokens[:0]
    # Occurrences of the last token that have at least one token after them.
    ends = np.flatnonzero(tokens[: length - 1] == tokens[length - 1])
    if not len(ends):
        return tokens[:0]
    # Extend each match backwards: match_len[i] = length of the common suffix ending at ends[i].
    max_n = min(max_n, length - 1)
    match_len = np.ones(len(ends), dtype=np.int64)
    alive = np.ones(len(ends), dtype=bool)
    for j in range(1, max_n):
        starts = ends - j
        ok = alive & (starts >= 0)
        ok[ok] = tokens[starts[ok]] == tokens[length - 1 - j]
        match_len += ok
        alive = ok
        if not alive.any():
            break
    best = int(match_len.max())
    if best < min_n:
        return tokens[:0]
    candidates = ends[match_len == best]
    full = candidates[candidates + num_drafts < length]
    end = int(full[-1] if len(full) else candidates[-1])
    return tokens[end + 1 : end + 1 + num_drafts]


class NgramProposer:
    """Drafts for a batch of requests, each from its own token ids."""

    def __init__(self, num_speculative_tokens: int, min_n: int, max_n: int) -> None:
        self.num_speculative_tokens = num_speculative_tokens
        self.min_n = min_n
        self.max_n = max_n

    def propose(self, tokens: np.ndarray, max_drafts: int | None = None) -> list[int]:
        """Drafts to follow one request's known tokens (at most `max_drafts`, when given)."""
        k = (
            self.num_speculative_tokens
            if max_drafts is None
            else min(max_drafts, self.num_speculative_tokens)
        )
        return propose_ngram(tokens, self.min_n, self.max_n, k).tolist()


class DraftBackoff:
    """When to skip a request's drafts: after m >= 2 verify steps in a row that kept none of
    them, the next min(2^(m-2), max_pause) proposals are skipped; a kept draft resets it.
    Drafts that keep failing cost a verify step's extra positions for nothing (on the GPU up to
    2.7x a decode step's time before verify steps had full graphs); a request that copies again
    after a novel stretch drafts again within max_pause steps."""

    __slots__ = ("max_pause", "misses", "pause")

    def __init__(self, max_pause: int) -> None:
        self.max_pause = max_pause
        self.misses = 0
        """Verify steps in a row that kept none of this request's drafts."""
        self.pause = 0
        """Proposals still to skip."""

    def record(self, num_drafts: int, num_kept: int) -> None:
        """A verify step's outcome for the request: drafts verified, drafts kept."""
        if not num_drafts:
            return
        if num_kept:
            self.misses = 0
            return
        self.misses += 1
        if self.misses >= 2 and self.max_pause:
            self.pause = min(1 << (self.misses - 2), self.max_pause)

    def allow(self) -> bool:
        """Whether the request drafts now (a skipped proposal counts down the pause)."""
        if self.pause:
            self.pause -= 1
            return False
        return True
