"""CUTLASS FP8 GEMM launches (and the decode-sized FP8 GEMV) through the C ABI of
libv1engine_kernels.so.

The CUDA implementations behind the `scaled_mm` / `block_scaled_mm` custom ops of fp8.py: the
M-bucket tile dispatch table, argument marshalling to `v1e_scaled_mm` / `v1e_block_scaled_mm` /
`v1e_fp8_gemv`, and the library's account of a refused call. Argument validation happens in
fp8.py first.
"""

from __future__ import annotations

import ctypes
import functools
import math
import os

import torch

from v1_engine.kernels import _C
from v1_engine.kernels.gemm_cutlass import check_gemm_status, device_workspace, query_bytes
from v1_engine.kernels.pdl import use_pdl

SCALED_MM_DISPATCH: tuple[tuple[int, int], ...] = (
    (32, 0),
    (64, 1),
    (256, 7),
    (4096, 4),
    (math.inf, 5),
)
"""(largest M, tile configuration id of csrc/scaled_mm_sm90.cuh) for the per-channel GEMM, by
M bucket; small M runs swapped configurations (computes the transposed problem). Set from
`benchmarks/benchmark_fp8_gemm.py --tune` on the H200 (2026-12-02, geometric-mean TFLOP/s over
the Llama-3-8B/70B shapes at M = 1..8192; benchmarks/RESULTS.md "FP8 GEMM tile tuning")."""

SCALED_MM_SHAPE_CONFIGS: dict[tuple[int, int, int], int] = {
    (64, 4096, 4096): 2,
    (64, 28672, 4096): 2,
    (64, 4096, 14336): 2,
    (64, 8192, 8192): 2,
    (64, 57344, 8192): 2,
    (64, 8192, 28672): 2,
    (256, 8192, 8192): 4,
    (256, 57344, 8192): 4,
    (256, 8192, 28672): 4,
    (math.inf, 6144, 4096): 4,
    (math.inf, 4096, 4096): 4,
}
"""(M bucket bound, N, K) -> tile configuration, where one beat the bucket's by more than 5%
(`benchmark_fp8_gemm.py --tune --m 1 16 64`, H200, 2026-12-05: at M = 33..64 config 2 (64 x 64
x 256) runs the 8B o_proj / gate_up / down and the 70B o / gate_up / down at 300 / 455 / 395 /
440 / 503 / 513 TFLOP/s against config 1's 274 / 424 / 370 / 368 / 478 / 441; Llama-3-8B FP8
decode at batch 64 3.718 / 3.741 -> 3.598 / 3.658 ms a step with them, same call; `--tune --m
256`, H200, 2026-12-03: the Llama-3-70B o, gate_up and down
projections at M = 65..256 run config 4 at 1233 / 1325 / 1342 TFLOP/s against config 7's 1148 /
1059 / 1272; `--tune --m 8192`: the Llama-3-8B qkv and o projections above M = 4096 run config
4 at 1434 / 1431 TFLOP/s against config 5's 1177 / 1298, their N being too narrow for config
5's 256-wide tiles to fill the GPU)."""

GEMV_MAX_M = 8
"""Most rows v1e_fp8_gemv takes (the n = 8 of its m16n8k32 MMA, csrc/fp8_gemv.cu)."""

GEMV_ENABLED = os.environ.get("V1ENGINE_FP8_GEMV", "0") == "1"
"""V1ENGINE_FP8_GEMV=1 runs decode-sized per-channel FP8 GEMMs of the GEMV_SHAPE_CONFIGS shapes
on the GEMV kernel; off by default. Alone (a CUDA graph of ten calls) the GEMV beats CUTLASS
on those shapes, but inside the engine's decode graph, with programmatic dependent launch on,
each GEMV call costs about 5 us more than the CUTLASS call it replaces: Llama-3-8B FP8 batch 1
went 2.65 -> 2.97 ms a step with it on qkv and o_proj (2.80-2.83 with either one alone), and
none of the GEMV_PDL_MODE settings closed the gap (2.92-3.02 launched with PDL, 2.80 without),
nor a persistent grid of one block per SM (configs 5 / 6: 2.975).
With PDL off everywhere it does win: 3.001 -> 2.949 ms (benchmarks/RESULTS.md, "FP8 GEMV").
Not found yet: why its early-launched programs cost more than CUTLASS's."""

GEMV_PDL_MODE = {"1": 1, "0": 0, "exit": 2, "start": 3}[
    os.environ.get("V1ENGINE_FP8_GEMV_PDL", "1")
]
"""How the GEMV takes part in programmatic dependent launch where PDL is on (v1e_fp8_gemv's pdl):
1 (default) launched with it, dependents released after the main loop; "exit": launched with
it, dependents released at exit; "start": released as soon as it passes its wait; 0: launched
without it."""

GEMV_SHAPE_CONFIGS: dict[tuple[int, int], int] = {
    (6144, 4096): 3,
    (4096, 4096): 1,
}
"""(N, K) -> launch configuration of csrc/fp8_gemv.cu (warps per block, loads in flight) for
the shapes where the GEMV beat CUTLASS by at least 3% at every M in 1..8 (taken only under
GEMV_ENABLED); other shapes stay on CUTLASS. `python benchmarks/benchmark_fp8_gemv.py` on the
H200 (benchmarks/RESULTS.md, "FP8 GEMV"): Llama-3-8B qkv 9.5-9.9 us against CUTLASS's 10.0-10.2 (config 3), o_proj 6.8-7.3 against
7.5 (config 1). The GEMV loses on the long shapes (gate_up 32.5 vs 30.6, down 18.3 vs 17.5, the
70B o / gate_up / down projections 0.87-0.92x). On sm_90 ptxas lowers the e4m3 MMA to f16
HMMA (the SASS holds HMMA.16816.F32, no QGMMA), unpacking both operands first; that unpacking
is the likely cap near 0.85-0.9 of HBM (not profiled)."""

NUM_GEMV_CONFIGS = 7
"""Launch configurations compiled into the library (ids 0..6; 5 and 6 persistent grids of one
block per SM), see csrc/fp8_gemv.cu."""

NUM_SCALED_MM_CONFIGS = 14
"""Tile configurations compiled into the library (ids 0..13), see csrc/scaled_mm_sm90.cuh."""

STREAM_K_CONFIGS = (8, 9, 10, 11, 12, 13)
"""The configurations with a stream-K scheduler (swapped cooperative tiles 128 x 16 x 128,
128 x 64 x 128 and 128 x 16 x 256; 8 / 9 / 12 add a split tile's partials in a fixed order,
10 / 11 / 13 atomically as they arrive):
they take the device's shared workspace (kernels/gemm_cutlass.device_workspace). Measured
(`benchmark_fp8_gemm.py --tune --m 1 16 64`, H200, 2026-12-05): slower than the data-parallel
swapped tiles at every M (geometric mean at M = 1: 6.0-6.2 TFLOP/s against config 0's 6.9; M =
16: 96-100 against 110; M = 64: 274-354 against config 2's 407), so no table uses them."""


@functools.cache
def _library() -> ctypes.CDLL:
    """The kernel library, checked once per process to hold the FP8 GEMMs."""
    lib = _C.load_library()
    if lib is None:
        raise RuntimeError(
            f"FP8 GEMMs on CUDA need the compiled kernel library, but {_C.library_path()} does "
            f"not exist: build it with `pip install -e .` where nvcc and nvidia-cutlass are "
            f"installed, or point {_C.LIBRARY_ENV_VAR} at a built {_C.LIBRARY_FILENAME}"
        )
    if not lib.v1e_has_fp8_gemm():
        raise RuntimeError(
            f"{_C.library_path()} was built without the CUTLASS FP8 GEMMs (the nvidia-cutlass "
            "headers were missing at build time): `pip install nvidia-cutlass==4.2.0.0` and "
            "rebuild"
        )
    return lib


def scaled_mm_config(m: int, n: int | None = None, k: int | None = None) -> int:
    """The tile configuration id for M rows: the M bucket's, unless SCALED_MM_SHAPE_CONFIGS
    holds the bucket's (N, K)."""
    max_m, config = next((max_m, c) for max_m, c in SCALED_MM_DISPATCH if m <= max_m)
    return SCALED_MM_SHAPE_CONFIGS.get((max_m, n, k), config)


def scaled_mm_cutlass(
    a: torch.Tensor,
    b: torch.Tensor,
    scale_a: torch.Tensor,
    scale_b: torch.Tensor,
    out_dtype: torch.dtype,
    bias: torch.Tensor | None = None,
    config: int | None = None,
) -> torch.Tensor:
    """The CUTLASS per-tensor/per-channel GEMM; `config` overrides the dispatch table (tuning)."""
    m, n, k = a.shape[0], b.shape[0], a.shape[1]
    out = a.new_empty((m, n), dtype=out_dtype)
    if m == 0:
        return out
    if config is None:
        config = scaled_mm_config(m, n, k)
    elif not 0 <= config < NUM_SCALED_MM_CONFIGS:
        raise ValueError(f"config must be in [0, {NUM_SCALED_MM_CONFIGS}), got {config}")
    return _launch_scaled_mm(
        "v1e_scaled_mm", out, a, b, scale_a, scale_b, bias, config, int(use_pdl(out.device))
    )


def _launch_scaled_mm(
    entry_point: str,
    out: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    scale_a: torch.Tensor,
    scale_b: torch.Tensor,
    bias: torch.Tensor | None,
    config: int,
    pdl: int,
) -> torch.Tensor:
    """Calls `v1e_scaled_mm` (with the shared workspace for a stream-K configuration) or
    `v1e_fp8_gemv` (the same arguments without it) into `out`; raises on failure."""
    lib = _library()
    m, n, k = a.shape[0], b.shape[0], a.shape[1]
    scale_a, scale_b = scale_a.contiguous(), scale_b.contiguous()
    with torch.cuda.device(a.device):
        args = [
            out.data_ptr(),
            a.data_ptr(),
            b.data_ptr(),
            scale_a.data_ptr(),
            scale_b.data_ptr(),
            0 if bias is None else bias.contiguous().data_ptr(),
            m,
            n,
            k,
            a.stride(0) if m > 1 else k,
            b.stride(0) if n > 1 else k,
            int(scale_a.numel() != 1),
            int(scale_b.numel() != 1),
            _C.DTYPE_CODES[out.dtype],
            config,
        ]
        if entry_point == "v1e_scaled_mm":  # the GEMV takes no workspace
            workspace = None
            if config in STREAM_K_CONFIGS:
                needed = _workspace_bytes(
                    torch.cuda.current_device(), m, n, k, _C.DTYPE_CODES[out.dtype], config
                )
                workspace = device_workspace(a.device, needed)
            args += [0, 0] if workspace is None else [workspace.data_ptr(), workspace.numel()]
        code = getattr(lib, entry_point)(*args, pdl, torch.cuda.current_stream().cuda_stream)
    check_gemm_status(lib, code, entry_point)
    return out


@functools.lru_cache(maxsize=4096)
def _workspace_bytes(index: int, m: int, n: int, k: int, dtype_code: int, config: int) -> int:
    """Workspace bytes of a stream-K configuration for this problem on device `index` (cached:
    the library computes it with CUTLASS's stream-K heuristics on the host)."""
    return query_bytes(_library(), "v1e_scaled_mm_workspace_size", m, n, k, dtype_code, config)


def fits_gemv(
    a: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype, bias: torch.Tensor | None = None
) -> bool:
    """Whether v1e_fp8_gemv takes these operands: 1..GEMV_MAX_M rows, N a multiple of 16 and K
    of 64, K-contiguous a and b with 16-byte aligned rows, a contiguous [N] bias of out_dtype."""
    m, k = a.shape
    n = b.shape[0]
    if not 1 <= m <= GEMV_MAX_M or n % 16 or k % 64:
        return False
    if a.stride(1) != 1 or b.stride(1) != 1 or (m > 1 and a.stride(0) % 16) or b.stride(0) % 16:
        return False
    if a.data_ptr() % 16 or b.data_ptr() % 16:
        return False
    return bias is None or (bias.shape == (n,) and bias.is_contiguous() and bias.dtype == out_dtype)


def prefers_gemv(m: int, n: int, k: int) -> bool:
    """True where the GEMV runs the per-channel GEMM: under V1ENGINE_FP8_GEMV=1, decode-sized M
    (at most GEMV_MAX_M) on a shape GEMV_SHAPE_CONFIGS holds."""
    return GEMV_ENABLED and 1 <= m <= GEMV_MAX_M and (n, k) in GEMV_SHAPE_CONFIGS


def scaled_mm_gemv(
    a: torch.Tensor,
    b: torch.Tensor,
    scale_a: torch.Tensor,
    scale_b: torch.Tensor,
    out_dtype: torch.dtype,
    bias: torch.Tensor | None = None,
    config: int | None = None,
) -> torch.Tensor:
    """The decode-sized GEMV (csrc/fp8_gemv.cu) for operands `fits_gemv` accepts; `config`
    overrides GEMV_SHAPE_CONFIGS (tuning; config 0 for a shape it does not hold)."""
    m, n, k = a.shape[0], b.shape[0], a.shape[1]
    out = a.new_empty((m, n), dtype=out_dtype)
    if config is None:
        config = GEMV_SHAPE_CONFIGS.get((n, k), 0)
    elif not 0 <= config < NUM_GEMV_CONFIGS:
        raise ValueError(f"config must be in [0, {NUM_GEMV_CONFIGS}), got {config}")
    pdl = GEMV_PDL_MODE if use_pdl(out.device) else 0
    return _launch_scaled_mm("v1e_fp8_gemv", out, a, b, scale_a, scale_b, bias, config, pdl)


def block_scaled_mm_cutlass(
    a: torch.Tensor,
    b: torch.Tensor,
    scale_a: torch.Tensor,
    scale_b: torch.Tensor,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """The CUTLASS blockwise-scaled GEMM (1x128 activation groups, 128x128 weight blocks)."""
    lib = _library()
    m, n, k = a.shape[0], b.shape[0], a.shape[1]
    out = a.new_empty((m, n), dtype=out_dtype)
    if m == 0:
        return out
    scale_a_m_major = _m_major_scales(scale_a)
    scale_b = scale_b.contiguous()
    with torch.cuda.device(a.device):
        code = lib.v1e_block_scaled_mm(
            out.data_ptr(),
            a.data_ptr(),
            b.data_ptr(),
            scale_a_m_major.data_ptr(),
            scale_b.data_ptr(),
            m,
            n,
            k,
            a.stride(0) if m > 1 else k,
            b.stride(0) if n > 1 else k,
            scale_a_m_major.stride(0),
            _C.DTYPE_CODES[out_dtype],
            int(use_pdl(out.device)),
            torch.cuda.current_stream().cuda_stream,
        )
    check_gemm_status(lib, code, "v1e_block_scaled_mm")
    return out


def _m_major_scales(scale_a: torch.Tensor) -> torch.Tensor:
    """scale_a [M, KB] copied to [KB, M padded to 4] (M contiguous): the kernel loads a tile's
    activation scales with TMA, which needs the M extent and the row stride to be multiples of
    16 bytes. The padding rows stay uninitialized: they only scale output rows past M, which the
    kernel never stores."""
    m, k_blocks = scale_a.shape
    padded_m = -(-m // 4) * 4
    out = scale_a.new_empty((k_blocks, padded_m))
    out[:, :m].copy_(scale_a.t())
    return out
