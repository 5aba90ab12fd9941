"""The decode kernels' cached-tile loads are pipelined: compiled for sm_90 (on the CPU, no GPU
needed) at three stages, paged attention gets two K/V buffers and MLA decode two latent buffers,
so a step's loads fly while the previous step computes. With the block-table lookup inside the
step (the K/V loads depending on a load of the same iteration) the pipeliner spent a stage on
that chain and left one buffer: each step waited for its own loads (batch 64 x 4k attention ran
at 75% of HBM that way, 99% with the lookup a step early; benchmarks/RESULTS.md)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def buffers(run_compile_probe) -> dict:
    return run_compile_probe("pipeline_probe.py")


def test_paged_attention_double_buffers_k_and_v(buffers):
    allocs = buffers["_paged_attention_kernel"]["allocs"]
    # The unmasked and the masked loop each have a K [head, tile] and a V [tile, head] buffer.
    assert sorted(allocs) == [[2, 64, 128], [2, 64, 128], [2, 128, 64], [2, 128, 64]], allocs


def test_mla_decode_double_buffers_latents(buffers):
    allocs = buffers["_mla_decode_kernel"]["allocs"]
    # A 32-token step of latents [32, 512] and rope keys [32, 64].
    assert sorted(allocs) == [[2, 32, 64], [2, 32, 512]], allocs
    assert buffers["_mla_decode_kernel"]["shared"] <= 227 * 1024
