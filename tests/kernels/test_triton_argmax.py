"""The one-launch row argmax (kernels/triton_argmax.py) equals torch.argmax bit for bit: first
index among equal maxima, NaN the largest, -0.0 equal to +0.0; under the interpreter on CPU,
on the device with CUDA."""

from __future__ import annotations

import pytest
import torch

# On the CPU the kernels run under Triton's interpreter, which tests/conftest.py turns on
# before any kernel module is imported.
triton_argmax = pytest.importorskip("v1_engine.kernels.triton_argmax")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def check(x: torch.Tensor) -> None:
    got = triton_argmax.row_argmax(x)
    assert got.dtype == torch.int64
    assert torch.equal(got.cpu(), x.cpu().float().argmax(dim=-1)), (got, x.float().argmax(-1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("vocab", [1, 5, 2048, 2049, 5000])
def test_random_rows(dtype, vocab):
    gen = torch.Generator().manual_seed(vocab)
    x = (torch.randn(3, vocab, generator=gen) * 4).to(dtype)
    check(x.to(DEVICE))


def test_ties_nan_signed_zero_and_infinities():
    vocab = 3 * triton_argmax.BLOCK + 7  # 4 chunks, the last one partial
    x = torch.full((8, vocab), -5.0)
    x[0, [100, 2500, 6150]] = 7.0  # a tie across chunks: the first index wins
    x[1, [4200, 4300]] = 7.0  # a tie inside one chunk
    x[2, 5000] = float("nan")  # NaN beats +inf before it
    x[2, 10] = float("inf")
    x[3, [3000, 6000]] = float("nan")  # the first NaN
    x[3, 6000] = -float("nan")  # a negative NaN is as large as any NaN
    x[3, 2999] = -float("nan")
    x[4] = -float("inf")  # an all -inf row: index 0 (padding lanes never win)
    x[5] = 0.0
    x[5, 1] = -0.0  # -0.0 equals +0.0: index 0 wins
    x[5, :1] = -0.0
    x[6, -1] = 100.0  # the maximum in the partial last chunk
    x[7, 3 * triton_argmax.BLOCK] = 1e-45  # a denormal beats zeros and negatives
    check(x.to(DEVICE))
    check(x.to(DEVICE).to(torch.bfloat16))


def test_strided_rows_and_repeated_launches():
    # Rows of a wider buffer (a view); the semaphores reset, so launches repeat cleanly.
    gen = torch.Generator().manual_seed(0)
    base = torch.randn(4, 6000, generator=gen).to(DEVICE)
    view = base[:, :5000]
    for _ in range(3):
        check(view)
    assert triton_argmax.split_semaphores(torch.device(DEVICE), 4)[:4].eq(0).all()


def test_bad_input_names_the_problem():
    with pytest.raises(ValueError, match="unit column stride"):
        triton_argmax.row_argmax(torch.zeros(4, 3).t())
    with pytest.raises(ValueError, match="float32, bfloat16 or float16"):
        triton_argmax.row_argmax(torch.zeros(2, 3, dtype=torch.int32))
    with pytest.raises(ValueError, match="no columns"):
        triton_argmax.row_argmax(torch.zeros(2, 0))
    assert triton_argmax.row_argmax(torch.zeros(0, 3, device=DEVICE)).shape == (0,)


def test_sm90_build_orders_chunks_before_the_semaphore(run_compile_probe):
    """Compiled for sm_90 (no GPU needed): one acq_rel add per program behind a CTA barrier, the
    last program reads the chunks' bests past L1 and resets the semaphore, no spills."""
    for dtype, usage in run_compile_probe("argmax_probe.py").items():
        assert usage["acq_rel_adds"] == 1 and usage["exchanges"] == 1, (dtype, usage)
        assert usage["barrier_before_atomic"] and usage["reads_past_l1"] == 2, usage
        assert usage["stack"] == 0 and usage["registers"] <= 64, (dtype, usage)
