"""Compiles the fused split-KV merge + FP8 o_proj (kernels/triton_merge_linear.py) for sm_90 at
Llama-3-8B's shape (no GPU needed) and prints, as JSON, its registers, spills and how the PTX
orders the head partials' stores before the chunk's semaphore. Run by
test_triton_merge_linear.py in a fresh process (that test turns on Triton's interpreter). The
launcher runs on CPU tensors with the kernel's `run` replaced by a recorder."""

from __future__ import annotations

import json
import os
import sys

os.environ.pop("TRITON_INTERPRET", None)

import pdl_ptx_probe as probe
import torch
from pipeline_probe import compile_recorded, semaphore_usage

from v1_engine.kernels import pdl, triton_merge_linear


def main() -> None:
    kernel = triton_merge_linear._merge_linear_kernel
    kernel.run = probe._recorder(kernel)
    pdl.use_pdl = lambda device: True
    heads, head_size, splits, n = 32, 128, 32, 4096
    triton_merge_linear.merge_linear(
        torch.zeros(1, heads, splits, head_size),
        torch.zeros(1, heads, splits),
        torch.ones(1, heads, splits),
        head_size,
        torch.zeros(n, heads * head_size, dtype=torch.float8_e4m3fn),
        torch.ones(n),
        torch.bfloat16,
    )
    compiled, _, _ = compile_recorded("_merge_linear_kernel")
    json.dump(semaphore_usage(compiled), sys.stdout)


if __name__ == "__main__":
    main()
