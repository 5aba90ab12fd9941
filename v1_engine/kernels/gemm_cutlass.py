"""The bf16 stream-K GEMM for decode-sized M (csrc/gemm_sm90.cu) through the C ABI.

At batch 16-128 a Llama projection is a weight-streaming problem, and its speed is whether every
SM pulls weight bytes until the end: with 128-row weight tiles the Llama-3-8B qkv has 48 output
tiles and o_proj 32 for the H200's 132 SMs. The kernel is CUTLASS's cooperative TMA GEMM with a
stream-K scheduler (each CTA the same share of K steps, split tiles meeting in a workspace),
computing the transposed problem so the weight fills the 128-row wgmma tile.

`skinny_linear_cuda` (kernels/skinny_linear_op.py) runs it for the (M bucket, N, K) entries of
GEMM_TUNED, measured faster than the alternatives by `benchmarks/benchmark_gemm_bf16.py`; every
other shape keeps its previous kernel. V1ENGINE_CUTLASS_GEMM=0 turns it off (A/B runs).

The workspace: one zeroed buffer per device, shared by every call on that device's stream, the
FP8 GEMM's stream-K configurations included: its last 1 MiB holds the split tiles' locks, which
every call leaves zero, the rest is scratch for partial sums (csrc/stream_k_sm90.cuh). It grows
outside CUDA graph capture only; graphs keep the buffer they captured alive through
`_WORKSPACES`.
"""

from __future__ import annotations

import ctypes
import functools
import os

import torch

from v1_engine.kernels import _C
from v1_engine.kernels.pdl import use_pdl

ENABLED = os.environ.get("V1ENGINE_CUTLASS_GEMM", "1") != "0"
"""V1ENGINE_CUTLASS_GEMM=0 keeps every shape on its previous kernel (A/B runs)."""

NUM_CONFIGS = 5
"""Tile configurations compiled into the library (csrc/gemm_sm90.h): 0 128x16x128,
1 128x32x128, 2 128x64x64, 3 128x64x128, 4 128x128x64 (weight rows x M rows x K step)."""

CONFIG_ROWS = (16, 32, 64, 64, 128)
"""The M rows each configuration's tile holds; a tile narrower than M loops over M tiles."""

DECOMPOSITIONS = {
    "heuristic": 0,
    "stream_k": 1,
    "split_k": 2,
    "data_parallel": 3,
    "stream_k_unordered": 4,
    "split_k_unordered": 5,
}
"""How the scheduler cuts the problem (v1e_gemm's `decomposition`). Split tiles add their
partials in a fixed order (the same result every run); the `_unordered` variants add them
atomically in arrival order (less waiting; float sums may differ run to run)."""

GEMM_TUNED: dict[tuple[int, int, int], tuple[int, str, int]] = {}
"""(M bucket, N, K) -> (config, decomposition, splits) for the shapes where this kernel beat
the skinny kernel and cuBLAS by 3% (benchmarks/benchmark_gemm_bf16.py). Empty: on the H200
(2026-12-05, Llama-3-8B shapes) the best tile and decomposition ran qkv, o_proj, gate_up and
down at 0.89-0.99x the current kernel at M = 32 and 64 (gate_up at 128: 1.02x), and its one
win (the LM head at M = 64, data parallel, 1.04x) left the batch-64 decode step where it was
(7.04 / 7.05 ms without it, 7.06 / 7.01 with it)."""

M_BUCKETS = (16, 32, 64, 128)
"""The M buckets GEMM_TUNED is keyed by: the smallest bucket >= M."""

_WORKSPACES: dict[int, list[torch.Tensor]] = {}
"""Per device index, every workspace allocated (the last is current; earlier ones stay alive for
graphs that captured them)."""


def m_bucket(m: int) -> int | None:
    """The smallest M_BUCKETS entry >= m, or None above the largest."""
    return next((b for b in M_BUCKETS if m <= b), None)


@functools.cache
def _library() -> ctypes.CDLL | None:
    lib = _C.load_library()
    if lib is None or not lib.v1e_has_fp8_gemm():
        return None
    return lib


@functools.cache
def _sm90(index: int) -> bool:
    return torch.cuda.get_device_capability(index) == (9, 0)


def available(device: torch.device) -> bool:
    """Whether the library holds the kernel and `device` is an sm_90 GPU."""
    if device.type != "cuda" or _library() is None:
        return False
    return _sm90(device.index if device.index is not None else torch.cuda.current_device())


def fits(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Whether the kernel takes these operands: bf16 x [M, K] and weight [N, K] with K
    contiguous and 16-byte aligned rows, N and K multiples of 8, no bias, on an sm_90 GPU."""
    if bias is not None or x.dim() != 2 or weight.dim() != 2:
        return False
    if x.dtype != torch.bfloat16 or weight.dtype != torch.bfloat16:
        return False
    (m, k), n = x.shape, weight.shape[0]
    if m < 1 or n % 8 or k % 8 or weight.shape[1] != k:
        return False
    if x.stride(1) != 1 or weight.stride(1) != 1:
        return False
    if (m > 1 and x.stride(0) % 8) or (n > 1 and weight.stride(0) % 8):
        return False
    if x.data_ptr() % 16 or weight.data_ptr() % 16:
        return False
    return available(x.device)


def prefers(m: int, n: int, k: int) -> bool:
    """True for the shapes GEMM_TUNED holds (unless V1ENGINE_CUTLASS_GEMM=0)."""
    bucket = m_bucket(m)
    return ENABLED and bucket is not None and (bucket, n, k) in GEMM_TUNED


def tuned_launch(m: int, n: int, k: int) -> tuple[int, str, int]:
    """(config, decomposition, splits) of GEMM_TUNED's entry for this shape."""
    return GEMM_TUNED[(m_bucket(m), n, k)]


def check_gemm_status(lib: ctypes.CDLL, code: int, entry_point: str) -> None:
    """Raises RuntimeError with the CUDA code's text and the library's account of which check
    refused the call (an argument check or a CUTLASS can_implement stage), when it failed; the
    FP8 GEMMs' calls (kernels/fp8_cutlass.py) report through it too."""
    if code != 0:
        status = lib.v1e_error_string(code).decode(errors="replace")
        reason = lib.v1e_fp8_gemm_error().decode(errors="replace") or "no reason recorded"
        raise RuntimeError(f"{entry_point} failed with CUDA error {code} ({status}): {reason}")


def _validate(config: int, decomposition: str, splits: int) -> int:
    if not 0 <= config < NUM_CONFIGS:
        raise ValueError(f"config must be in [0, {NUM_CONFIGS}), got {config}")
    if decomposition not in DECOMPOSITIONS:
        raise ValueError(
            f"decomposition must be one of {sorted(DECOMPOSITIONS)}, got {decomposition!r}"
        )
    if decomposition.startswith("split_k") and splits < 1:
        raise ValueError(f"{decomposition} needs splits >= 1, got {splits}")
    return DECOMPOSITIONS[decomposition]


def workspace_bytes(m: int, n: int, k: int, config: int, decomposition: str, splits: int) -> int:
    """Bytes of workspace the kernel needs for this problem on the current device."""
    mode = _validate(config, decomposition, splits)
    return _workspace_bytes(torch.cuda.current_device(), m, n, k, config, mode, splits)


@functools.lru_cache(maxsize=4096)
def _workspace_bytes(
    index: int, m: int, n: int, k: int, config: int, mode: int, splits: int
) -> int:
    """workspace_bytes, cached: the size follows from the shape and the device's SM count, and
    the library computes it with CUTLASS's stream-K heuristics on the host."""
    lib = _library()
    if lib is None:
        raise RuntimeError("the kernel library was built without the CUTLASS GEMMs")
    return query_bytes(lib, "v1e_gemm_workspace_size", m, n, k, config, mode, splits)


def query_bytes(lib: ctypes.CDLL, entry_point: str, *args: int) -> int:
    """Calls a `*_workspace_size` entry point (its sizes, then the int64 it writes) and returns
    the bytes; raises as check_gemm_status does."""
    size = ctypes.c_int64(0)
    check_gemm_status(lib, getattr(lib, entry_point)(*args, ctypes.byref(size)), entry_point)
    return size.value


def device_workspace(device: torch.device, needed: int) -> torch.Tensor | None:
    """The device's zeroed stream-K workspace (shared with the FP8 GEMM's stream-K
    configurations, kernels/fp8_cutlass.py), grown to `needed` bytes (rounded up to 1 MiB) outside
    graph capture; None when no workspace is needed."""
    if needed == 0:
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    buffers = _WORKSPACES.setdefault(index, [])
    if buffers and buffers[-1].numel() >= needed:
        return buffers[-1]
    if torch.cuda.is_current_stream_capturing():
        raise RuntimeError(
            f"the CUTLASS GEMM needs a {needed}-byte workspace on cuda:{index} during CUDA graph "
            "capture, larger than the one allocated; run the same shapes once before capturing"
        )
    size = -(-needed // (1 << 20)) * (1 << 20)
    buffers.append(torch.zeros(size, dtype=torch.uint8, device=torch.device("cuda", index)))
    return buffers[-1]


def gemm(
    x: torch.Tensor,
    weight: torch.Tensor,
    config: int | None = None,
    decomposition: str | None = None,
    splits: int = 1,
) -> torch.Tensor:
    """x [M, K] @ weight[N, K]^T in bf16 (fp32 accumulation); `config` / `decomposition` /
    `splits` override GEMM_TUNED's entry (all three default to it, or to config by M and the
    heuristic decomposition for an untuned shape). The operands must pass `fits`."""
    (m, k), n = x.shape, weight.shape[0]
    if config is None or decomposition is None:
        by_rows = next(i for i, rows in enumerate(CONFIG_ROWS) if rows >= min(m, CONFIG_ROWS[-1]))
        tuned = GEMM_TUNED.get((m_bucket(m), n, k), (by_rows, "heuristic", 1))
        tuned_config, tuned_decomposition, tuned_splits = tuned
        config = tuned_config if config is None else config
        if decomposition is None:
            decomposition, splits = tuned_decomposition, tuned_splits
    mode = _validate(config, decomposition, splits)
    out = x.new_empty((m, n))
    lib = _library()
    with torch.cuda.device(x.device):
        needed = _workspace_bytes(torch.cuda.current_device(), m, n, k, config, mode, splits)
        workspace = device_workspace(x.device, needed)
        code = lib.v1e_gemm(
            out.data_ptr(),
            x.data_ptr(),
            weight.data_ptr(),
            m,
            n,
            k,
            x.stride(0) if m > 1 else k,
            weight.stride(0) if n > 1 else k,
            _C.DTYPE_CODES[x.dtype],
            config,
            mode,
            splits,
            0 if workspace is None else workspace.data_ptr(),
            0 if workspace is None else workspace.numel(),
            int(use_pdl(x.device)),
            torch.cuda.current_stream().cuda_stream,
        )
    check_gemm_status(lib, code, "v1e_gemm")
    return out
