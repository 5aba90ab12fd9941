"""Top-k, top-p (nucleus) and min-p masks: tokens a row may not sample get a logit of -inf.

Top-k alone uses `torch.topk` with the batch's largest k (known on the host), which is much
cheaper than sorting the vocabulary; top-p needs the full sort, and top-k then rides on it.
Each function modifies `logits` in place and returns it.
"""

from __future__ import annotations

import torch

_MASKED = float("-inf")


def apply_top_k_top_p(
    logits: torch.Tensor,
    top_k: torch.Tensor | None,
    max_top_k: int,
    top_p: torch.Tensor | None,
) -> torch.Tensor:
    """Keep each row's top_k[i] largest logits, then its smallest nucleus of mass top_p[i]."""
    if top_p is None:
        if top_k is None:
            return logits
        return apply_top_k_only(logits, top_k, max_top_k)
    sorted_logits, sorted_ids = logits.sort(dim=-1)
    if top_k is not None:
        vocab_size = logits.shape[-1]
        kth_largest = sorted_logits.gather(1, (vocab_size - top_k).unsqueeze(1))
        sorted_logits.masked_fill_(sorted_logits < kth_largest, _MASKED)
    # Ascending order: a token goes when the mass at or below it leaves >= top_p above it.
    cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
    outside_nucleus = cumulative <= 1.0 - top_p.unsqueeze(1)
    outside_nucleus[:, -1] = False
    sorted_logits.masked_fill_(outside_nucleus, _MASKED)
    return logits.scatter_(1, sorted_ids, sorted_logits)


def apply_top_k_only(logits: torch.Tensor, top_k: torch.Tensor, max_top_k: int) -> torch.Tensor:
    """Top-k without sorting: the k-th largest value of each row is read from one topk call."""
    largest = logits.topk(max_top_k, dim=-1).values
    kth_largest = largest.gather(1, (top_k - 1).unsqueeze(1))
    return logits.masked_fill_(logits < kth_largest, _MASKED)


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Drop tokens whose probability is below min_p[i] times the row's highest probability."""
    probs = logits.softmax(dim=-1)
    threshold = min_p.unsqueeze(1) * probs.amax(dim=-1, keepdim=True)
    return logits.masked_fill_(probs < threshold, _MASKED)
