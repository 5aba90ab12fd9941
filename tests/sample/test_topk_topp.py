"""Top-k, top-p and min-p masks against a sort-based float64 reference."""

from __future__ import annotations

import pytest
import torch

from v1_engine.sample.topk_topp import apply_min_p, apply_top_k_only, apply_top_k_top_p

VOCAB = 257


def reference_keep(
    logits: torch.Tensor, top_k: list[int] | None, top_p: list[float] | None
) -> torch.Tensor:
    """Row by row: keep the k largest, then the shortest descending prefix with mass >= p."""
    keep = torch.ones_like(logits, dtype=torch.bool)
    for row in range(logits.shape[0]):
        values = logits[row].double()
        order = values.argsort(descending=True)
        allowed = order[: top_k[row]] if top_k is not None else order
        if top_p is not None:
            probs = torch.softmax(values[allowed], dim=0)
            mass_before = torch.cumsum(probs, dim=0) - probs
            allowed = allowed[mass_before < top_p[row]]
        keep[row] = False
        keep[row, allowed] = True
    return keep


def random_logits(num_rows: int) -> torch.Tensor:
    return torch.randn(num_rows, VOCAB, generator=torch.Generator().manual_seed(7)) * 3


def assert_masked_as(result: torch.Tensor, original: torch.Tensor, keep: torch.Tensor) -> None:
    assert torch.equal(torch.isfinite(result), keep)
    assert torch.equal(result[keep], original[keep])
    assert torch.all(result[~keep] == float("-inf"))


def test_top_k_only_matches_reference() -> None:
    logits = random_logits(5)
    top_k = [1, 3, 50, VOCAB, 10]
    result = apply_top_k_only(logits.clone(), torch.tensor(top_k), max(top_k))
    assert_masked_as(result, logits, reference_keep(logits, top_k, None))
    assert torch.isfinite(result).sum(dim=1).tolist() == top_k


def test_top_k_through_sort_path_equals_topk_path() -> None:
    logits = random_logits(4)
    top_k = torch.tensor([2, 7, 100, VOCAB])
    via_topk = apply_top_k_only(logits.clone(), top_k, int(top_k.max()))
    via_sort = apply_top_k_top_p(logits.clone(), top_k, int(top_k.max()), torch.ones(4))
    assert torch.equal(via_topk, via_sort)


def test_top_p_matches_reference() -> None:
    logits = random_logits(6)
    top_p = [0.05, 0.3, 0.5, 0.9, 0.99, 1.0]
    result = apply_top_k_top_p(logits.clone(), None, VOCAB, torch.tensor(top_p))
    keep = reference_keep(logits, None, top_p)
    assert_masked_as(result, logits, keep)
    assert keep[5].all() and keep[0].sum() >= 1 and keep[3].sum() > keep[1].sum()


def test_top_k_then_top_p_matches_reference() -> None:
    logits = random_logits(4)
    top_k, top_p = [5, 40, VOCAB, 1], [0.6, 0.8, 0.4, 0.9]
    result = apply_top_k_top_p(logits.clone(), torch.tensor(top_k), max(top_k), torch.tensor(top_p))
    assert_masked_as(result, logits, reference_keep(logits, top_k, top_p))


def test_top_p_keeps_the_most_likely_token_even_for_tiny_p() -> None:
    logits = random_logits(3)
    result = apply_top_k_top_p(logits.clone(), None, VOCAB, torch.full((3,), 1e-6))
    assert torch.equal(result.argmax(dim=1), logits.argmax(dim=1))
    assert torch.isfinite(result).sum(dim=1).tolist() == [1, 1, 1]


@pytest.mark.parametrize("min_p", [0.0, 0.01, 0.2, 1.0])
def test_min_p_matches_reference(min_p: float) -> None:
    logits = random_logits(4)
    result = apply_min_p(logits.clone(), torch.full((4,), min_p))
    probs = torch.softmax(logits.double(), dim=1)
    keep = probs >= min_p * probs.max(dim=1, keepdim=True).values
    assert_masked_as(result, logits, keep)
    if min_p == 1.0:
        assert torch.isfinite(result).sum(dim=1).tolist() == [1, 1, 1, 1]
