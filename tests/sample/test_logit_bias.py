"""logit_bias and allowed_token_ids: the logit edits against a plain reference, their effect on
greedy and random rows, what a batch without them skips, and the checks on their values."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from v1_engine.sample.metadata import SamplingMetadata
from v1_engine.sample.penalties import apply_allowed_token_mask, apply_logit_bias
from v1_engine.sample.sampler import Sampler
from v1_engine.sampling_params import SamplingParams

BuildMetadata = Callable[..., SamplingMetadata]
VOCAB = 48


def sample(logits: torch.Tensor, metadata: SamplingMetadata) -> list[int]:
    return Sampler()(logits, metadata).sampled_token_ids.tolist()


def test_logit_bias_adds_each_rows_own_values(build_metadata: BuildMetadata) -> None:
    params = [
        SamplingParams(logit_bias={3: 2.5, 40: -7.0}),
        SamplingParams(),
        SamplingParams(logit_bias={0: 100.0, 3: -0.25}),
    ]
    logits = torch.randn(3, VOCAB)
    metadata = build_metadata(params, VOCAB)
    result = apply_logit_bias(logits.clone(), metadata.logit_bias)
    expected = logits.clone()
    for row, p in enumerate(params):
        for token, bias in (p.logit_bias or {}).items():
            expected[row, token] += bias
    torch.testing.assert_close(result, expected, rtol=0, atol=0)


def test_allowed_token_ids_ban_every_other_token(build_metadata: BuildMetadata) -> None:
    params = [SamplingParams(allowed_token_ids=[5, 7, 47]), SamplingParams()]
    logits = torch.randn(2, VOCAB)
    metadata = build_metadata(params, VOCAB)
    result = apply_allowed_token_mask(logits.clone(), metadata.allowed_token_mask)
    allowed = torch.zeros(VOCAB, dtype=torch.bool)
    allowed[[5, 7, 47]] = True
    assert torch.equal(result[0, allowed], logits[0, allowed])
    assert torch.isneginf(result[0, ~allowed]).all()
    assert torch.equal(result[1], logits[1])


def test_greedy_follows_the_bias(build_metadata: BuildMetadata) -> None:
    logits = torch.zeros(3, VOCAB)
    logits[:, 11] = 5.0
    params = [
        SamplingParams(temperature=0.0, logit_bias={20: 6.0}),  # 6 beats 5
        SamplingParams(temperature=0.0, logit_bias={20: 4.0}),  # 4 does not
        SamplingParams(temperature=0.0, logit_bias={11: -100.0}),  # the argmax banned
    ]
    picks = sample(logits, build_metadata(params, VOCAB))
    assert picks[0] == 20 and picks[1] == 11
    assert picks[2] != 11


def test_random_rows_never_sample_a_banned_or_disallowed_token(
    build_metadata: BuildMetadata,
) -> None:
    logits = torch.zeros(1, VOCAB)  # uniform
    banned = {t: -100.0 for t in range(0, VOCAB, 2)}
    params = [SamplingParams(temperature=1.0, logit_bias=banned)] * 200
    picks = sample(logits.expand(200, -1).contiguous(), build_metadata(params, VOCAB))
    assert all(t % 2 == 1 for t in picks)
    assert len(set(picks)) > VOCAB // 4  # still random among the odd ones
    params = [SamplingParams(temperature=2.0, allowed_token_ids=[9, 30])] * 200
    picks = sample(logits.expand(200, -1).contiguous(), build_metadata(params, VOCAB))
    assert set(picks) == {9, 30}


def test_logprobs_stay_those_of_the_raw_logits(build_metadata: BuildMetadata) -> None:
    logits = torch.randn(1, VOCAB)
    params = [SamplingParams(temperature=0.0, logprobs=2, logit_bias={4: 100.0})]
    out = Sampler()(logits, build_metadata(params, VOCAB))
    assert out.sampled_token_ids.tolist() == [4]
    assert out.logprobs is not None
    raw = logits.log_softmax(dim=-1)
    assert out.logprobs.logprobs[0, 0].item() == pytest.approx(raw[0, 4].item())


def test_a_batch_without_them_builds_nothing(build_metadata: BuildMetadata) -> None:
    metadata = build_metadata([SamplingParams(), SamplingParams(temperature=0.0)], VOCAB)
    assert metadata.logit_bias is None and metadata.allowed_token_mask is None
    assert metadata.no_logit_edits
    biased = build_metadata([SamplingParams(logit_bias={1: 1.0})], VOCAB)
    assert not biased.no_logit_edits


def test_token_id_fields_for_the_vocabulary_check() -> None:
    params = SamplingParams(stop_token_ids=[2], logit_bias={7: 1.0}, allowed_token_ids=[1, 9])
    assert params.token_id_fields() == {
        "stop_token_ids": [2],
        "logit_bias": [7],
        "allowed_token_ids": [1, 9],
    }
    assert SamplingParams().token_id_fields() == {}
