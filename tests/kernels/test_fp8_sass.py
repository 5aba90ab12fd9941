"""Every CUTLASS GEMM kernel in the built library carries Hopper tensor-core code: FP8 (QGMMA) in the
FP8 GEMMs, bf16 (HGMMA) in the bf16 stream-K GEMM.

Targeting plain sm_90 instead of sm_90a compiles without complaint but stubs the wgmma bodies
out; this catches that (and any kernel whose mainloop was compiled away). Skipped where the
library was not built, was built without CUTLASS, or no cuobjdump is installed.
"""

from __future__ import annotations

import re
import subprocess

import pytest
from test_kernel_library_build import find_cuobjdump

from v1_engine.kernels import _C

NUM_OUTPUT_DTYPES = 2
NUM_BLOCK_SCALED_CONFIGS = 2


def sass_by_function(cuobjdump: str, library: str) -> dict[str, str]:
    """Function name -> its SASS text, from `cuobjdump -sass`."""
    sass = subprocess.run(
        [cuobjdump, "-sass", library], capture_output=True, text=True, check=True
    ).stdout
    sections = re.split(r"\n\s*Function : (\S+)\n", sass)
    return dict(zip(sections[1::2], sections[2::2]))


# Per-channel configurations that launch another configuration's kernel: 10, 11 and 13 are 8, 9
# and 12 with the stream-K partials added in arrival order, a launch argument
# (csrc/scaled_mm_sm90.cuh).
SAME_KERNEL_CONFIGS = 3


def test_every_cutlass_gemm_kernel_has_qgmma() -> None:
    lib = _C.load_library()
    if lib is None:
        pytest.skip("libv1engine_kernels.so was not built (no nvcc)")
    if not lib.v1e_has_fp8_gemm():
        pytest.skip("the library was built without the CUTLASS headers")
    cuobjdump = find_cuobjdump()
    if cuobjdump is None:
        pytest.skip("no cuobjdump installed")

    functions = sass_by_function(cuobjdump, str(_C.library_path()))
    gemms = {name: body for name, body in functions.items() if "GemmUniversal" in name}
    # The FP8 GEMMs' operands are e4m3; the bf16 GEMM's (csrc/gemm_sm90.cu) are not.
    fp8 = {name: body for name, body in gemms.items() if "float_e4m3_t" in name}
    bf16 = {name: body for name, body in gemms.items() if name not in fp8}
    distinct = lib.v1e_scaled_mm_num_configs() - SAME_KERNEL_CONFIGS
    expected = NUM_OUTPUT_DTYPES * (distinct + NUM_BLOCK_SCALED_CONFIGS)
    assert len(fp8) == expected, sorted(fp8)
    without_qgmma = [name for name, body in fp8.items() if "QGMMA" not in body]
    assert not without_qgmma, without_qgmma
    # The bf16 GEMM: one kernel per tile configuration, each on bf16 wgmma (HGMMA).
    assert len(bf16) == lib.v1e_gemm_num_configs(), sorted(bf16)
    without_hgmma = [name for name, body in bf16.items() if "HGMMA" not in body]
    assert not without_hgmma, without_hgmma


# The GEMV's distinct kernels: (warps, steps in flight) pairs of csrc/fp8_gemv.cu's kConfigs
# (its two persistent configurations reuse the (8, 4) and (16, 2) kernels), per output dtype.
NUM_GEMV_KERNELS_PER_DTYPE = 5


def test_every_fp8_gemv_kernel_has_tensor_core_mma() -> None:
    """csrc/fp8_gemv.cu guards its e4m3 MMA by architecture: a build for an older target would
    compile it away and leave kernels that return zeros. On sm_90 ptxas lowers it to HMMA."""
    lib = _C.load_library()
    if lib is None:
        pytest.skip("libv1engine_kernels.so was not built (no nvcc)")
    cuobjdump = find_cuobjdump()
    if cuobjdump is None:
        pytest.skip("no cuobjdump installed")

    functions = sass_by_function(cuobjdump, str(_C.library_path()))
    gemvs = {name: body for name, body in functions.items() if "fp8_gemv_kernel" in name}
    assert len(gemvs) == NUM_OUTPUT_DTYPES * NUM_GEMV_KERNELS_PER_DTYPE, sorted(gemvs)
    without_mma = [name for name, body in gemvs.items() if "HMMA" not in body]
    assert not without_mma, without_mma
