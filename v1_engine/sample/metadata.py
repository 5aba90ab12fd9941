"""SamplingMetadata: the per-step sampling parameters of a batch, as device tensors.

One row per request that samples this step. Optional features (top-k, top-p, min-p, each
penalty) are None when no row uses them, so the sampler skips their kernels entirely; rows that
do not use a feature present in the batch get its neutral value (top_k = vocab size, top_p = 1,
min_p = 0, penalty 0 or 1).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from v1_engine.sampling_params import _SAMPLING_EPS, SamplingParams

_NEUTRAL = SamplingParams()


@dataclass
class SamplingMetadata:
    temperature: torch.Tensor
    """[N] float32; 0 marks a greedy row."""
    all_greedy: bool
    all_random: bool
    top_p: torch.Tensor | None
    """[N] float32 in (0, 1], or None when no row uses top-p."""
    top_k: torch.Tensor | None
    """[N] int64 in [1, vocab_size], or None when no row uses top-k."""
    max_top_k: int
    """Largest top_k of the batch, known on the host so top-k needs no device sync."""
    min_p: torch.Tensor | None
    """[N] float32 in [0, 1], or None when no row uses min-p."""
    generators: dict[int, torch.Generator]
    """Row -> the request's own generator, for seeded random rows."""
    max_num_logprobs: int | None
    """Most `logprobs` any row asks for; None when no row asks."""
    presence_penalties: torch.Tensor | None
    frequency_penalties: torch.Tensor | None
    repetition_penalties: torch.Tensor | None
    prompt_token_ids: torch.Tensor | None
    """[N, L] int64 padded with vocab_size; only built when a row uses repetition_penalty."""
    output_token_ids: Sequence[Sequence[int]]
    min_tokens_suppressed: dict[int, set[int]] = field(default_factory=dict)
    """Row -> token ids that must not be sampled yet (EOS and stop_token_ids, before
    min_tokens outputs)."""
    logit_bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    """(rows, token ids, biases): [B] int64, [B] int64, [B] float32, one entry per (row, token)
    of the rows' `logit_bias`; None when no row has one."""
    allowed_token_mask: tuple[torch.Tensor, torch.Tensor] | None = None
    """(rows [R] int64, banned [R, V] bool): the rows with `allowed_token_ids` and, for each,
    True on every token it may not sample; None when no row restricts its tokens."""
    grammar_bitmask: torch.Tensor | None = None
    """[N, ceil(V / 32)] int32: each row's allowed tokens under its structured-output grammar
    (all bits set for unconstrained rows); None when no row has a grammar. Set by the runner."""

    @property
    def num_rows(self) -> int:
        return self.temperature.shape[0]

    @property
    def no_logit_edits(self) -> bool:
        """No row's logits change before sampling except by temperature / top-k / top-p / min-p."""
        return (
            not self.min_tokens_suppressed
            and self.no_penalties
            and self.logit_bias is None
            and self.allowed_token_mask is None
            and self.grammar_bitmask is None
        )

    @property
    def no_penalties(self) -> bool:
        return (
            self.presence_penalties is None
            and self.frequency_penalties is None
            and self.repetition_penalties is None
        )

    @classmethod
    def build(
        cls,
        params: Sequence[SamplingParams],
        prompt_token_ids: Sequence[Sequence[int]],
        output_token_ids: Sequence[Sequence[int]],
        eos_token_ids: Sequence[int | None],
        generators: Sequence[torch.Generator | None],
        vocab_size: int,
        device: torch.device,
    ) -> SamplingMetadata:
        """Batch the requests' parameters; the generators are the runner's per-request ones."""
        num_rows = len(params)
        assert num_rows > 0
        assert len(prompt_token_ids) == len(output_token_ids) == num_rows
        assert len(eos_token_ids) == len(generators) == num_rows
        greedy = [p.is_greedy for p in params]
        # Greedy rows take the argmax before any mask, so they get the neutral values and do
        # not switch a mask on for the batch.
        random_params = [_NEUTRAL if g else p for p, g in zip(params, greedy)]
        top_ks = [_effective_top_k(p.top_k, vocab_size) for p in random_params]
        repetition_penalties = _optional(
            [p.repetition_penalty for p in params], 1.0, torch.float32, device
        )
        return cls(
            temperature=_tensor(
                [0.0 if g else p.temperature for p, g in zip(params, greedy)], torch.float32, device
            ),
            all_greedy=all(greedy),
            all_random=not any(greedy),
            top_p=_optional([p.top_p for p in random_params], 1.0, torch.float32, device),
            top_k=_optional(top_ks, vocab_size, torch.int64, device),
            max_top_k=max(top_ks),
            min_p=_optional([p.min_p for p in random_params], 0.0, torch.float32, device),
            generators={
                row: gen
                for row, gen in enumerate(generators)
                if gen is not None and not greedy[row]
            },
            max_num_logprobs=max(
                (p.logprobs for p in params if p.logprobs is not None), default=None
            ),
            presence_penalties=_optional(
                [p.presence_penalty for p in params], 0.0, torch.float32, device
            ),
            frequency_penalties=_optional(
                [p.frequency_penalty for p in params], 0.0, torch.float32, device
            ),
            repetition_penalties=repetition_penalties,
            prompt_token_ids=(
                None
                if repetition_penalties is None
                else pad_token_ids(prompt_token_ids, vocab_size, device)
            ),
            # Not copied: only read during this step, and copying grows with the output.
            output_token_ids=list(output_token_ids),
            min_tokens_suppressed=_min_tokens_suppressed(params, output_token_ids, eos_token_ids),
            logit_bias=_logit_bias(params, device),
            allowed_token_mask=_allowed_token_mask(params, vocab_size, device),
        )


def pad_token_ids(
    token_ids: Sequence[Sequence[int]], pad_id: int, device: torch.device
) -> torch.Tensor:
    """[N, max_len] int64, right-padded with pad_id (vocab_size: one past the last real id)."""
    max_len = max((len(ids) for ids in token_ids), default=0)
    padded = torch.full((len(token_ids), max_len), pad_id, dtype=torch.int64)
    for row, ids in enumerate(token_ids):
        if ids:
            padded[row, : len(ids)] = torch.as_tensor(ids, dtype=torch.int64)
    return padded.to(device, non_blocking=True)


def _effective_top_k(top_k: int, vocab_size: int) -> int:
    """0 and -1 mean "off", which is the same as keeping the whole vocabulary."""
    return vocab_size if top_k <= 0 else min(top_k, vocab_size)


def _tensor(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)


def _optional(
    values: list, neutral: float, dtype: torch.dtype, device: torch.device
) -> torch.Tensor | None:
    """The tensor of values, or None when every row has the neutral (feature off) value."""
    if all(abs(v - neutral) < _SAMPLING_EPS for v in values):
        return None
    return _tensor(values, dtype, device)


def _logit_bias(
    params: Sequence[SamplingParams], device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    rows: list[int] = []
    token_ids: list[int] = []
    biases: list[float] = []
    for row, p in enumerate(params):
        if p.logit_bias:
            rows += [row] * len(p.logit_bias)
            token_ids += p.logit_bias.keys()
            biases += p.logit_bias.values()
    if not rows:
        return None
    return (
        _tensor(rows, torch.int64, device),
        _tensor(token_ids, torch.int64, device),
        _tensor(biases, torch.float32, device),
    )


def _allowed_token_mask(
    params: Sequence[SamplingParams], vocab_size: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor] | None:
    rows = [row for row, p in enumerate(params) if p.allowed_token_ids]
    if not rows:
        return None
    banned = torch.ones((len(rows), vocab_size), dtype=torch.bool)
    for i, row in enumerate(rows):
        allowed = params[row].allowed_token_ids
        assert allowed is not None
        banned[i, torch.as_tensor(allowed, dtype=torch.int64)] = False
    return _tensor(rows, torch.int64, device), banned.to(device, non_blocking=True)


def _min_tokens_suppressed(
    params: Sequence[SamplingParams],
    output_token_ids: Sequence[Sequence[int]],
    eos_token_ids: Sequence[int | None],
) -> dict[int, set[int]]:
    suppressed: dict[int, set[int]] = {}
    for row, (p, outputs, eos) in enumerate(zip(params, output_token_ids, eos_token_ids)):
        if len(outputs) >= p.min_tokens:
            continue
        stop_ids = set(p.stop_token_ids or ())
        if eos is not None and not p.ignore_eos:
            stop_ids.add(eos)
        if stop_ids:
            suppressed[row] = stop_ids
    return suppressed
