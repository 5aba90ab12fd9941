"""Programmatic dependent launch (PDL) for the decode-path Triton kernels.

A decode step is hundreds of short kernels in a row; between two of them the GPU drains one grid,
launches the next and waits for its first loads. With PDL (Hopper and later) a kernel launched
with `launch_pdl=True` may start while its predecessor still runs: its programs become resident as
soon as every program of the predecessor has signalled (`gdc_launch_dependents`), do work that
depends on nothing the predecessor writes, then block in `gdc_wait` until the predecessor has
finished and its writes are visible. In a CUDA graph the launch becomes a programmatic edge, so
captured steps keep the overlap.

The contract every kernel here follows (`pdl_enter`):
- signal dependents first, then wait, both unconditionally and before any early return: a kernel
  completes only after its waiting programs pass the wait, so "predecessor complete" stays
  transitive along a chain of PDL kernels;
- before the wait, touch only memory no earlier kernel of the step writes (weights); never store.
The only pre-wait work is `prefetch_l2`: a weight-streaming kernel asks L2 for the start of its
weight slice, so HBM is busy while the predecessor drains.

`V1ENGINE_PDL=0` turns it off (every kernel then waits for its predecessor as usual). It is also
off on devices before sm_90 and under the Triton interpreter (which has no grid dependency
control); the kernels take a `PDL` constexpr, so the interpreter never sees the instructions.
"""

from __future__ import annotations

import os
from functools import lru_cache

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

PDL_ENABLED = os.environ.get("V1ENGINE_PDL", "1") != "0"
"""V1ENGINE_PDL=0 launches every kernel without programmatic dependent launch."""

PREFETCH_BYTES = 64 * 1024
"""Weight bytes per program a weight-streaming kernel prefetches into L2 before its wait: about
8 MB over a wave of the H200's 132 SMs, two microseconds of HBM time, well within L2 (50 MB)."""

_PREFETCH_BYTES = tl.constexpr(PREFETCH_BYTES)


@lru_cache(maxsize=16)
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def use_pdl(device: torch.device) -> bool:
    """Whether kernels launched on `device` use PDL: CUDA, sm_90 or later, not interpreted, and
    not turned off by V1ENGINE_PDL=0."""
    if not PDL_ENABLED or device.type != "cuda":
        return False
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _capability(index)[0] >= 9


def launch_options(device: torch.device) -> dict[str, bool]:
    """The kernel's `PDL` constexpr and Triton's `launch_pdl` launch option, for `device`."""
    pdl = use_pdl(device)
    if not pdl:
        return {"PDL": False}
    return {"PDL": True, "launch_pdl": True}


@triton.jit
def pdl_enter(PDL: tl.constexpr):
    """Let the next kernel launch, then wait until the previous one's writes are visible."""
    if PDL:
        gdc_launch_dependents()
        gdc_wait()


@triton.jit
def prefetch_l2(ptr, nbytes, PDL: tl.constexpr):
    """Ask L2 for `nbytes` (a multiple of 16, > 0) from the 16-byte aligned `ptr`: one bulk
    prefetch from the program's first thread, nothing waits for it. Only with PDL (sm_90)."""
    if PDL:
        tl.inline_asm_elementwise(
            "{ .reg .pred p; .reg .b32 t; mov.u32 t, %tid.x; setp.eq.u32 p, t, 0; "
            "@p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
            "=r,l,r",
            [ptr, nbytes],
            dtype=tl.int32,
            is_pure=False,
            pack=1,
        )


@triton.jit
def prefetch_rows_l2(base_ptr, row0, rows, row_elems, total_rows, PDL: tl.constexpr):
    """Prefetch up to PREFETCH_BYTES of the contiguous rows [row0, row0 + rows) of a row-major
    matrix at `base_ptr` with `total_rows` rows of `row_elems` elements (rows past the end are
    left out)."""
    if PDL:
        elem_bytes: tl.constexpr = base_ptr.dtype.element_ty.primitive_bitwidth // 8
        last = tl.minimum(row0 + rows, total_rows)
        span = (last - row0).to(tl.int64) * row_elems * elem_bytes
        nbytes = tl.minimum(span, _PREFETCH_BYTES).to(tl.int32) // 16 * 16
        if nbytes > 0:
            start = base_ptr + row0.to(tl.int64) * row_elems
            prefetch_l2(start, nbytes, PDL)
