"""SamplingParams.verify(): every bad value is a ValueError that names its field and the
allowed values (NaN and infinities included: a NaN temperature once sampled garbage)."""

from __future__ import annotations

import re

import pytest

from v1_engine.sampling_params import SamplingParams
from v1_engine.structured_output import StructuredOutputsParams


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"logit_bias": {5: 100.5}}, "logit_bias values must be numbers in [-100, 100]"),
        ({"logit_bias": {5: float("nan")}}, "logit_bias values"),
        ({"logit_bias": {5: "x"}}, "logit_bias values"),
        ({"logit_bias": {-1: 1.0}}, "logit_bias keys must be token ids"),
        ({"logit_bias": {"5": 1.0}}, "logit_bias keys must be token ids"),
        ({"logit_bias": [5]}, "logit_bias must be a dict"),
        ({"allowed_token_ids": []}, "allowed_token_ids must not be empty"),
        ({"allowed_token_ids": [3, -2]}, "allowed_token_ids must be a list of token ids"),
        ({"stop_token_ids": [True]}, "stop_token_ids must be a list of token ids"),
        ({"temperature": float("nan")}, "temperature must be a finite number >= 0"),
        ({"temperature": float("inf")}, "temperature must be a finite number >= 0"),
        ({"temperature": -0.1}, "temperature must be a finite number >= 0"),
        ({"top_p": float("nan")}, "top_p must be in (0, 1]"),
        ({"min_p": float("nan")}, "min_p must be in [0, 1]"),
        ({"presence_penalty": float("nan")}, "presence_penalty must be in [-2, 2]"),
        ({"frequency_penalty": 2.5}, "frequency_penalty must be in [-2, 2]"),
        ({"repetition_penalty": float("nan")}, "repetition_penalty must be in (0, 2]"),
        ({"seed": -1}, "seed must be in [0, 2**63)"),
        # Past 64 bits msgpack cannot carry them to the engine core (was an OverflowError).
        ({"top_k": 10**30}, "top_k must be below 2**63"),
        ({"max_tokens": 2**64}, "max_tokens must be below 2**63"),
        (
            {"min_tokens": 3, "structured_outputs": StructuredOutputsParams(regex="a")},
            "min_tokens must be 0 with structured_outputs",
        ),
    ],
)
def test_bad_values_name_the_field(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        SamplingParams(**kwargs).verify()


def test_defaults_and_edges_pass() -> None:
    SamplingParams().verify()
    SamplingParams(temperature=0.0, top_p=1.0, min_p=1.0, logit_bias={0: -100, 7: 100.0}).verify()
