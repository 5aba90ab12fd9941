"""The decode kernels' cached-tile loads are pipelined: compiled for sm_90 (on the CPU, no GPU
needed) at three stages, paged attention gets two K/V buffers and MLA decode two latent buffers,
so a step's loads fly while the previous step computes. With the block-table lookup inside the
step (the K/V loads depending on a load of the same iteration) the pipeliner spent a stage on
that chain and left one buffer: each step waited for its own loads. At the default 2 stages
attention keeps one buffer either way, and there its speed follows the programs an SM holds, set
by its registers (70.1 vs 88-90 us at batch 64 x 1k for 4 vs 3 programs under the GPU's Triton;
benchmarks/RESULTS.md): the last tests guard that."""

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
    # A 32-token step of latents [32, 512] and rope keys [32, 64], double-buffered in each of
    # the two loops (the unmasked steps, then the masked last one), which share their memory:
    # two [2, 32, 576] bf16 buffers (73.7 KB) plus the queries, not twice that.
    assert sorted(allocs) == [[2, 32, 64]] * 2 + [[2, 32, 512]] * 2, allocs
    assert buffers["_mla_decode_kernel"]["shared"] <= 100 * 1024


def programs_per_sm(registers: int, shared: int, num_warps: int) -> int:
    """Programs of a launch one H200 SM holds at once: 64k registers, allocated per warp in
    steps of 8 a thread, and 228 KiB of shared memory with 1 KiB reserved per program."""
    by_registers = 65536 // (-(-registers // 8) * 8 * 32 * num_warps)
    by_shared = (228 * 1024) // (shared + 1024)
    return min(by_registers, by_shared)


def test_default_decode_attention_fits_five_programs_per_sm(buffers):
    """Each program has one K/V buffer at the default 2 stages and waits on it every step, so
    the programs resident on an SM set the bytes in flight: 53e463f's kernel (88 registers here,
    5 programs) ran batch 64 x 1k at 70.1 us, 30f49eb's (108 registers, 4 programs) at 88.0."""
    usage = buffers["default_decode_attention"]
    assert usage["num_stages"] == 2 and usage["num_warps"] == 4, usage
    assert programs_per_sm(usage["registers"], usage["shared"], usage["num_warps"]) >= 5, usage


def test_rope_decode_attention_fits_five_programs_per_sm(buffers):
    """The decode launch with the rotary embedding and the K/V write fused in keeps the plain
    launch's occupancy: the rotation's values die before the tile loops (its K/V go through
    the cache behind a barrier, not through registers: holding them cost 172 registers and
    55 KB of shared memory, 2 programs an SM)."""
    usage = buffers["rope_decode_attention"]
    assert programs_per_sm(usage["registers"], usage["shared"], usage["num_warps"]) >= 5, usage


def test_attention_launch_caps_registers(buffers):
    """`launch={"maxnreg": 64}` reaches the compiler (the sweep tries capped launches)."""
    assert buffers["capped_decode_attention"]["registers"] <= 64
    assert buffers["default_decode_attention"]["registers"] > 64


def test_mla_launch_caps_registers(buffers):
    """mla_decode's `maxnreg` reaches the compiler (sweep_mla.py times capped launches)."""
    assert buffers["capped_mla"]["registers"] <= 128 < buffers["default_mla"]["registers"]


def test_programs_per_sm_arithmetic():
    assert programs_per_sm(88, 38912, 4) == 5
    assert programs_per_sm(108, 38912, 4) == 4  # 112 a thread after rounding
    assert programs_per_sm(64, 110 * 1024, 4) == 2  # shared memory bound
