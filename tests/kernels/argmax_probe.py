"""Compiles the one-launch row argmax (kernels/triton_argmax.py) for sm_90 (no GPU needed) and
prints, as JSON per input dtype, its registers, spills and how the PTX orders the chunks'
stores before the row's semaphore. Run by test_triton_argmax.py in a fresh process (that test
turns on Triton's interpreter, which accepts code the GPU compiler may reject). The launcher
runs on CPU tensors with the kernel's `run` replaced by a recorder (as in pipeline_probe.py)."""

from __future__ import annotations

import json
import os
import sys

os.environ.pop("TRITON_INTERPRET", None)

import pdl_ptx_probe as probe
import torch
from pipeline_probe import compile_recorded, semaphore_usage

from v1_engine.kernels import triton_argmax


def main() -> None:
    kernel = triton_argmax._row_argmax_kernel
    kernel.run = probe._recorder(kernel)
    results = {}
    for dtype in (torch.float32, torch.bfloat16):
        triton_argmax.row_argmax(torch.zeros(2, 128256, dtype=dtype))
        compiled, _, _ = compile_recorded("_row_argmax_kernel")
        probe.recorded.clear()
        results[str(dtype).removeprefix("torch.")] = semaphore_usage(compiled)
    json.dump(results, sys.stdout)


if __name__ == "__main__":
    main()
