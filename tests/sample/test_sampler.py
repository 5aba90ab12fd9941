"""Sampler: greedy, temperature, masks, seeds and the distribution of random draws."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import pytest
import torch

from v1_engine.sample.metadata import SamplingMetadata
from v1_engine.sample.sampler import Sampler
from v1_engine.sampling_params import SamplingParams

BuildMetadata = Callable[..., SamplingMetadata]
VOCAB = 64


def sample(logits: torch.Tensor, metadata: SamplingMetadata) -> list[int]:
    return Sampler()(logits, metadata).sampled_token_ids.tolist()


def test_greedy_is_argmax_and_leaves_logits_untouched(build_metadata: BuildMetadata) -> None:
    logits = torch.randn(8, VOCAB)
    original = logits.clone()
    params = [SamplingParams(temperature=0.0, top_k=2, top_p=0.1)] * 8
    metadata = build_metadata(params, VOCAB)
    assert metadata.all_greedy
    assert sample(logits, metadata) == logits.argmax(dim=1).tolist()
    assert torch.equal(logits, original)


def test_greedy_uses_penalized_logits(build_metadata: BuildMetadata) -> None:
    logits = torch.zeros(1, VOCAB)
    logits[0, 5], logits[0, 9] = 3.0, 2.0
    params = [SamplingParams(temperature=0.0, repetition_penalty=2.0)]
    metadata = build_metadata(params, VOCAB, prompts=[[5]])
    assert sample(logits, metadata) == [9]


def test_mixed_batch_keeps_greedy_rows_greedy(build_metadata: BuildMetadata) -> None:
    logits = torch.randn(6, VOCAB)
    greedy, random = SamplingParams(temperature=0.0), SamplingParams(temperature=5.0)
    metadata = build_metadata([greedy, random] * 3, VOCAB)
    sampled = sample(logits, metadata)
    expected = logits.argmax(dim=1).tolist()
    assert [sampled[i] for i in (0, 2, 4)] == [expected[i] for i in (0, 2, 4)]


def test_a_single_allowed_token_is_always_sampled(build_metadata: BuildMetadata) -> None:
    logits = torch.randn(5, VOCAB)
    params = [
        SamplingParams(top_k=1),
        SamplingParams(top_p=1e-6),
        SamplingParams(min_p=1.0),
        SamplingParams(temperature=3.0, top_k=1, top_p=0.5),
        SamplingParams(temperature=1e-3),
    ]
    for _ in range(20):
        assert sample(logits, build_metadata(params, VOCAB)) == logits.argmax(dim=1).tolist()


def test_min_tokens_blocks_eos_in_random_rows(build_metadata: BuildMetadata) -> None:
    logits = torch.full((1, VOCAB), -10.0)
    logits[0, 3] = 10.0  # EOS would almost surely win
    logits[0, 4] = 0.0
    params = [SamplingParams(min_tokens=2)]
    assert sample(logits, build_metadata(params, VOCAB, outputs=[[4]], eos=[3])) == [4]
    assert sample(logits, build_metadata(params, VOCAB, outputs=[[4, 4]], eos=[3])) == [3]


def empirical_distribution(
    logits: torch.Tensor, params: SamplingParams, build_metadata: BuildMetadata, draws: int
) -> torch.Tensor:
    """Frequencies of `draws` samples from one row's distribution, drawn as a batch."""
    vocab_size = logits.shape[0]
    metadata = build_metadata([params] * draws, vocab_size)
    sampled = Sampler()(logits.expand(draws, -1).contiguous(), metadata).sampled_token_ids
    return torch.bincount(sampled, minlength=vocab_size).double() / draws


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_frequencies_follow_tempered_softmax(
    build_metadata: BuildMetadata, temperature: float
) -> None:
    logits = torch.tensor([1.0, 0.0, 2.0, -1.0, 0.5, 1.5])
    freq = empirical_distribution(
        logits, SamplingParams(temperature=temperature), build_metadata, 40_000
    )
    expected = torch.softmax(logits.double() / temperature, dim=0)
    assert (freq - expected).abs().max() < 0.015


def test_frequencies_follow_renormalized_top_k_top_p(build_metadata: BuildMetadata) -> None:
    logits = torch.tensor([0.0, 3.0, 2.5, 2.0, 1.0, -1.0]).log_softmax(0)
    params = SamplingParams(top_k=4, top_p=0.85)
    freq = empirical_distribution(logits, params, build_metadata, 40_000)
    # Top-4 keeps tokens 1, 2, 3, 4; their nucleus of mass 0.85 drops token 4.
    kept = torch.softmax(logits.double()[[1, 2, 3, 4]], dim=0)
    assert kept[:3].sum() >= 0.85 > kept[:2].sum()
    expected = torch.zeros(6, dtype=torch.float64)
    expected[[1, 2, 3]] = kept[:3] / kept[:3].sum()
    assert freq[[0, 4, 5]].sum() == 0
    assert (freq - expected).abs().max() < 0.015


def run_steps(
    build_metadata: BuildMetadata,
    rows: list[tuple[SamplingParams, int | None]],
    logits_per_step: list[torch.Tensor],
) -> list[list[int]]:
    """Sample several steps; each row's (params, seed); one generator per seeded row."""
    generators = [None if s is None else torch.Generator().manual_seed(s) for _, s in rows]
    params = [p for p, _ in rows]
    tokens: list[list[int]] = [[] for _ in rows]
    for logits in logits_per_step:
        metadata = build_metadata(params, VOCAB, generators=generators)
        for row, token in enumerate(sample(logits[: len(rows)], metadata)):
            tokens[row].append(token)
    return tokens


def test_seeded_rows_are_reproducible_whatever_the_batch(build_metadata: BuildMetadata) -> None:
    steps = [torch.randn(1, VOCAB).expand(4, -1).contiguous() for _ in range(12)]
    a = SamplingParams(temperature=1.5, top_p=0.95, seed=11)
    b = SamplingParams(temperature=1.5, seed=22)
    other = SamplingParams(temperature=1.5, top_k=7)
    alone_a = run_steps(build_metadata, [(a, 11)], steps)[0]
    alone_b = run_steps(build_metadata, [(b, 22)], steps)[0]
    mixed = run_steps(build_metadata, [(other, None), (b, 22), (other, 5), (a, 11)], steps)
    assert mixed[3] == alone_a and mixed[1] == alone_b
    assert alone_a == run_steps(build_metadata, [(a, 11)], steps)[0]
    assert len(set(alone_a)) > 1  # really random, not a constant token


def test_unseeded_rows_differ_between_draws(build_metadata: BuildMetadata) -> None:
    logits = torch.zeros(16, VOCAB)
    metadata = build_metadata([SamplingParams()] * 16, VOCAB)
    first, second = sample(logits, metadata), sample(logits, metadata)
    assert first != second
    assert len(set(first)) > 4


def test_row_argmax_on_cpu_is_torch_argmax():
    from v1_engine.sample.sampler import row_argmax

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(5, 4096, generator=gen)
    x[1, [100, 3000, 4000]] = 50.0  # ties: the first wins
    x[3, [2500, 90]] = float("nan")  # NaN is the max; the first NaN wins
    x[4] = 0.0  # all equal: index 0
    assert row_argmax(x).tolist()[1:] == [100, x[2].argmax().item(), 90, 0]


@pytest.mark.gpu
def test_row_argmax_on_cuda():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    from v1_engine.sample.sampler import _TRITON_ARGMAX_MAX_ROWS, row_argmax

    x = torch.randn(3, 128256, device="cuda")
    x[0, [5, 128000]] = 99.0
    x[2, 77777] = float("nan")
    assert torch.equal(row_argmax(x), x.argmax(dim=-1))
    # The Triton path (kernels/triton_argmax.py) on bf16 logits, at a batch-64 decode step and
    # at the most rows it takes; one row more takes torch.argmax.
    assert torch.equal(row_argmax(x.bfloat16()), x.bfloat16().argmax(dim=-1))
    for rows in (64, _TRITON_ARGMAX_MAX_ROWS, _TRITON_ARGMAX_MAX_ROWS + 1):
        many = torch.randn(rows, 128256, device="cuda").bfloat16()
        many[rows // 2, [7, 70000]] = 50.0  # a tie in one row: the first index wins
        assert torch.equal(row_argmax(many), many.argmax(dim=-1))


def test_model_dtype_logits_sample_as_their_float32_copy(build_metadata: BuildMetadata) -> None:
    """compute_logits returns the model's dtype: the sampler upcasts wherever it computes, so
    bf16 logits give the tokens and logprobs of their float32 copy, and stay untouched."""
    gen = torch.Generator().manual_seed(5)
    logits = (torch.randn(4, VOCAB, generator=gen) * 3).bfloat16()
    original = logits.clone()
    rows = [
        SamplingParams(temperature=0.0, logprobs=3),
        SamplingParams(temperature=0.0, repetition_penalty=1.7, presence_penalty=0.5),
        SamplingParams(temperature=0.8, top_k=10, seed=7, logprobs=2),
        SamplingParams(temperature=1.2, top_p=0.9, min_p=0.05, seed=8),
    ]
    results = []
    for x in (logits, logits.float()):
        generators = [
            None if p.seed is None else torch.Generator().manual_seed(p.seed) for p in rows
        ]
        metadata = build_metadata(rows, VOCAB, prompts=[[1, 2, 3]] * 4, generators=generators)
        out = Sampler()(x, metadata)
        results.append((out.sampled_token_ids, out.logprobs))
    (tokens16, logprobs16), (tokens32, logprobs32) = results
    assert torch.equal(tokens16, tokens32)
    assert logprobs16 is not None and logprobs32 is not None
    for a, b in zip(dataclasses.astuple(logprobs16), dataclasses.astuple(logprobs32), strict=True):
        assert torch.equal(a, b)
    assert torch.equal(logits, original) and logits.dtype == torch.bfloat16
