"""Logit edits before sampling, applied to the whole batch at once: penalties, min_tokens
suppression, logit_bias and allowed_token_ids.

Repetition penalty (the CTRL-paper form that transformers uses) divides positive logits and
multiplies negative ones for every token seen in the prompt or the output, so it always makes a
seen token less likely. Presence and frequency penalties follow the OpenAI definition and only
look at generated tokens: logit -= frequency * count + presence * (count > 0).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from v1_engine.sample.metadata import SamplingMetadata, pad_token_ids


def apply_min_tokens(logits: torch.Tensor, suppressed: dict[int, set[int]]) -> torch.Tensor:
    """Set the stop tokens of rows that have not reached min_tokens to -inf (in place)."""
    if not suppressed:
        return logits
    pairs = [(row, token_id) for row, ids in suppressed.items() for token_id in ids]
    index = torch.tensor(pairs, dtype=torch.int64).to(logits.device, non_blocking=True)
    # The value as a tensor on the logits' device: `logits[rows, cols] = float("-inf")` copies a
    # host scalar to the device with a blocking copy, a host sync in every min_tokens step.
    logits.index_put_((index[:, 0], index[:, 1]), logits.new_full((), float("-inf")))
    return logits


def apply_allowed_token_mask(
    logits: torch.Tensor, allowed: tuple[torch.Tensor, torch.Tensor] | None
) -> torch.Tensor:
    """-inf on every token a row with allowed_token_ids may not sample (in place)."""
    if allowed is None:
        return logits
    rows, banned = allowed
    restricted = logits.index_select(0, rows).masked_fill_(banned, float("-inf"))
    return logits.index_copy_(0, rows, restricted)


def apply_logit_bias(
    logits: torch.Tensor, bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None
) -> torch.Tensor:
    """Add each row's logit_bias to its tokens' logits (in place)."""
    if bias is None:
        return logits
    rows, token_ids, values = bias
    return logits.index_put_((rows, token_ids), values, accumulate=True)


def apply_penalties(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    """Apply repetition, frequency and presence penalties (in place) to [N, V] logits."""
    if metadata.no_penalties:
        return logits
    num_rows, vocab_size = logits.shape
    output_counts = _token_counts(metadata.output_token_ids, num_rows, vocab_size, logits.device)
    if metadata.repetition_penalties is not None:
        assert metadata.prompt_token_ids is not None
        seen = _token_mask(metadata.prompt_token_ids, vocab_size) | (output_counts > 0)
        penalty = metadata.repetition_penalties.unsqueeze(1).expand_as(logits)
        penalty = torch.where(seen, penalty, torch.ones_like(penalty))
        logits.copy_(torch.where(logits > 0, logits / penalty, logits * penalty))
    if metadata.frequency_penalties is not None:
        logits -= metadata.frequency_penalties.unsqueeze(1) * output_counts
    if metadata.presence_penalties is not None:
        logits -= metadata.presence_penalties.unsqueeze(1) * (output_counts > 0)
    return logits


def _token_counts(
    token_ids: Sequence[Sequence[int]], num_rows: int, vocab_size: int, device: torch.device
) -> torch.Tensor:
    """[N, V] float32 occurrence counts; the pad id vocab_size lands in a dropped extra column."""
    padded = pad_token_ids(token_ids, vocab_size, device)
    counts = torch.zeros((num_rows, vocab_size + 1), dtype=torch.float32, device=device)
    counts.scatter_add_(1, padded, torch.ones_like(padded, dtype=torch.float32))
    return counts[:, :vocab_size]


def _token_mask(padded_token_ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[N, V] bool: which tokens occur in each row of a vocab_size-padded id tensor."""
    num_rows = padded_token_ids.shape[0]
    mask = torch.zeros((num_rows, vocab_size + 1), dtype=torch.bool, device=padded_token_ids.device)
    mask.scatter_(1, padded_token_ids, True)
    return mask[:, :vocab_size]
