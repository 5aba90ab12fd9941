"""Which draft tokens a verify step keeps.

A request with drafts d_1..d_k runs k + 1 positions in one forward (its last known token, then
the drafts), and every position's logits are sampled as usual, each with its own draw (the
penalties and min_tokens of position i count d_1..d_i as outputs). Draft d_i is kept when
position i - 1 sampled it; the tokens kept are those samples up to and including the first
disagreement (or all k + 1 when every draft holds).

That is exact rejection sampling for drafts that are single tokens (a one-hot draft
distribution q, as n-gram drafts are): d is accepted with probability p(d) = min(1, p(d) / q(d)),
and a rejection's sample is distributed as p without d, renormalized, which is
(p - q)+ / |p - q|+. Greedy rows accept exactly where the argmax agrees, so greedy output is the
output without speculation.
"""

from __future__ import annotations

from collections.abc import Sequence


def accept_drafts(sampled: Sequence[int], drafts: Sequence[int]) -> list[int]:
    """The tokens a request keeps from its `len(drafts) + 1` sampled positions."""
    assert len(sampled) == len(drafts) + 1, (len(sampled), len(drafts))
    kept = [sampled[0]]
    for i, draft in enumerate(drafts):
        if sampled[i] != draft:
            break
        kept.append(sampled[i + 1])
    return kept
