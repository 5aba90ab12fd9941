"""Compiles the one-launch row argmax (kernels/triton_argmax.py) for sm_90 (no GPU needed) and
prints, as JSON per input dtype, its registers, spills and how the PTX orders the chunks'
stores before the row's semaphore. Run by test_triton_argmax.py in a fresh process (that test
turns on Triton's interpreter, which accepts code the GPU compiler may reject). The launcher
runs on CPU tensors with the kernel's `run` replaced by a recorder (as in pipeline_probe.py)."""

from __future__ import annotations

import json
import os
import re
import sys

os.environ.pop("TRITON_INTERPRET", None)

import pdl_ptx_probe as probe
import torch
from pipeline_probe import compile_recorded, register_usage

from v1_engine.kernels import triton_argmax


def main() -> None:
    kernel = triton_argmax._row_argmax_kernel
    kernel.run = probe._recorder(kernel)
    results = {}
    for dtype in (torch.float32, torch.bfloat16):
        triton_argmax.row_argmax(torch.zeros(2, 128256, dtype=dtype))
        compiled, _, _ = compile_recorded("_row_argmax_kernel")
        probe.recorded.clear()
        ptx = compiled.asm["ptx"]
        atomic = ptx.find("atom.global")
        registers, stack = register_usage(compiled)
        results[str(dtype).removeprefix("torch.")] = {
            "registers": registers,
            "stack": stack,
            "acq_rel_adds": len(re.findall(r"atom\.global\.gpu\.acq_rel\.add", ptx)),
            "exchanges": len(re.findall(r"atom\.global\.\S*exch", ptx)),
            "barrier_before_atomic": atomic > 0 and "bar.sync" in ptx[:atomic],
            "partials_read_past_l1": ptx.count("ld.global.cg"),
        }
    json.dump(results, sys.stdout)


if __name__ == "__main__":
    main()
