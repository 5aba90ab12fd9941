"""The rescored FP8 head's re-score kernel (kernels/triton_rescore.py) against its oracle
(layers/embedding.py's rescore_slice_tops_ref): the same entries replaced, by the same values up
to float32 summation order, everything else untouched; the oracle against a plain reading of
the strided slices; ties, short slices and -inf rows. Under the interpreter on CPU, on the
device with CUDA."""

from __future__ import annotations

import pytest
import torch

from v1_engine.layers.embedding import rescore_slice_tops_ref

# On the CPU the kernels run under Triton's interpreter, which tests/conftest.py turns on
# before any kernel module is imported.
triton_rescore = pytest.importorskip("v1_engine.kernels.triton_rescore")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def case(rows: int, vocab: int, hidden: int, dtype: torch.dtype, seed: int):
    gen = torch.Generator().manual_seed(seed)
    logits = (torch.randn(rows, vocab, generator=gen) * 3).to(dtype)
    h = torch.randn(rows, hidden, generator=gen).to(dtype)
    w = (torch.randn(vocab, hidden, generator=gen) / hidden**0.5).to(dtype)
    return logits, h, w


def check(logits, h, w, chunk, top):
    expected = rescore_slice_tops_ref(logits.clone(), h, w, chunk, top)
    dev = [t.to(DEVICE, copy=True) for t in (logits, h, w)]
    got = triton_rescore.rescore_slice_tops(dev[0], dev[1], dev[2], chunk, top).cpu()
    changed = expected != logits
    # Every replaced entry (and no other) holds the exact dot product, to float32 summation
    # order and one rounding to the logits' dtype.
    assert torch.equal(got[~changed], logits[~changed])
    tol = {torch.float32: 1e-5, torch.bfloat16: 8e-3, torch.float16: 1e-3}[logits.dtype]
    torch.testing.assert_close(got.float(), expected.float(), rtol=tol, atol=tol)
    return got, expected


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    ("rows", "vocab", "hidden", "chunk", "top"),
    [(1, 1000, 64, 256, 4), (3, 1024, 96, 256, 2), (2, 777, 1100, 128, 4), (1, 5, 32, 64, 4)],
)
def test_matches_the_reference(dtype, rows, vocab, hidden, chunk, top):
    logits, h, w = case(rows, vocab, hidden, dtype, seed=vocab + rows)
    got, expected = check(logits, h, w, chunk, top)
    exact = (h.float() @ w.float().T).to(dtype)
    tol = {torch.float32: 1e-5, torch.bfloat16: 8e-3, torch.float16: 1e-3}[dtype]
    slices = -(-vocab // chunk)
    for row in range(rows):
        picked = []
        for c in range(slices):  # slice c: tokens c, c + slices, ...
            members = torch.arange(c, vocab, slices)
            order = logits[row, members].float().sort(descending=True, stable=True).indices
            picked += members[order[:top]].tolist()
        assert len(set(picked)) == sum(
            min(top, len(range(c, vocab, slices))) for c in range(slices)
        )
        torch.testing.assert_close(
            expected[row, picked].float(), exact[row, picked].float(), rtol=tol, atol=tol
        )
        untouched = torch.ones(vocab, dtype=torch.bool)
        untouched[picked] = False
        assert torch.equal(expected[row, untouched], logits[row, untouched])
        assert torch.equal(got[row, untouched], logits[row, untouched])


def test_ties_take_the_lowest_index_and_minus_inf_rows_stay_safe():
    chunk, top = 64, 2  # vocab 200: 4 slices (c, c + 4, ...), of 50 tokens each
    logits = torch.zeros(3, 200)
    logits[0, [5, 9, 41]] = 4.0  # a three-way tie in slice 1: indices 5 and 9 re-scored
    logits[1] = float("-inf")  # nothing but -inf: each slice's first two tokens
    logits[2, 100:] = float("-inf")
    h = torch.randn(3, 16)
    w = torch.randn(200, 16)
    got, _ = check(logits, h, w, chunk, top)
    exact = h @ w.T
    assert torch.allclose(got[0, [5, 9]], exact[0, [5, 9]]) and got[0, 41] == 4.0
    firsts = [0, 1, 2, 3, 4, 5, 6, 7]
    assert torch.allclose(got[1, firsts], exact[1, firsts])
    assert torch.isfinite(got[1]).sum() == 8
    assert torch.isfinite(got[2]).sum() == 100  # zeros before 100 win every slice


@pytest.mark.gpu
def test_llama3_vocab_on_cuda():
    """The Llama-3-8B head's shape at the decode sizes the rescored head takes."""
    from v1_engine.layers.embedding import RESCORE_CHUNK, RESCORE_TOP

    for rows in (1, 4, 16):
        logits, h, w = case(rows, 128256, 4096, torch.bfloat16, seed=rows)
        check(logits, h, w, RESCORE_CHUNK, RESCORE_TOP)
