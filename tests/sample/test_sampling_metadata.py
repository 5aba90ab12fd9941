"""SamplingMetadata.build: optional features off when unused, neutral values elsewhere."""

from __future__ import annotations

from collections.abc import Callable

import torch

from v1_engine.sample.metadata import SamplingMetadata
from v1_engine.sampling_params import SamplingParams

BuildMetadata = Callable[..., SamplingMetadata]


def test_plain_batch_switches_every_optional_feature_off(build_metadata: BuildMetadata) -> None:
    metadata = build_metadata([SamplingParams(), SamplingParams(temperature=0.5)], 100)
    assert metadata.all_random and not metadata.all_greedy
    assert metadata.top_k is None and metadata.top_p is None and metadata.min_p is None
    assert metadata.no_penalties and metadata.prompt_token_ids is None
    assert metadata.max_num_logprobs is None
    assert metadata.temperature.tolist() == [1.0, 0.5]


def test_features_get_neutral_values_in_rows_that_do_not_use_them(
    build_metadata: BuildMetadata,
) -> None:
    params = [
        SamplingParams(top_k=5, top_p=0.5),
        SamplingParams(top_k=-1, min_p=0.1, logprobs=3),
        SamplingParams(top_k=1000, logprobs=0),
    ]
    metadata = build_metadata(params, 100)
    assert metadata.top_k is not None and metadata.top_k.tolist() == [5, 100, 100]
    assert metadata.max_top_k == 100
    assert metadata.top_p is not None and metadata.top_p.tolist() == [0.5, 1.0, 1.0]
    assert metadata.min_p is not None
    torch.testing.assert_close(metadata.min_p, torch.tensor([0.0, 0.1, 0.0]))
    assert metadata.max_num_logprobs == 3


def test_greedy_rows_neither_switch_masks_on_nor_keep_generators(
    build_metadata: BuildMetadata,
) -> None:
    params = [SamplingParams(temperature=0.0, top_k=3, top_p=0.1, seed=1), SamplingParams(seed=2)]
    generators = [torch.Generator().manual_seed(1), torch.Generator().manual_seed(2)]
    metadata = build_metadata(params, 50, generators=generators)
    assert not metadata.all_greedy and not metadata.all_random
    assert metadata.temperature.tolist() == [0.0, 1.0]
    assert metadata.top_k is None and metadata.top_p is None
    assert metadata.generators == {1: generators[1]}


def test_repetition_penalty_pads_prompts_with_vocab_size(build_metadata: BuildMetadata) -> None:
    params = [SamplingParams(repetition_penalty=1.2), SamplingParams()]
    metadata = build_metadata(params, 50, prompts=[[3, 4, 5], [6]])
    assert metadata.prompt_token_ids is not None
    assert metadata.prompt_token_ids.tolist() == [[3, 4, 5], [6, 50, 50]]
    assert metadata.repetition_penalties is not None
    assert metadata.presence_penalties is None and metadata.frequency_penalties is None
