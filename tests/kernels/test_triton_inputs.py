"""A decode step's inputs written into a graph's buffers in one launch
(kernels/triton_inputs.py) equal the tensor ops they replace: the feed's gather and scatter, the
five copies and the padding fills; under the interpreter on CPU, on the device with CUDA."""

from __future__ import annotations

import pytest
import torch

# On the CPU the kernels run under Triton's interpreter, which tests/conftest.py turns on
# before any kernel module is imported.
triton_inputs = pytest.importorskip("v1_engine.kernels.triton_inputs")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def random_inputs(rows: int, width: int, seed: int) -> tuple[torch.Tensor, ...]:
    """(input_ids, positions, slot_mapping, seq_lens, block_table) of `rows` random rows: a
    step's inputs, or a graph's buffers holding stale values from earlier steps."""
    g = torch.Generator().manual_seed(seed)
    return tuple(
        t.to(DEVICE)
        for t in (
            torch.randint(0, 50000, (rows,), generator=g),
            torch.randint(0, 8000, (rows,), generator=g),
            torch.randint(0, 100000, (rows,), generator=g),
            torch.randint(1, 8000, (rows,), generator=g, dtype=torch.int32),
            torch.randint(0, 5000, (rows, width), generator=g, dtype=torch.int32),
        )
    )


def expected(src, dst, size, feed):
    """The tensor ops DecodeCudaGraphs.run used: feed scatter, copies, padding fills."""
    ids, positions, slots, seq_lens, table = (t.clone() for t in src)
    out = [t.clone() for t in dst]
    n = ids.shape[0]
    if feed is not None:
        rows, pending = feed
        dst_rows = torch.nonzero(rows >= 0).flatten()
        ids.index_copy_(0, dst_rows, pending.index_select(0, rows[dst_rows]))
    for buffer, value in zip(out[:4], (ids, positions, slots, seq_lens)):
        buffer[:n].copy_(value)
    out[4][:n, : table.shape[1]].copy_(table)
    out[2][n:size].fill_(-1)
    out[3][n:size].fill_(1)
    return out


@pytest.mark.parametrize(
    ("n", "size", "width", "fed"),
    [(1, 1, 3, [0]), (3, 4, 130, [2, -1, 0]), (5, 8, 1, None), (2, 2, 0, [-1, -1])],
)
def test_matches_the_tensor_ops(n, size, width, fed):
    """A width over one loop step (130 > 128), padding rows, rows with and without a feed."""
    dst = random_inputs(8, 132, seed=7)
    src = random_inputs(n, width, seed=n + width)
    feed = None
    if fed is not None:
        # The sampled tokens as a strided view: the kernel reads them through their stride.
        pending = torch.tensor([[11, 0], [22, 0], [33, 0]], device=DEVICE)[:, 0]
        feed = (torch.tensor(fed, device=DEVICE), pending)
    want = expected(src, dst, size, feed)
    triton_inputs.write_decode_inputs(src, dst, size, feed)
    for name, got, ref in zip(("ids", "positions", "slots", "seq_lens", "table"), dst, want):
        assert torch.equal(got, ref), name
    if fed is not None and fed[0] >= 0:
        assert dst[0][0].item() == [11, 22, 33][fed[0]]


def test_bad_input_names_the_problem():
    dst = random_inputs(4, 8, seed=7)
    src = random_inputs(3, 4, seed=1)
    with pytest.raises(ValueError, match="size"):
        triton_inputs.write_decode_inputs(src, dst, 2)
    with pytest.raises(ValueError, match="block_table"):
        triton_inputs.write_decode_inputs((*src[:4], src[4].long()), dst, 4)
    with pytest.raises(ValueError, match="fit the graph"):
        triton_inputs.write_decode_inputs((*src[:4], random_inputs(3, 9, seed=2)[4]), dst, 4)
    with pytest.raises(ValueError, match="positions must hold integers"):
        triton_inputs.write_decode_inputs((src[0], src[1].float(), *src[2:]), dst, 4)
    with pytest.raises(ValueError, match="feed rows"):
        feed = (torch.zeros(2, dtype=torch.int64, device=DEVICE), src[0])
        triton_inputs.write_decode_inputs(src, dst, 4, feed)


def test_sm90_build(run_compile_probe):
    """Compiled for sm_90 (no GPU needed; the interpreter accepts code the GPU compiler may
    not): with and without the feed, a few registers and no spills."""
    for variant, usage in run_compile_probe("inputs_probe.py").items():
        assert usage["stack"] == 0 and 0 < usage["registers"] <= 64, (variant, usage)


def varlen_expected(src, dst, size, graph_tokens):
    """write_varlen_inputs as tensor ops: the step's tokens and requests copied, requests up to
    `size` empty, request `size` owning the padding tokens."""
    ids, positions, slots, qsl, seq_lens, table = src
    out = [t.clone() for t in dst]
    tokens, n = ids.shape[0], seq_lens.shape[0]
    for buffer, value in zip(out[:3], (ids, positions, slots)):
        buffer[:tokens].copy_(value)
    out[0][tokens:graph_tokens] = 0
    out[1][tokens:graph_tokens] = 0
    out[2][tokens:graph_tokens] = -1
    out[3][:n] = qsl[:n].to(out[3].dtype)
    out[3][n : size + 1] = tokens
    out[3][size + 1] = graph_tokens
    out[4][:n] = seq_lens
    out[4][n:size] = 1
    out[4][size] = max(graph_tokens - tokens, 1)
    out[5][:n, : table.shape[1]] = table
    return out


@pytest.mark.parametrize(
    ("query_lens", "size", "q", "width"),
    [
        ([1], 1, 2, 3),  # one decode token in a graph for two
        ([5, 1, 3], 4, 5, 130),  # mixed lengths, an empty padding request, a wide table
        ([4, 4], 2, 4, 1),  # full: the padding request owns no token
        ([2, 1, 1, 2, 2], 8, 2, 7),
        ([17, 3], 2, 20, 2),  # several token blocks a request, 20 padding tokens
    ],
)
def test_varlen_inputs_match_the_tensor_ops(query_lens, size, q, width):
    g = torch.Generator().manual_seed(sum(query_lens) + size)
    n, tokens, graph_tokens = len(query_lens), sum(query_lens), size * q
    qsl = torch.zeros(n + 1, dtype=torch.int32)
    qsl[1:] = torch.tensor(query_lens).cumsum(0)
    src = (
        torch.randint(0, 50000, (tokens,), generator=g),
        torch.randint(0, 8000, (tokens,), generator=g),
        torch.randint(0, 100000, (tokens,), generator=g),
        qsl,
        torch.randint(30, 8000, (n,), generator=g, dtype=torch.int32),
        torch.randint(0, 5000, (n, width), generator=g, dtype=torch.int32),
    )
    # Stale buffers of a graph for 9 requests of up to 20 tokens.
    dst = (
        torch.randint(0, 50000, (180,), generator=g),
        torch.randint(0, 8000, (180,), generator=g),
        torch.randint(0, 100000, (180,), generator=g),
        torch.randint(0, 180, (11,), generator=g, dtype=torch.int32),
        torch.randint(1, 8000, (10,), generator=g, dtype=torch.int32),
        torch.randint(0, 5000, (10, 140), generator=g, dtype=torch.int32),
    )
    src = tuple(t.to(DEVICE) for t in src)
    dst = tuple(t.to(DEVICE) for t in dst)
    want = varlen_expected(src, dst, size, graph_tokens)
    triton_inputs.write_varlen_inputs(src, dst, size, graph_tokens)
    names = ("ids", "positions", "slots", "query_start_loc", "seq_lens", "table")
    for name, got, ref in zip(names, dst, want):
        assert torch.equal(got, ref), name
    # The metadata the graph's attention reads: every graph token belongs to one request.
    starts = dst[3][: size + 2]
    assert starts[0] == 0 and starts[-1] == graph_tokens and bool((starts.diff() >= 0).all())
    assert bool((dst[4][: size + 1] >= starts.diff()).all())  # no request longer than its seq


def test_varlen_bad_input_names_the_problem():
    src = (
        torch.zeros(6, dtype=torch.int64),
        torch.zeros(6, dtype=torch.int64),
        torch.zeros(6, dtype=torch.int64),
        torch.tensor([0, 3, 6], dtype=torch.int32),
        torch.ones(2, dtype=torch.int32),
        torch.zeros((2, 4), dtype=torch.int32),
    )
    dst = (
        torch.zeros(8, dtype=torch.int64),
        torch.zeros(8, dtype=torch.int64),
        torch.zeros(8, dtype=torch.int64),
        torch.zeros(6, dtype=torch.int32),
        torch.zeros(5, dtype=torch.int32),
        torch.zeros((5, 4), dtype=torch.int32),
    )
    src = tuple(t.to(DEVICE) for t in src)
    dst = tuple(t.to(DEVICE) for t in dst)
    with pytest.raises(ValueError, match="size"):
        triton_inputs.write_varlen_inputs(src, dst, 1, 8)
    with pytest.raises(ValueError, match="graph_tokens"):
        triton_inputs.write_varlen_inputs(src, dst, 2, 5)
    with pytest.raises(ValueError, match="graph input_ids"):
        triton_inputs.write_varlen_inputs(src, dst, 4, 9)
    with pytest.raises(ValueError, match="graph query_start_loc"):
        triton_inputs.write_varlen_inputs(src, dst, 5, 8)
    with pytest.raises(ValueError, match="block_table"):
        triton_inputs.write_varlen_inputs((*src[:5], src[5].long()), dst, 2, 8)
