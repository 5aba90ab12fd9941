"""The built kernel library carries Hopper-specific (sm_90a) code and nothing else.

Plain sm_90 would also compile, but silently stubs out wgmma kernel bodies, so the build must
target 90a. Needs cuobjdump: from the CUDA toolkit, the `nvidia-cuda-cuobjdump` wheel, or the one
bundled in the triton wheel; skipped where none is installed or the library was not built.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from v1_engine.kernels import _C


def find_cuobjdump() -> str | None:
    candidates = [shutil.which("cuobjdump")]
    if os.environ.get("CUDA_HOME"):
        candidates.append(str(Path(os.environ["CUDA_HOME"]) / "bin" / "cuobjdump"))
    for package, relative in (("triton", "backends/nvidia/bin"), ("nvidia", "cu13/bin")):
        spec = importlib.util.find_spec(package)
        for location in (spec.submodule_search_locations or []) if spec else []:
            candidates.append(str(Path(location) / relative / "cuobjdump"))
    return next((c for c in candidates if c and Path(c).is_file()), None)


def test_library_holds_only_sm90a_code() -> None:
    if _C.load_library() is None:
        pytest.skip("libv1engine_kernels.so was not built (no nvcc)")
    cuobjdump = find_cuobjdump()
    if cuobjdump is None:
        pytest.skip("no cuobjdump installed")
    library = str(_C.library_path())

    elves = subprocess.run(
        [cuobjdump, "--list-elf", library], capture_output=True, text=True, check=True
    ).stdout.split()
    ptx = subprocess.run(
        [cuobjdump, "--list-ptx", library], capture_output=True, text=True, check=False
    ).stdout

    cubins = [word for word in elves if word.endswith(".cubin")]
    assert cubins, f"no SASS in {library}"
    assert all(name.endswith(".sm_90a.cubin") for name in cubins), cubins
    assert ".ptx" not in ptx  # 90a-real: no PTX to JIT into plain-sm_90 code
