"""The persistent fused MLP kernel (kernels/triton_mlp.py) against its float32 reference and the
unfused chain: under the interpreter on CPU (tiny ragged shapes, every body, one launch per
phase), on the device (the Llama-3-8B MLP, the grid barriers, repeated launches, CUDA graphs)."""

from __future__ import annotations

import pytest
import torch

from v1_engine.kernels import semaphores

_CUDA = torch.cuda.is_available()
triton_mlp = pytest.importorskip("v1_engine.kernels.triton_mlp")
interpreter_only = pytest.mark.skipif(_CUDA, reason="the gpu cases cover this on a CUDA machine")


def values(shape, dtype, seed, device="cpu", scale=1.0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=gen) * scale).to(dtype).to(device)


def operands(m, k, i, n, dtype=torch.bfloat16, device="cpu", seed=0):
    x = values((m, k), dtype, seed, device)
    w_gate_up = values((2 * i, k), dtype, seed + 1, device, scale=k**-0.5)
    w_down = values((n, i), dtype, seed + 2, device, scale=i**-0.5)
    residual = values((m, n), dtype, seed + 3, device)
    norm_w = values((n,), dtype, seed + 4, device, scale=0.1) + 1.0
    return x, w_gate_up, w_down, residual, norm_w


def assert_close_to_reference(got, ref, rel=2.0**-6):
    """bf16 results whose float32 accumulations differ in order: within a few bf16 spacings of
    the output's scale (an unfused GEMM of another kernel differs from the reference as much)."""
    for g, r in zip(got, ref, strict=True):
        assert g.shape == r.shape and g.dtype == r.dtype
        scale = r.float().abs().amax().clamp(min=1.0)
        err = (g.float() - r.float()).abs().amax()
        assert err <= rel * scale, f"max error {err} against scale {scale}"


@interpreter_only
@pytest.mark.parametrize("mode1", ["dot", "dot_swap", "fma"])
@pytest.mark.parametrize("m", [1, 3])
@pytest.mark.parametrize("ahead", [0, 1])
def test_phases_match_reference_interpreted(mode1, m, ahead):
    # Ragged N (tiles masked at the edge), K not a multiple of the K step, a 3-way split whose
    # last slice holds fewer h tiles.
    k, i, n = 40, 80, 72
    args = operands(m, k, i, n)
    launch = {"mode1": mode1, "block_n1": 16, "block_k1": 16, "mode2": "dot_swap",
              "block_n2": 32, "block_k2": 16, "split2": 3, "ahead": ahead}  # fmt: skip
    got = triton_mlp.fused_mlp_add_rms_norm(*args, 1e-5, **launch)
    ref = triton_mlp.fused_mlp_reference(*args, 1e-5)
    assert_close_to_reference(got, ref)
    # The residual sum is exact given the down output: equal to bf16(y + residual) of the chain.
    assert torch.isfinite(got[0].float()).all()


@interpreter_only
@pytest.mark.parametrize("m", [1, 2])
def test_fma_bodies_in_both_phases_interpreted(m):
    """The decode-row launches benchmark_fused_mlp.py times at M <= 4: the fma body for the
    gated items and the down partials (the unfused chain's bodies at batch 1)."""
    k, i, n = 48, 96, 40
    args = operands(m, k, i, n, seed=9)
    launch = {"mode1": "fma", "block_n1": 8, "block_k1": 32, "mode2": "fma",
              "block_n2": 8, "block_k2": 32, "split2": 2}  # fmt: skip
    got = triton_mlp.fused_mlp_add_rms_norm(*args, 1e-5, **launch)
    assert_close_to_reference(got, triton_mlp.fused_mlp_reference(*args, 1e-5))


@interpreter_only
def test_dot_phase_two_and_strided_rows_interpreted():
    k, i, n, m = 32, 32, 48, 17
    x, w_gate_up, w_down, residual, norm_w = operands(m, k, i, n, seed=5)
    wide = torch.zeros((m, k + 8), dtype=x.dtype)
    wide[:, 3 : 3 + k] = x
    strided = wide[:, 3 : 3 + k]
    launch = {"mode1": "dot", "block_n1": 16, "block_k1": 16, "mode2": "dot",
              "block_n2": 16, "block_k2": 16, "split2": 1}  # fmt: skip
    got = triton_mlp.fused_mlp_add_rms_norm(strided, w_gate_up, w_down, residual, norm_w, 1e-6,
                                            **launch)  # fmt: skip
    ref = triton_mlp.fused_mlp_reference(x, w_gate_up, w_down, residual, norm_w, 1e-6)
    assert_close_to_reference(got, ref)


def test_launch_keys_are_checked():
    with pytest.raises(ValueError, match="unknown fused MLP launch key 'tile'"):
        triton_mlp.resolve_launch(64, 14336, 4096, 4096, {"tile": 3})
    with pytest.raises(ValueError, match="mode2 must be one of"):
        triton_mlp.resolve_launch(64, 14336, 4096, 4096, {"mode2": "wgmma"})
    with pytest.raises(ValueError, match="block_k1 must be a power of two, got 96"):
        triton_mlp.resolve_launch(64, 14336, 4096, 4096, {"block_k1": 96})
    with pytest.raises(ValueError, match="split2 must be >= 1"):
        triton_mlp.resolve_launch(64, 14336, 4096, 4096, {"split2": 0})
    with pytest.raises(ValueError, match="ahead must be 0 or 1"):
        triton_mlp.resolve_launch(64, 14336, 4096, 4096, {"ahead": 2})
    with pytest.raises(ValueError, match="per_sm must be >= 1"):
        triton_mlp.resolve_launch(64, 14336, 4096, 4096, {"per_sm": 0})
    config = triton_mlp.resolve_launch(64, 14336, 4096, 4096, {"programs": 96})
    assert config["programs"] == 96 and set(config) == set(triton_mlp.LAUNCH_KEYS)


def test_shapes_that_do_not_chain_are_refused():
    x, w_gate_up, w_down, residual, norm_w = operands(2, 16, 16, 24)
    with pytest.raises(ValueError, match="fused MLP shapes do not chain"):
        triton_mlp.fused_mlp_add_rms_norm(x, w_gate_up, w_down[:, :8], residual, norm_w, 1e-5)
    # An h tile straddling two K slices of the down GEMM would be counted in one only.
    args = operands(2, 16, 96, 24)
    with pytest.raises(ValueError, match="block_n1 32 must divide the down GEMM's K slice"):
        triton_mlp.fused_mlp_add_rms_norm(*args, 1e-5, block_n1=32, block_k2=16, split2=2)


def test_every_table_entry_is_a_valid_launch():
    for (m, i, n), launch in triton_mlp.TUNED_LAUNCH.items():
        triton_mlp.resolve_launch(m, i, n, 4096, launch)


# ---- device ----------------------------------------------------------------------------------

LLAMA_MLP = (4096, 14336, 4096)  # K (hidden), I, N (hidden)


def chain(x, w_gate_up, w_down, residual, norm_w, eps):
    """The unfused kernels a decode step runs today."""
    from v1_engine.kernels.skinny_epilogues import silu_mul_linear_cuda
    from v1_engine.kernels.skinny_linear_op import skinny_linear_cuda
    from v1_engine.kernels.triton_fused import add_rms_norm

    h = silu_mul_linear_cuda(x, w_gate_up)
    return add_rms_norm(skinny_linear_cuda(h, w_down), residual, norm_w, eps)


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 8, 33, 64])
def test_llama_mlp_matches_reference_and_chain_gpu(m):
    k, i, n = LLAMA_MLP
    args = operands(m, k, i, n, device="cuda", seed=m)
    got = triton_mlp.fused_mlp_add_rms_norm(*args, 1e-5)
    torch.cuda.synchronize()
    assert_close_to_reference(got, triton_mlp.fused_mlp_reference(*args, 1e-5))
    unfused = chain(*args, 1e-5)
    assert_close_to_reference(got, unfused)
    # The counters are back at zero for the next launch, and a second launch gives the same.
    assert int(semaphores.split_semaphores(args[0].device, 2)[:2].abs().sum()) == 0
    again = triton_mlp.fused_mlp_add_rms_norm(*args, 1e-5)
    assert torch.equal(again[0], got[0]) and torch.equal(again[1], got[1])


@pytest.mark.gpu
@pytest.mark.parametrize(
    "launch",
    [
        {},
        {"mode1": "dot_swap", "block_n1": 64, "programs": 64},
        {"mode2": "dot", "split2": 4, "block_n2": 128, "programs": 0},
        {"block_n1": 16, "stages1": 6, "stages2": 6, "num_warps": 8},
        {"ahead": 1},
        {"ahead": 1, "per_sm": 3, "stages1": 2, "stages2": 2, "num_warps": 8},
    ],
)
def test_launches_agree_gpu(launch):
    k, i, n = LLAMA_MLP
    args = operands(64, k, i, n, device="cuda", seed=3)
    got = triton_mlp.fused_mlp_add_rms_norm(*args, 1e-5, **launch)
    assert_close_to_reference(got, triton_mlp.fused_mlp_reference(*args, 1e-5))


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 3, 4, 16])
@pytest.mark.parametrize("launch", [{}, {"mode1": "dot_swap", "block_n1": 64}])
def test_decode_batch_launches_gpu(m, launch):
    """The launches the engine test (tests/compile/test_mlp_fusion.py) forces at decode sizes,
    alone: the dot_swap gated body with 64-row tiles at M <= 16, rows padded to the dot's 16. If
    these pass while the engine test fails, the bug is in how the engine calls the op."""
    k, i, n = LLAMA_MLP
    args = operands(m, k, i, n, device="cuda", seed=20 + m)
    got = triton_mlp.fused_mlp_add_rms_norm(*args, 1e-5, **launch)
    torch.cuda.synchronize()
    assert_close_to_reference(got, triton_mlp.fused_mlp_reference(*args, 1e-5))
    assert_close_to_reference(got, chain(*args, 1e-5))


@pytest.mark.gpu
def test_cuda_graph_replay_of_chained_layers_gpu():
    # Four layers chained in one graph (each feeds the next, as a decode step does), replayed
    # with new inputs: equal to the eager launches.
    k, i, n = LLAMA_MLP
    m = 48
    layers = [operands(m, k, i, n, device="cuda", seed=10 * j)[1:3] for j in range(4)]
    norm_w = values((n,), torch.bfloat16, 7, "cuda", scale=0.1) + 1.0
    x = values((m, k), torch.bfloat16, 1, "cuda")
    residual = values((m, n), torch.bfloat16, 2, "cuda")

    def forward():
        h, r = x, residual
        for w_gate_up, w_down in layers:
            h, r = triton_mlp.fused_mlp_add_rms_norm(h, w_gate_up, w_down, r, norm_w, 1e-5)
        return h, r

    expected_first = forward()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = forward()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out[0], expected_first[0]) and torch.equal(out[1], expected_first[1])
    x.copy_(values((m, k), torch.bfloat16, 3, "cuda"))
    residual.copy_(values((m, n), torch.bfloat16, 4, "cuda"))
    expected = forward()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out[0], expected[0]) and torch.equal(out[1], expected[1])
    assert not torch.equal(out[0], expected_first[0])
