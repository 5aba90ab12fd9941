"""The on-disk compile cache: Inductor's and Triton's artifacts under one key per setup.

The key hashes what decides the compiled code: the model's config, the dtype, the compilation
config, the step's token budget, torch's and triton's versions, and the source of this project
(a change to any model or layer file gives a new key, so a stale artifact is never loaded). A warm
start finds Inductor's compiled pieces (FX-graph and AOTAutograd caches) and the Triton kernels
there and skips their code generation and compilation, and loads the forward Dynamo traced at the
cold start (`forward.aot`, compile/aot.py) instead of tracing it again.

Several engines may start at once with the same key: Inductor and Triton write each artifact to a
temporary file and rename it into place, so a reader sees a whole file or none; the directory is
created with exist_ok. Different keys never share a directory.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
from pathlib import Path
from typing import Any

import torch

logger = logging.getLogger(__name__)

CACHE_ENV_VAR = "V1ENGINE_COMPILE_CACHE"
"""Overrides the cache root; "0" or "off" disables the cache (Inductor's defaults apply)."""

_PACKAGES = ("v1_engine", "compile")


@functools.cache
def source_hash() -> str:
    """sha256 of every .py file of the engine and the compile front-end, in path order."""
    root = Path(__file__).resolve().parent.parent
    digest = hashlib.sha256()
    for package in _PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            digest.update(str(path.relative_to(root)).encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()


def _triton_version() -> str:
    try:
        import triton
    except ImportError:
        return "none"
    return triton.__version__


def cache_key(parts: dict[str, Any]) -> str:
    """A short hex key of `parts` (JSON-serialisable) plus torch/triton versions and the source."""
    payload = {
        "parts": parts,
        "torch": torch.__version__,
        "triton": _triton_version(),
        "source": source_hash(),
    }
    text = json.dumps(payload, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:20]


def cache_root() -> Path | None:
    """$V1ENGINE_COMPILE_CACHE, else <V1ENGINE_CACHE_DIR or ~/.cache/v1engine>/compile."""
    override = os.environ.get(CACHE_ENV_VAR)
    if override is not None and override.strip().lower() in ("0", "off", ""):
        return None
    if override:
        return Path(override)
    base = os.environ.get("V1ENGINE_CACHE_DIR")
    return (Path(base) if base else Path.home() / ".cache" / "v1engine") / "compile"


def use_compile_cache(parts: dict[str, Any]) -> Path | None:
    """Point Inductor and Triton at the cache directory of `parts` and return it (None when the
    cache is off); the log line says whether an earlier start already filled it (warm/cold)."""
    root = cache_root()
    if root is None:
        return None
    directory = root / cache_key(parts)
    warm = (directory / "inductor").is_dir() and any((directory / "inductor").iterdir())
    (directory / "inductor").mkdir(parents=True, exist_ok=True)
    (directory / "triton").mkdir(parents=True, exist_ok=True)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(directory / "inductor")
    os.environ["TRITON_CACHE_DIR"] = str(directory / "triton")
    from torch._inductor import config as inductor_config

    inductor_config.fx_graph_cache = True
    inductor_config.autotune_local_cache = True
    logger.info("compile cache (%s): %s", "warm" if warm else "cold", directory)
    return directory
