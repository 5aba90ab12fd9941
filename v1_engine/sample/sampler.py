"""Sampler: turns a step's [N, V] logits into one token per row without a device sync.

Order of operations:
  1. logprobs (if any row asks) from the raw logits;
  2. the structured-output grammar's mask, allowed_token_ids, min_tokens suppression,
     logit_bias, then penalties;
  3. greedy rows: argmax of those logits (no temperature, so greedy output equals the
     reference implementation's greedy output bit for bit);
  4. random rows: temperature, top-k, top-p, min-p, then `argmax(probs / q)` with
     q ~ Exponential(1) — an exact draw from `probs` that needs no host round trip. A seeded
     row draws its q from its own generator only, so its tokens do not depend on the batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from v1_engine.sample.logprobs import LogprobsTensors, gather_logprobs
from v1_engine.sample.metadata import SamplingMetadata
from v1_engine.sample.penalties import (
    apply_allowed_token_mask,
    apply_logit_bias,
    apply_min_tokens,
    apply_penalties,
)
from v1_engine.sample.topk_topp import apply_min_p, apply_top_k_top_p
from v1_engine.structured_output import apply_token_bitmask

# Keeps q away from 0 so a zero-probability token never wins through 0 / 0.
_MIN_EXPONENTIAL = torch.finfo(torch.float32).tiny

_TRITON_ARGMAX_MAX_ROWS = 256
"""Most rows the one-launch Triton argmax takes (kernels/triton_argmax.py); more take
torch.argmax. A CUDA torch.argmax reduces each row in a single thread block: 28 us for a 128k
vocabulary from 1 to 64 rows on the H200. Triton, same run (`python
benchmarks/benchmark_argmax.py`, bf16 / float32 logits, us): 3.3 / 3.7 at 1 row, 9.9 / 11.3 at
64, 30.0 / 37.9 at 256 against torch's 46.3 / 48.3 (benchmarks/RESULTS.md, "Greedy argmax")."""
_TRITON_ARGMAX_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def row_argmax(x: torch.Tensor) -> torch.Tensor:
    """argmax over the last dim of [N, V] (the first index among equal maxima, NaN counting as
    the largest, as torch.argmax). On CUDA, up to _TRITON_ARGMAX_MAX_ROWS rows of a float dtype:
    one Triton launch over (row, chunk) programs, same result; torch.argmax otherwise."""
    rows = x.shape[0]
    if (
        x.is_cuda
        and rows <= _TRITON_ARGMAX_MAX_ROWS
        and x.dtype in _TRITON_ARGMAX_DTYPES
        and x.stride(-1) == 1
    ):
        from v1_engine.kernels import triton_argmax

        return triton_argmax.row_argmax(x)
    return x.argmax(dim=-1)


@dataclass
class SamplerOutput:
    sampled_token_ids: torch.Tensor
    """[N] int64."""
    logprobs: LogprobsTensors | None
    """Raw logprobs of the sampled tokens and the top max_num_logprobs; None if none asked."""


class Sampler:
    """Stateless; the per-request random state lives in the metadata's generators."""

    def __call__(self, logits: torch.Tensor, metadata: SamplingMetadata) -> SamplerOutput:
        """Sample one token per row of [N, V] logits (float32, or the model's 16-bit dtype: every
        computation but the argmax of unconstrained greedy rows runs in float32, and that argmax
        is the same on either); `logits` is not modified."""
        assert logits.dim() == 2 and logits.shape[0] == metadata.num_rows
        raw_logprobs = None
        if metadata.max_num_logprobs is not None:
            raw_logprobs = logits.log_softmax(dim=-1, dtype=torch.float32)
        logits = self._apply_constraints(logits, metadata)
        sampled = self._sample(logits, metadata)
        logprobs = None
        if raw_logprobs is not None:
            assert metadata.max_num_logprobs is not None
            logprobs = gather_logprobs(raw_logprobs, metadata.max_num_logprobs, sampled)
        return SamplerOutput(sampled_token_ids=sampled, logprobs=logprobs)

    @staticmethod
    def _apply_constraints(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
        """The grammar mask, allowed_token_ids, min_tokens, logit_bias and penalties, on a
        float32 copy so the caller's logits stay raw."""
        if metadata.no_logit_edits:
            return logits
        logits = logits.to(torch.float32, copy=True)
        if metadata.grammar_bitmask is not None:
            apply_token_bitmask(logits, metadata.grammar_bitmask)
        apply_allowed_token_mask(logits, metadata.allowed_token_mask)
        apply_min_tokens(logits, metadata.min_tokens_suppressed)
        apply_logit_bias(logits, metadata.logit_bias)
        return apply_penalties(logits, metadata)

    def _sample(self, logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
        greedy = None if metadata.all_random else row_argmax(logits)
        if metadata.all_greedy:
            assert greedy is not None
            return greedy
        sampled = self._sample_random(logits, metadata)
        if greedy is None:
            return sampled
        return torch.where(metadata.temperature == 0.0, greedy, sampled)

    @staticmethod
    def _sample_random(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
        temperature = metadata.temperature
        if not metadata.all_random:
            # Greedy rows' draws are discarded; 1.0 only avoids dividing by zero.
            temperature = torch.where(temperature == 0.0, 1.0, temperature)
        logits = logits.float() / temperature.unsqueeze(1)
        logits = apply_top_k_top_p(logits, metadata.top_k, metadata.max_top_k, metadata.top_p)
        if metadata.min_p is not None:
            logits = apply_min_p(logits, metadata.min_p)
        probs = logits.softmax(dim=-1)
        noise = exponential_noise(probs, metadata.generators)
        return row_argmax(probs.div_(noise))


def exponential_noise(probs: torch.Tensor, generators: dict[int, torch.Generator]) -> torch.Tensor:
    """Exponential(1) noise shaped like probs; seeded rows draw from their own generator only."""
    noise = torch.empty_like(probs)
    if len(generators) < probs.shape[0]:
        noise.exponential_()
    for row, generator in generators.items():
        noise[row].exponential_(generator=generator)
    return noise.clamp_min_(_MIN_EXPONENTIAL)
