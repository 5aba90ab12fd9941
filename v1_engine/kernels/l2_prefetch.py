"""Pull the start of a weight into L2 while the GPU runs latency-bound kernels.

A small-batch decode step alternates weight-streaming GEMMs with short kernels (norms, RoPE, the
attention over a short context) that leave HBM nearly idle for a few microseconds each. A
prefetch kernel launched between a GEMM and those short kernels asks the TMA unit to bring the
first bytes of the *next* GEMM's weight into L2 (`cp.async.bulk.prefetch.L2`: asynchronous, no
registers, no completion to wait for). The next GEMM then finds its first tiles in L2, so the
bytes the prefetch moved no longer sit on its critical path.

PDL: the prefetch touches only weights, which no kernel of a step writes, so its prefetches are
issued before the grid-dependency wait (an exception to the contract in pdl.py, for this reason
only). It lets the next kernel launch first, issues its prefetches, then waits for its
predecessor like any other kernel before it exits, which keeps "predecessor complete" transitive
along the chain.

A prefetch is a hint: it changes no value anywhere, only where the next kernel finds its bytes.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from v1_engine.kernels import interpreting
from v1_engine.kernels.pdl import launch_options, pdl_release, pdl_wait

CHUNK_BYTES = 16384
"""Bytes one bulk prefetch asks for (a multiple of 16)."""

CHUNKS_PER_PROGRAM = 32
"""One chunk per lane of the one-warp program."""


@triton.jit
def _l2_prefetch_kernel(
    ptr, nbytes, CHUNK: tl.constexpr, CHUNKS: tl.constexpr, PDL: tl.constexpr
):
    pdl_release(PDL)  # the next kernel may launch at once
    # Weights only: nothing in the step writes them, so no wait is needed before the hints.
    offs = (tl.program_id(0) * CHUNKS + tl.arange(0, CHUNKS)).to(tl.int64) * CHUNK
    size = tl.minimum(nbytes - offs, CHUNK).to(tl.int32)
    addr = ptr + offs
    tl.inline_asm_elementwise(
        "{ .reg .pred p; setp.gt.s32 p, $2, 0; "
        "@p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
        "=r,l,r",
        [addr, size],
        dtype=tl.int32,
        is_pure=False,
        pack=1,
    )
    pdl_wait(PDL)


def prefetch_bytes(weight: torch.Tensor, max_bytes: int) -> int:
    """How many leading bytes of `weight` a prefetch of at most `max_bytes` asks for: whole
    chunks' worth rounded down to 16 bytes, 0 when there is nothing to do."""
    total = weight.numel() * weight.element_size()
    return max(0, min(total, max_bytes)) // 16 * 16


def supported(weight: torch.Tensor) -> bool:
    """Whether the bulk prefetch can run for `weight`: a contiguous CUDA tensor on sm_90 or
    later, 16-byte aligned, outside the Triton interpreter."""
    if weight.device.type != "cuda" or interpreting() or not weight.is_contiguous():
        return False
    index = weight.device.index if weight.device.index is not None else torch.cuda.current_device()
    return torch.cuda.get_device_capability(index)[0] >= 9 and weight.data_ptr() % 16 == 0


def l2_prefetch(weight: torch.Tensor, max_bytes: int) -> None:
    """Ask L2 for the first `max_bytes` (at most the whole tensor) of `weight`; a no-op where
    the bulk prefetch does not exist (CPU, before sm_90, the interpreter)."""
    nbytes = prefetch_bytes(weight, max_bytes)
    if nbytes == 0 or not supported(weight):
        return
    per_program = CHUNK_BYTES * CHUNKS_PER_PROGRAM
    as_bytes = weight.view(-1).view(torch.uint8)
    _l2_prefetch_kernel[(triton.cdiv(nbytes, per_program),)](
        as_bytes,
        nbytes,
        CHUNK=CHUNK_BYTES,
        CHUNKS=CHUNKS_PER_PROGRAM,
        num_warps=1,
        **launch_options(weight.device),
    )
