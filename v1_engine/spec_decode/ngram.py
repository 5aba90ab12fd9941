"""N-gram (prompt lookup) drafts: where the request's newest tokens occurred before in its own
prompt or output, the tokens that followed them then are proposed as the next ones.

No draft model: the proposal is a search over the request's token ids on the host, at
O(tokens) per request (a byte-string search for the newest n tokens, longest n first).
"""

from __future__ import annotations

import numpy as np


def propose_ngram(tokens: np.ndarray, min_n: int, max_n: int, num_drafts: int) -> np.ndarray:
    """Up to `num_drafts` tokens to follow `tokens` (1-D int array), or an empty array.

    The longest suffix of `tokens` of length n in [min_n, max_n] that also occurs earlier is
    looked up; among its earlier occurrences the latest one with `num_drafts` tokens after it
    wins (recent context predicts best), else the latest one. The tokens after it are the draft.

    The search runs on the tokens' bytes (`bytes.rfind`, C speed, latest first): a handful of
    calls a request. The runner proposes for every request of every step, on the step's path;
    vectorized numpy paid ~27 us a request in fixed per-call costs, this 3-6 us at 512-2k
    tokens (benchmarks/RESULTS.md, "N-gram proposals on the tokens' bytes").
    """
    length = len(tokens)
    if num_drafts < 1 or length < min_n + 1:
        return tokens[:0]
    # Token ids fit int32 (any vocabulary): half the bytes of int64 to scan.
    data = tokens.astype(np.int32, copy=False).tobytes()
    width = 4
    # No earlier occurrence of the shortest suffix: none of a longer one (one scan, the common
    # case in text that does not repeat).
    if _rfind_aligned(data, data[(length - min_n) * width :], (length - 1) * width, width) is None:
        return tokens[:0]
    max_n = min(max_n, length - 1)
    for n in range(max_n, min_n - 1, -1):
        suffix = data[(length - n) * width :]
        # Occurrences ending at least num_drafts tokens before the end, then any earlier one.
        end = _rfind_aligned(data, suffix, (length - num_drafts) * width, width)
        if end is None:
            end = _rfind_aligned(data, suffix, (length - 1) * width, width)
        if end is not None:
            return tokens[end + 1 : end + 1 + num_drafts]
    return tokens[:0]


def _rfind_aligned(data: bytes, sub: bytes, limit: int, width: int) -> int | None:
    """The index of the last token of the latest occurrence of `sub` (whole tokens) lying in
    data[:limit], or None."""
    while limit >= len(sub):
        start = data.rfind(sub, 0, limit)
        if start < 0:
            return None
        if start % width == 0:
            return (start + len(sub)) // width - 1
        limit = start + len(sub) - 1  # a match across token boundaries: look before it
    return None


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
