"""Kernels: Triton modules beside their wrappers, and the ctypes binding of the compiled library."""

from __future__ import annotations

import os


def interpreting() -> bool:
    """Whether Triton kernels run under its interpreter (TRITON_INTERPRET=1: CPU tests), where
    launches take no GPU-only options and some dtypes must be upcast."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"
