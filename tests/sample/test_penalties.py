"""Penalties and min_tokens suppression against a plain Python reference loop."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

import torch

from v1_engine.sample.metadata import SamplingMetadata
from v1_engine.sample.penalties import apply_min_tokens, apply_penalties
from v1_engine.sampling_params import SamplingParams

BuildMetadata = Callable[..., SamplingMetadata]

VOCAB = 32


def reference_penalties(
    logits: torch.Tensor,
    params: list[SamplingParams],
    prompts: list[list[int]],
    outputs: list[list[int]],
) -> torch.Tensor:
    expected = logits.double().clone()
    for row, p in enumerate(params):
        for token in set(prompts[row]) | set(outputs[row]):
            value = expected[row, token]
            rep = p.repetition_penalty
            expected[row, token] = value / rep if value > 0 else value * rep
        for token, count in Counter(outputs[row]).items():
            expected[row, token] -= p.frequency_penalty * count + p.presence_penalty
    return expected.float()


def test_penalties_match_reference_loop(build_metadata: BuildMetadata) -> None:
    params = [
        SamplingParams(repetition_penalty=1.3),
        SamplingParams(frequency_penalty=0.7, presence_penalty=-0.4),
        SamplingParams(repetition_penalty=0.8, frequency_penalty=-1.1, presence_penalty=1.5),
        SamplingParams(),
    ]
    prompts = [[1, 2, 2, 5], [3, 4], [7, 8, 9, 10, 11], [1, 2, 3]]
    outputs = [[5, 6, 6], [4, 4, 4, 12], [], [1, 1]]
    logits = torch.randn(4, VOCAB) * 2
    metadata = build_metadata(params, VOCAB, prompts=prompts, outputs=outputs)
    result = apply_penalties(logits.clone(), metadata)
    torch.testing.assert_close(result, reference_penalties(logits, params, prompts, outputs))
    assert torch.equal(result[3], logits[3])
    # Row 1 only has output-based penalties: a prompt-only token keeps its logit.
    assert result[1, 3] == logits[1, 3]
    assert result[1, 4] == logits[1, 4] - 0.7 * 3 + 0.4


def test_repetition_penalty_always_discourages_seen_tokens(build_metadata: BuildMetadata) -> None:
    logits = torch.tensor([[2.0, -2.0, 2.0, -2.0]])
    metadata = build_metadata(
        [SamplingParams(repetition_penalty=2.0)], 4, prompts=[[0]], outputs=[[1]]
    )
    result = apply_penalties(logits.clone(), metadata)
    assert result.tolist() == [[1.0, -4.0, 2.0, -2.0]]


def test_no_penalties_leaves_logits_untouched(build_metadata: BuildMetadata) -> None:
    logits = torch.randn(2, VOCAB)
    metadata = build_metadata([SamplingParams()] * 2, VOCAB, outputs=[[1, 2], [3]])
    assert metadata.no_penalties
    assert torch.equal(apply_penalties(logits.clone(), metadata), logits)


def test_min_tokens_suppresses_eos_and_stop_tokens_until_reached(
    build_metadata: BuildMetadata,
) -> None:
    params = [
        SamplingParams(min_tokens=3, stop_token_ids=[7]),
        SamplingParams(min_tokens=3, stop_token_ids=[7]),
        SamplingParams(min_tokens=2, ignore_eos=True),
        SamplingParams(),
    ]
    outputs = [[1, 1], [1, 1, 1], [], []]
    metadata = build_metadata(params, VOCAB, outputs=outputs, eos=[2, 2, 2, 2])
    assert metadata.min_tokens_suppressed == {0: {2, 7}}
    logits = torch.zeros(4, VOCAB)
    result = apply_min_tokens(logits.clone(), metadata.min_tokens_suppressed)
    assert result[0, 2] == float("-inf") and result[0, 7] == float("-inf")
    assert torch.isinf(result).sum() == 2
