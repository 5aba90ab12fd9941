"""Programmatic dependent launch (PDL) for the decode-path kernels.

A decode step is hundreds of short kernels in a row; between two of them the GPU drains one grid,
then launches the next. With PDL (Hopper and later) a kernel launched with `launch_pdl=True` may
start while its predecessor still runs: its programs become resident once every program of the
predecessor has signalled (`gdc_launch_dependents`) or exited, and block in `gdc_wait` until the
predecessor has finished and its writes are visible. In a CUDA graph the launch becomes a
programmatic edge, so captured steps keep the overlap: the launch and ramp-up of each kernel hide
behind the tail of the one before.

The contract every kernel here follows:
- wait before touching any memory (loads and stores), unconditionally, before any early return: a
  kernel completes only after its programs pass the wait, so "predecessor complete" stays
  transitive along a chain of PDL kernels. Two exceptions, loads of what no kernel of the step
  writes: paged attention loads the step's paging metadata (written before the forward starts;
  a GEMM in front of it has waited on its own predecessor before letting it launch, so it is
  complete by then), and the one-pass norms load their weight (a parameter) before the wait;
- where to signal: a short kernel (norms, SiLU-and-mul, RoPE, quant, cache writes) signals first
  (`pdl_enter`), a long one (GEMMs, attention) after its main loop (`pdl_wait` ... `pdl_release`;
  the GEMVs' last waves may signal right after their wait: `pdl_release_early`).
  Signalling at the start of a long kernel let the next kernels, and theirs, pile up on the SMs
  for its whole run: measured slower on the H200 (RESULTS.md, "Programmatic dependent launch").

`V1ENGINE_PDL=0` turns it off (every kernel then waits for its predecessor as usual). It is also
off on devices before sm_90, with a Triton that lacks `launch_pdl`, and under the Triton
interpreter (which has no grid dependency control); the kernels take a `PDL` constexpr, so the
interpreter never sees the instructions.
"""

from __future__ import annotations

import os
from functools import lru_cache

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from v1_engine.kernels import interpreting
from v1_engine.kernels.attention_launch import target_programs

PDL_ENABLED = os.environ.get("V1ENGINE_PDL", "1") != "0"
"""V1ENGINE_PDL=0 launches every kernel without programmatic dependent launch."""


@lru_cache(maxsize=16)
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


@lru_cache(maxsize=1)
def _triton_launches_pdl() -> bool:
    """Whether this Triton's CUDA backend has the `launch_pdl` launch option."""
    try:
        from triton.backends.nvidia.compiler import CUDAOptions
    except ImportError:
        return False
    return "launch_pdl" in getattr(CUDAOptions, "__dataclass_fields__", {})


def use_pdl(device: torch.device) -> bool:
    """Whether kernels launched on `device` use PDL: CUDA, sm_90 or later, not interpreted, and
    not turned off by V1ENGINE_PDL=0."""
    if not PDL_ENABLED or device.type != "cuda":
        return False
    if interpreting():
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _capability(index)[0] >= 9 and _triton_launches_pdl()


def launch_options(device: torch.device) -> dict[str, bool]:
    """The kernel's `PDL` constexpr and Triton's `launch_pdl` launch option, for `device`."""
    if not use_pdl(device):
        return {"PDL": False}
    return {"PDL": True, "launch_pdl": True}


@triton.jit
def pdl_enter(PDL: tl.constexpr):
    """A short kernel's prologue: let the next kernel launch, then wait until the previous
    one's writes are visible."""
    if PDL:
        gdc_launch_dependents()
        gdc_wait()


@triton.jit
def pdl_wait(PDL: tl.constexpr):
    """A long kernel's prologue: wait until the previous kernel's writes are visible."""
    if PDL:
        gdc_wait()


@triton.jit
def pdl_release(PDL: tl.constexpr):
    """After a long kernel's main loop: let the next kernel launch for this one's tail."""
    if PDL:
        gdc_launch_dependents()


def early_release_from(programs: int, device: torch.device, per_sm: int) -> int:
    """The first program, in launch order, of a `programs`-program launch that signals the next
    kernel as it starts (`pdl_release_early`): the last `per_sm` programs per SM of the device;
    `programs` (none) when per_sm is 0 or off the GPU."""
    if per_sm <= 0 or device.type != "cuda":
        return programs
    return max(programs - target_programs(device, per_sm=per_sm), 0)


@triton.jit
def pdl_release_early(PDL: tl.constexpr, EARLY_RELEASE: tl.constexpr, program, early_from):
    """Right after a long kernel's wait: with EARLY_RELEASE, programs from `early_from` on (in
    launch order: the last waves) let the next kernel launch now, so its programs take the SMs
    this one's tail frees, and there is no later wave of this one for them to take SMs from.
    Returns whether this program signalled (`pdl_release_unless` after the loop)."""
    if EARLY_RELEASE:
        released = program >= early_from
        if PDL:  # noqa: SIM102 - a constexpr branch around a runtime one
            if released:
                gdc_launch_dependents()
    else:
        released = False
    return released


@triton.jit
def pdl_release_unless(PDL: tl.constexpr, released):
    """`pdl_release` for a program that has not signalled yet (`released` False, see
    `pdl_release_early`): every program signals once."""
    if PDL:  # noqa: SIM102 - a constexpr branch around a runtime one
        if not released:
            gdc_launch_dependents()
