"""Compiles the decode-inputs kernel (kernels/triton_inputs.py) for sm_90 (no GPU needed), with
and without the feed, and prints as JSON its registers and stack bytes. Run by
test_triton_inputs.py in a fresh process (that test turns on Triton's interpreter, which accepts
code the GPU compiler may reject). The launcher runs on CPU tensors with the kernel's `run`
replaced by a recorder (as in pipeline_probe.py)."""

from __future__ import annotations

import json
import os
import sys

os.environ.pop("TRITON_INTERPRET", None)

import pdl_ptx_probe as probe
import torch
from pipeline_probe import compile_recorded, register_usage

from v1_engine.kernels import triton_inputs


def main() -> None:
    kernel = triton_inputs._decode_inputs_kernel
    kernel.run = probe._recorder(kernel)
    rows, width = 4, 160
    src = (
        torch.zeros(rows, dtype=torch.int64),
        torch.zeros(rows, dtype=torch.int64),
        torch.zeros(rows, dtype=torch.int64),
        torch.ones(rows, dtype=torch.int32),
        torch.zeros(rows, width, dtype=torch.int32),
    )
    dst = tuple(t.repeat(2, *[1] * (t.dim() - 1)) for t in src)
    pending = torch.zeros(rows, 2, dtype=torch.int64)[:, 0]
    results = {}
    for name, feed in (("feed", (torch.zeros(rows, dtype=torch.int64), pending)), ("plain", None)):
        triton_inputs.write_decode_inputs(src, dst, 2 * rows, feed)
        compiled, _, _ = compile_recorded("_decode_inputs_kernel")
        probe.recorded.clear()
        registers, stack = register_usage(compiled)
        results[name] = {"registers": registers, "stack": stack}
    json.dump(results, sys.stdout)


if __name__ == "__main__":
    main()
