"""Build hook: compiles csrc/ through CMake into v1_engine/kernels/libv1engine_kernels.so.

All metadata lives in pyproject.toml; this file only adds the CUDA library. The library is built
when nvcc is found (on PATH or under CUDA_HOME) and V1ENGINE_SKIP_CUDA is not 1; otherwise the
package installs without it and the kernels fall back to their PyTorch implementations on CPU.
CMake objects live in build/cmake/ so rebuilds (including `pip install -e .`) are incremental.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import ClassVar

from setuptools import Extension, setup
from setuptools.command.bdist_wheel import bdist_wheel
from setuptools.command.build import build
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent
LIBRARY_NAME = "libv1engine_kernels"
LIBRARY_MODULE = f"v1_engine.kernels.{LIBRARY_NAME}"


def find_nvcc() -> str | None:
    """The nvcc to build with: PATH first, then $CUDA_HOME/bin."""
    on_path = shutil.which("nvcc")
    if on_path:
        return on_path
    cuda_home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    if cuda_home and (Path(cuda_home) / "bin" / "nvcc").is_file():
        return str(Path(cuda_home) / "bin" / "nvcc")
    return None


def cuda_skip_reason() -> str | None:
    """Why the CUDA library is not built, or None when it is."""
    if os.environ.get("V1ENGINE_SKIP_CUDA", "0") == "1":
        return "V1ENGINE_SKIP_CUDA=1"
    if find_nvcc() is None:
        return "nvcc not found on PATH or under CUDA_HOME"
    return None


def cutlass_include_dirs() -> list[str]:
    """CUTLASS headers from the nvidia-cutlass wheel (a build requirement), or [] if missing.

    The wheel lives in pip's temporary build environment, whose path changes with every build;
    a stable symlink (build/cutlass) keeps the include flags, and so CMake's objects and ccache's
    entries, valid from one build to the next.
    """
    spec = importlib.util.find_spec("cutlass_library")
    if spec is None or spec.origin is None:
        print(
            "v1engine: nvidia-cutlass not installed; building the kernel library without the "
            "CUTLASS FP8 GEMMs (pip install nvidia-cutlass==4.2.0.0)",
            file=sys.stderr,
        )
        return []
    source = Path(spec.origin).parent / "source"
    stable = ROOT / "build" / "cutlass"
    stable.parent.mkdir(parents=True, exist_ok=True)
    if not stable.is_symlink() or stable.resolve() != source.resolve():
        if stable.is_symlink() or stable.exists():
            stable.unlink()
        stable.symlink_to(source, target_is_directory=True)
    dirs = [stable / "include", stable / "tools" / "util" / "include"]
    return [str(d) for d in dirs if d.is_dir()]


class CMakeExtension(Extension):
    """A shared library built by CMakeLists.txt, not a Python extension module."""

    def __init__(self, name: str) -> None:
        super().__init__(name, sources=[])


class CMakeBuild(build_ext):
    """Configures and builds CMakeLists.txt; the library is named like a plain C library."""

    def get_ext_filename(self, fullname: str) -> str:
        parts = fullname.split(".")
        if parts[-1] == LIBRARY_NAME:
            return os.path.join(*parts[:-1], f"{LIBRARY_NAME}.so")
        return super().get_ext_filename(fullname)

    def run(self) -> None:
        reason = cuda_skip_reason()
        if reason is not None:
            print(f"v1engine: skipping the CUDA kernel library ({reason})", file=sys.stderr)
            return
        super().run()

    def build_extension(self, ext: Extension) -> None:
        if not isinstance(ext, CMakeExtension):
            super().build_extension(ext)
            return
        if shutil.which("cmake") is None:
            raise RuntimeError(
                "building the CUDA kernel library needs cmake >= 3.24 on PATH "
                "(`pip install cmake`), or set V1ENGINE_SKIP_CUDA=1 to install without it"
            )
        output = Path(self.get_ext_fullpath(ext.name)).resolve()
        build_dir = ROOT / "build" / "cmake"
        build_dir.mkdir(parents=True, exist_ok=True)
        subprocess.run(self._configure_command(build_dir, output.parent), check=True)
        jobs = os.environ.get("CMAKE_BUILD_PARALLEL_LEVEL") or str(min(os.cpu_count() or 1, 8))
        subprocess.run(["cmake", "--build", str(build_dir), "-j", jobs], check=True)

    def _configure_command(self, build_dir: Path, output_dir: Path) -> list[str]:
        command = [
            "cmake",
            "-S",
            str(ROOT),
            "-B",
            str(build_dir),
            f"-DCMAKE_CUDA_COMPILER={find_nvcc()}",
            f"-DV1E_OUTPUT_DIR={output_dir}",
            f"-DV1E_CUTLASS_INCLUDE_DIRS={';'.join(cutlass_include_dirs())}",
        ]
        if shutil.which("ninja") and not (build_dir / "CMakeCache.txt").exists():
            command += ["-G", "Ninja"]
        return command


class BuildAlwaysRunsBuildExt(build):
    """Runs build_ext even when CUDA is skipped, so the skip is reported in every build."""

    sub_commands: ClassVar = [
        (name, (lambda self: True) if name == "build_ext" else predicate)
        for name, predicate in build.sub_commands
    ]


class PythonAgnosticWheel(bdist_wheel):
    """Tags the wheel py3-none-<platform>: the library uses no Python C API, so one wheel per
    platform serves every Python version (a pure wheel stays py3-none-any)."""

    def get_tag(self) -> tuple[str, str, str]:
        python, abi, platform = super().get_tag()
        if self.root_is_pure:
            return python, abi, platform
        return "py3", "none", platform


def extensions() -> list[Extension]:
    """The CUDA library when it will be built; none otherwise, which makes a pure-Python wheel."""
    return [CMakeExtension(LIBRARY_MODULE)] if cuda_skip_reason() is None else []


setup(
    ext_modules=extensions(),
    cmdclass={
        "bdist_wheel": PythonAgnosticWheel,
        "build": BuildAlwaysRunsBuildExt,
        "build_ext": CMakeBuild,
    },
)
