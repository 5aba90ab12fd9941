"""ctypes binding of libv1engine_kernels.so, the compiled CUDA kernels with a plain C ABI.

The library has no libtorch linkage, so it is loaded with ctypes rather than as a Python
extension; `torch.library` custom ops (see cache_ops.py) wrap its entry points. `load_library()`
returns None when no library was built (CPU-only install), so importing this module never fails.
Set V1ENGINE_KERNELS_LIB to a path to load another build.
"""

from __future__ import annotations

import ctypes
import functools
import os
from pathlib import Path

import torch

LIBRARY_FILENAME = "libv1engine_kernels.so"
LIBRARY_ENV_VAR = "V1ENGINE_KERNELS_LIB"
ABI_VERSION = 7
"""Must equal V1E_ABI_VERSION in csrc/v1engine_kernels.h."""

DTYPE_CODES = {torch.float16: 0, torch.bfloat16: 1, torch.float32: 2}
"""torch dtype -> the v1e_dtype code of csrc/v1engine_kernels.h."""

_i64 = ctypes.c_int64
_ptr = ctypes.c_void_p


def library_path() -> Path:
    """Where the library is looked for: $V1ENGINE_KERNELS_LIB, else beside this module."""
    override = os.environ.get(LIBRARY_ENV_VAR)
    if override:
        return Path(override)
    return Path(__file__).resolve().parent / LIBRARY_FILENAME


@functools.cache
def load_library() -> ctypes.CDLL | None:
    """The loaded library with typed entry points, or None if it was not built.

    Loaded once per process. A library that exists but cannot be loaded, or was built for another
    ABI version, raises: silently running without it would hide a broken build.
    """
    path = library_path()
    if not path.is_file():
        if os.environ.get(LIBRARY_ENV_VAR):
            raise FileNotFoundError(f"{LIBRARY_ENV_VAR}={path} does not name a file")
        return None
    lib = ctypes.CDLL(str(path))
    # The version first: a stale build may lack entry points the other declarations name.
    lib.v1e_abi_version.argtypes = []
    lib.v1e_abi_version.restype = ctypes.c_int
    found = lib.v1e_abi_version()
    if found != ABI_VERSION:
        raise RuntimeError(
            f"{path} has C ABI version {found}, this package expects {ABI_VERSION}; rebuild it "
            "(pip install -e .)"
        )
    _declare_signatures(lib)
    return lib


def _declare_signatures(lib: ctypes.CDLL) -> None:
    lib.v1e_error_string.argtypes = [ctypes.c_int]
    lib.v1e_error_string.restype = ctypes.c_char_p
    lib.v1e_reshape_and_cache.argtypes = [
        _ptr,  # key
        _ptr,  # value
        _ptr,  # kv_cache
        _ptr,  # slot_mapping (int64)
        _i64,  # num_tokens
        _i64,  # num_kv_heads
        _i64,  # head_size
        _i64,  # key_row_stride (elements)
        _i64,  # value_row_stride (elements)
        _i64,  # num_blocks
        _i64,  # block_size
        ctypes.c_int,  # dtype code
        ctypes.c_int,  # pdl (programmatic dependent launch)
        _ptr,  # cudaStream_t
    ]
    lib.v1e_reshape_and_cache.restype = ctypes.c_int
    _declare_fp8_gemm_signatures(lib)


def _declare_fp8_gemm_signatures(lib: ctypes.CDLL) -> None:
    lib.v1e_has_fp8_gemm.argtypes = []
    lib.v1e_has_fp8_gemm.restype = ctypes.c_int
    lib.v1e_scaled_mm_num_configs.argtypes = []
    lib.v1e_scaled_mm_num_configs.restype = ctypes.c_int
    lib.v1e_fp8_gemm_error.argtypes = []
    lib.v1e_fp8_gemm_error.restype = ctypes.c_char_p
    # The decode-sized GEMV (csrc/fp8_gemv.cu) takes v1e_scaled_mm's arguments without the
    # workspace (config its own).
    gemm_args = [
        _ptr,  # out [M, N]
        _ptr,  # a [M, K] e4m3
        _ptr,  # b [N, K] e4m3
        _ptr,  # scale_a (fp32)
        _ptr,  # scale_b (fp32)
        _ptr,  # bias or NULL
        _i64,  # m
        _i64,  # n
        _i64,  # k
        _i64,  # lda (elements)
        _i64,  # ldb (elements)
        ctypes.c_int,  # scale_a_per_row
        ctypes.c_int,  # scale_b_per_col
        ctypes.c_int,  # out dtype code
        ctypes.c_int,  # tile configuration id
    ]
    launch_args = [
        ctypes.c_int,  # pdl (programmatic dependent launch)
        _ptr,  # cudaStream_t
    ]
    workspace_args = [
        _ptr,  # workspace (stream-K configurations; zeroed once by its owner) or NULL
        _i64,  # workspace bytes
    ]
    lib.v1e_scaled_mm.argtypes = gemm_args + workspace_args + launch_args
    lib.v1e_scaled_mm.restype = ctypes.c_int
    lib.v1e_scaled_mm_workspace_size.argtypes = [
        _i64,  # m
        _i64,  # n
        _i64,  # k
        ctypes.c_int,  # out dtype code
        ctypes.c_int,  # tile configuration id
        ctypes.POINTER(_i64),  # bytes (out)
    ]
    lib.v1e_scaled_mm_workspace_size.restype = ctypes.c_int
    lib.v1e_fp8_gemv_num_configs.argtypes = []
    lib.v1e_fp8_gemv_num_configs.restype = ctypes.c_int
    lib.v1e_fp8_gemv.argtypes = gemm_args + launch_args
    lib.v1e_fp8_gemv.restype = ctypes.c_int
    lib.v1e_block_scaled_mm.argtypes = [
        _ptr,  # out [M, N]
        _ptr,  # a [M, K] e4m3
        _ptr,  # b [N, K] e4m3
        _ptr,  # scale_a, M-major (fp32)
        _ptr,  # scale_b [ceil(N/128), K/128] (fp32)
        _i64,  # m
        _i64,  # n
        _i64,  # k
        _i64,  # lda (elements)
        _i64,  # ldb (elements)
        _i64,  # ld_scale_a (elements, multiple of 4, >= M rounded up to 4)
        ctypes.c_int,  # out dtype code
        ctypes.c_int,  # pdl (programmatic dependent launch)
        _ptr,  # cudaStream_t
    ]
    lib.v1e_block_scaled_mm.restype = ctypes.c_int
    # The bf16 stream-K GEMM for decode-sized M (csrc/gemm_sm90.cu).
    lib.v1e_gemm_num_configs.argtypes = []
    lib.v1e_gemm_num_configs.restype = ctypes.c_int
    lib.v1e_gemm_workspace_size.argtypes = [
        _i64,  # m
        _i64,  # n
        _i64,  # k
        ctypes.c_int,  # tile configuration id
        ctypes.c_int,  # decomposition (gemm_cutlass.DECOMPOSITIONS)
        ctypes.c_int,  # splits (split-K)
        ctypes.POINTER(_i64),  # bytes (out)
    ]
    lib.v1e_gemm_workspace_size.restype = ctypes.c_int
    lib.v1e_gemm.argtypes = [
        _ptr,  # out [M, N]
        _ptr,  # a [M, K] (the activation)
        _ptr,  # b [N, K] (the weight)
        _i64,  # m
        _i64,  # n
        _i64,  # k
        _i64,  # lda (elements)
        _i64,  # ldb (elements)
        ctypes.c_int,  # dtype code
        ctypes.c_int,  # tile configuration id
        ctypes.c_int,  # decomposition
        ctypes.c_int,  # splits
        _ptr,  # workspace (zeroed once by its owner)
        _i64,  # workspace bytes
        ctypes.c_int,  # pdl (programmatic dependent launch)
        _ptr,  # cudaStream_t
    ]
    lib.v1e_gemm.restype = ctypes.c_int


def check_status(lib: ctypes.CDLL, code: int, entry_point: str) -> None:
    """Raises RuntimeError with the CUDA runtime's message when an entry point failed."""
    if code != 0:
        message = lib.v1e_error_string(code).decode(errors="replace")
        raise RuntimeError(f"{entry_point} failed with CUDA error {code}: {message}")
