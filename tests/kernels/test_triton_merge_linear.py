"""kernels/triton_merge_linear.py: decode attention's split-KV merge and the FP8 o_proj in one
launch, against its reference (the merge in float32, the product in float64) and against the
chain it would replace (the merge kernel, then `fp8_weight_only_gemm`). Interpreter cases on
small shapes, `gpu` cases on Llama-3-8B's o_proj (32 heads of 128, 32 pieces, N = 4096).

The bound: the kernel's y is the reference's exact product rounded once to the output dtype,
after float32 sums in another order; one unit in the last place of y's dtype (relative), plus
1e-3 of the output's largest value for the few attention outputs whose rounding a float32
difference in the merge can flip. A wrong head, row, piece or scale is off by y's own size."""

from __future__ import annotations

import pytest
import torch

from v1_engine.kernels import triton_merge_linear as ml
from v1_engine.kernels.semaphores import split_semaphores
from v1_engine.kernels.triton_gemv_fp8 import FP8_DTYPE

ULP = {torch.bfloat16: 2.0**-7, torch.float16: 2.0**-10}


def partials(tokens, heads, splits, pad, seed, device="cpu", empty=()):
    """Pieces as paged attention stores them: normalised outputs, log2-domain maxima, positive
    sums; the (token, head, split) triples in `empty` own no key (zero output, zero sum)."""
    gen = torch.Generator().manual_seed(seed)
    out = torch.randn((tokens, heads, splits, pad), generator=gen)
    m = 3.0 * torch.randn((tokens, heads, splits), generator=gen)
    s = 0.5 + torch.rand((tokens, heads, splits), generator=gen) * 4.0
    for t, h, p in empty:
        out[t, h, p] = 0.0
        m[t, h, p] = -1.0e30
        s[t, h, p] = 0.0
    return out.to(device), m.to(device), s.to(device)


def weight(n, k, seed, device="cpu", per_row=True):
    gen = torch.Generator().manual_seed(seed)
    b = (torch.randn((n, k), generator=gen) * 64.0).clamp(-448, 448).to(FP8_DTYPE)
    scale = (0.5 + torch.rand((n if per_row else 1,), generator=gen)) / 256.0
    return b.to(device), scale.to(device)


def assert_close_to_reference(y, ref):
    ulp = ULP[y.dtype]
    atol = 1e-3 * ref.float().abs().max().item()
    torch.testing.assert_close(y.float(), ref.float(), rtol=ulp, atol=atol)


interpreter_only = pytest.mark.skipif(
    torch.cuda.is_available(), reason="the gpu cases cover this on a CUDA machine"
)


@interpreter_only
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("per_row", [True, False])
def test_matches_reference_interpreted(out_dtype, per_row):
    # 2 tokens, 4 heads of 24 values padded to 32, 5 pieces (two empty), N = 80: three chunks
    # of 32 rows in steps of 16, the last one ragged.
    part_out, part_max, part_sum = partials(2, 4, 5, 32, seed=1, empty=[(0, 1, 4), (1, 3, 0)])
    b, scale = weight(80, 4 * 24, seed=2, per_row=per_row)
    args = (part_out, part_max, part_sum, 24, b, scale, out_dtype)
    y = ml.merge_linear(*args, chunk=32, block_n=16)
    assert y.shape == (2, 80) and y.dtype == out_dtype
    assert_close_to_reference(y, ml.merge_linear_reference(*args))
    # The semaphores are back at zero for the next launch.
    assert not split_semaphores(torch.device("cpu"), 6)[:6].any()


@interpreter_only
def test_matches_the_chain_it_replaces_interpreted():
    """The merge, then the weight-only FP8 GEMM (fp8_dynamic_linear's o_proj)."""
    from v1_engine.kernels.triton_gemv_fp8_decode import fp8_weight_only_gemm

    part_out, part_max, part_sum = partials(1, 4, 3, 32, seed=3)
    b, scale = weight(64, 4 * 32, seed=4)
    y = ml.merge_linear(part_out, part_max, part_sum, 32, b, scale, torch.bfloat16, chunk=32,
                        block_n=16)  # fmt: skip
    # The torch merge: under the interpreter the merge kernel's cast truncates.
    attention = ml.merge_reference(part_out, part_max, part_sum, 32, torch.bfloat16)
    assert_close_to_reference(y, fp8_weight_only_gemm(attention, b, scale))


@interpreter_only
def test_one_piece_and_a_single_chunk_interpreted():
    part_out, part_max, part_sum = partials(1, 2, 1, 16, seed=5)
    b, scale = weight(8, 2 * 16, seed=6)
    args = (part_out, part_max, part_sum, 16, b, scale, torch.bfloat16)
    assert_close_to_reference(ml.merge_linear(*args), ml.merge_linear_reference(*args))


@interpreter_only
def test_every_piece_weighs_interpreted():
    """Dropping a piece (its sum zeroed) changes y: the kernel reads every piece."""
    part_out, part_max, part_sum = partials(1, 2, 4, 16, seed=7)
    b, scale = weight(16, 32, seed=8)
    y = ml.merge_linear(
        part_out, part_max, part_sum, 16, b, scale, torch.float16, chunk=16, block_n=16
    )
    part_sum[0, 1, 3] = 0.0
    dropped = ml.merge_linear(
        part_out, part_max, part_sum, 16, b, scale, torch.float16, chunk=16, block_n=16
    )
    assert (y.float() - dropped.float()).abs().max() > 10 * ULP[torch.float16] * y.abs().max()


def test_bad_arguments_name_the_field():
    part_out, part_max, part_sum = partials(1, 2, 3, 16, seed=9)
    b, scale = weight(8, 32, seed=10)
    good = {"part_max": part_max, "part_sum": part_sum, "head_size": 16, "b": b, "scale_b": scale}
    with pytest.raises(ValueError, match="part_max / part_sum must be"):
        ml.merge_linear_reference(part_out, **{**good, "part_max": part_max[:, :, :2]},
                                  out_dtype=torch.bfloat16)  # fmt: skip
    with pytest.raises(ValueError, match="head_size must be in"):
        ml.merge_linear_reference(part_out, **{**good, "head_size": 17}, out_dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="b must be e4m3"):
        ml.merge_linear_reference(part_out, **{**good, "b": b.float()}, out_dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="scale_b must hold 1 or N = 8"):
        ml.merge_linear_reference(part_out, **{**good, "scale_b": scale[:3]},
                                  out_dtype=torch.bfloat16)  # fmt: skip
    with pytest.raises(ValueError, match="out_dtype must be"):
        ml.merge_linear_reference(part_out, **good, out_dtype=torch.float32)
    with pytest.raises(ValueError, match="unknown merge_linear launch key 'tile'"):
        ml.resolve_launch({"tile": 4})
    with pytest.raises(ValueError, match="chunk must be a power of two, got 96"):
        ml.resolve_launch({"chunk": 96})
    with pytest.raises(ValueError, match="stages must be >= 1, got 0"):
        ml.resolve_launch({"stages": 0})
    with pytest.raises(ValueError, match="block_n .128. must not exceed chunk .64."):
        ml.resolve_launch({"chunk": 64, "block_n": 128})


LLAMA_O_PROJ = (32, 128, 4096)
"""Heads, head size, N: Llama-3-8B's attention output and o_proj."""


@pytest.mark.gpu
@pytest.mark.parametrize("tokens,splits", [(1, 32), (1, 7), (2, 16), (4, 8)])
def test_llama_o_proj_gpu(tokens, splits):
    heads, head_size, n = LLAMA_O_PROJ
    part_out, part_max, part_sum = partials(tokens, heads, splits, head_size, seed=splits,
                                            device="cuda", empty=[(0, 5, splits - 1)])  # fmt: skip
    b, scale = weight(n, heads * head_size, seed=11, device="cuda")
    args = (part_out, part_max, part_sum, head_size, b, scale, torch.bfloat16)
    y = ml.merge_linear(*args)
    assert_close_to_reference(y, ml.merge_linear_reference(*args))


@pytest.mark.gpu
def test_matches_the_chain_and_replays_in_a_cuda_graph_gpu():
    from v1_engine.kernels.triton_gemv_fp8_decode import fp8_weight_only_gemm
    from v1_engine.kernels.triton_split_kv import merge_pieces

    heads, head_size, n = LLAMA_O_PROJ
    part_out, part_max, part_sum = partials(1, heads, 32, head_size, seed=12, device="cuda")
    b, scale = weight(n, heads * head_size, seed=13, device="cuda")
    y = ml.merge_linear(part_out, part_max, part_sum, head_size, b, scale, torch.bfloat16)
    attention = torch.empty((1, heads, head_size), dtype=torch.bfloat16, device="cuda")
    merge_pieces(attention, part_out, part_max, part_sum, 32)
    assert_close_to_reference(y, fp8_weight_only_gemm(attention.reshape(1, -1), b, scale))

    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = ml.merge_linear(part_out, part_max, part_sum, head_size, b, scale, torch.bfloat16)
    for seed in (14, 15):
        fresh = partials(1, heads, 32, head_size, seed=seed, device="cuda")
        for buffer, values in zip((part_out, part_max, part_sum), fresh, strict=True):
            buffer.copy_(values)
        graph.replay()
        expected = ml.merge_linear(part_out, part_max, part_sum, head_size, b, scale,
                                   torch.bfloat16)  # fmt: skip
        torch.cuda.synchronize()
        assert torch.equal(out, expected)  # the head-order sum: the same bits every launch


def test_sm90_build_orders_the_partials_before_the_semaphore(run_compile_probe):
    """Compiled for sm_90 at Llama-3-8B's shape (no GPU needed): one acq_rel add per program
    behind a CTA barrier, the last head reads the partials past L1 and resets the semaphore,
    no spills."""
    usage = run_compile_probe("merge_linear_probe.py")
    assert usage["acq_rel_adds"] == 1 and usage["exchanges"] == 1, usage
    assert usage["barrier_before_atomic"] and usage["reads_past_l1"] >= 1, usage
    assert usage["stack"] == 0 and usage["registers"] <= 128, usage
