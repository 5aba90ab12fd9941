"""Log-probabilities of sampled and prompt tokens, kept on the device until the host reads them.

Row i holds the chosen token (sampled, or the next prompt token) in column 0 and the row's
top-k tokens after it, with the chosen token's rank in the full distribution (1 = most likely).
Values come from the raw logits (before penalties, temperature and masks), which is what
OpenAI-style APIs report.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from v1_engine.outputs import Logprob
from v1_engine.protocol import LogprobsLists


@dataclass
class LogprobsTensors:
    token_ids: torch.Tensor
    """[N, k + 1] int64; column 0 is the chosen token."""
    logprobs: torch.Tensor
    """[N, k + 1] float32, aligned with token_ids."""
    ranks: torch.Tensor
    """[N] int64 rank of the chosen token (1 = most likely)."""

    @property
    def num_rows(self) -> int:
        return self.token_ids.shape[0]

    def to_lists(self) -> LogprobsLists:
        """Copy to the host (one transfer per tensor) as the message type."""
        return LogprobsLists(
            token_ids=self.token_ids.tolist(),
            logprobs=self.logprobs.tolist(),
            ranks=self.ranks.tolist(),
        )

    def slice_rows(self, start: int, end: int) -> LogprobsTensors:
        return LogprobsTensors(
            self.token_ids[start:end], self.logprobs[start:end], self.ranks[start:end]
        )


def gather_logprobs(
    logprobs: torch.Tensor, num_logprobs: int, token_ids: torch.Tensor
) -> LogprobsTensors:
    """Top-num_logprobs entries of each row of [N, V] log-probs, plus token_ids[i]'s entry."""
    token_ids = token_ids.to(torch.int64).unsqueeze(1)
    token_logprobs = logprobs.gather(1, token_ids)
    ranks = (logprobs > token_logprobs).sum(dim=-1) + 1
    if num_logprobs > 0:
        top_logprobs, top_ids = logprobs.topk(num_logprobs, dim=-1)
        token_ids = torch.cat([token_ids, top_ids], dim=1)
        token_logprobs = torch.cat([token_logprobs, top_logprobs], dim=1)
    return LogprobsTensors(token_ids, token_logprobs, ranks)


def compute_prompt_logprobs(
    logits: torch.Tensor, target_token_ids: torch.Tensor, num_logprobs: int
) -> LogprobsTensors:
    """Logprobs of the next prompt token at each of P positions, from [P, V] logits."""
    assert logits.shape[0] == target_token_ids.shape[0]
    return gather_logprobs(logits.float().log_softmax(dim=-1), num_logprobs, target_token_ids)


class TokenDecoder(Protocol):
    """The part of a Hugging Face tokenizer that logprobs need."""

    def decode(self, token_ids: list[int], skip_special_tokens: bool = ...) -> str: ...


def decode_logprobs(
    lists: LogprobsLists, tokenizer: TokenDecoder | None
) -> list[dict[int, Logprob]]:
    """One {token_id: Logprob} per row: the chosen token first (always, even outside the
    top-N, with its rank in the full distribution), then the top tokens, ranked 1, 2, ...

    Serves sampled and prompt logprobs alike; for prompt logprobs the caller puts the None of
    the first prompt token in front, once. Without a tokenizer decoded_token stays None.
    """
    decoded: dict[int, str | None] = {}
    rows = []
    for token_ids, logprobs, rank in zip(lists.token_ids, lists.logprobs, lists.ranks):
        row = {token_ids[0]: Logprob(logprobs[0], rank, _decode(tokenizer, token_ids[0], decoded))}
        for top_rank, (token_id, logprob) in enumerate(zip(token_ids[1:], logprobs[1:]), start=1):
            if token_id not in row:
                row[token_id] = Logprob(logprob, top_rank, _decode(tokenizer, token_id, decoded))
        rows.append(row)
    return rows


def _decode(
    tokenizer: TokenDecoder | None, token_id: int, cache: dict[int, str | None]
) -> str | None:
    if token_id not in cache:
        cache[token_id] = None if tokenizer is None else tokenizer.decode([token_id])
    return cache[token_id]
