"""The GPU A/B helper's comparison (engine_ab.assert_same_greedy) on hand-made completions."""

from __future__ import annotations

import pytest
from engine_ab import assert_same_greedy

from v1_engine.outputs import CompletionOutput, Logprob


def completion(tokens: list[int], top: list[dict[int, float]]) -> CompletionOutput:
    logprobs = [{t: Logprob(lp) for t, lp in step.items()} for step in top]
    return CompletionOutput(0, "", tokens, cumulative_logprob=None, logprobs=logprobs)


def test_agreement_passes_and_logprob_drift_fails():
    steps = [{7: -0.1, 8: -2.0}] * 5
    want = completion([7] * 5, steps)
    assert_same_greedy([completion([7] * 5, steps)], [want])
    drifted = completion([7] * 5, [{7: -0.2, 8: -2.0}] * 5)
    with pytest.raises(AssertionError, match="-0.2"):
        assert_same_greedy([drifted], [want])


def test_early_near_tie_passes_and_a_wrong_flip_reports_both_sides_logprobs():
    """A flip at step 1 passes as a near-tie (both tokens in both top 5s, each logprob the same
    in both runs and the two close in each); a flip with a gap, or with a token missing from a
    top 5, fails with each side's logprobs of both tokens in the message."""
    want = completion([7, 9, 9, 9, 9], [{7: -0.1}, {9: -0.69, 5: -0.70}] + [{9: -0.1}] * 3)
    tie = completion([7, 5, 5, 5, 5], [{7: -0.1}, {5: -0.69, 9: -0.695}] + [{5: -0.1}] * 3)
    assert_same_greedy([tie], [want])
    with pytest.raises(AssertionError, match="-0.2"):  # agreeing steps still compare logprobs
        assert_same_greedy([completion([7, 5, 5], [{7: -0.2}, {5: -0.69, 9: -0.695}])], [want])
    gap = completion([7, 5, 5, 5, 5], [{7: -0.1}, {5: -0.40, 9: -0.70}] + [{5: -0.1}] * 3)
    with pytest.raises(AssertionError) as failure:
        assert_same_greedy([gap], [want])
    message = str(failure.value)
    assert "step 1: got 5 (got's logprob -0.4000, want's -0.7000)" in message
    assert "want 9 (got's logprob -0.7000, want's -0.6900)" in message
    far = completion([7, 5, 5, 5, 5], [{7: -0.1}, {5: -0.05}] + [{5: -0.1}] * 3)
    with pytest.raises(AssertionError, match="want 9 \\(got's logprob not in top 5"):
        assert_same_greedy([far], [want])
    # the observed flip of the bf16 fold's engine test: one bf16 ulp (2^-5) of a logit near 6
    want = completion([86482] * 4, [{86482: -7.3275, 14233: -7.3587}] * 4)
    flip = completion([14233] * 4, [{14233: -7.3589, 86482: -7.3589}] * 4)
    assert_same_greedy([flip], [want])
