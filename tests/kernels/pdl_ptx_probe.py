"""Compiles every PDL kernel for sm_90 (no GPU needed) and prints, as JSON, where its grid
dependency instructions and memory accesses sit in the PTX. Run by test_pdl.py in a fresh
process, since the kernel tests turn on Triton's interpreter for the rest of the session.

Each public launcher is called on small CPU tensors with PDL forced on; the kernel's `run` is
replaced by a recorder, so nothing launches: the recorded arguments become the kernel's signature
and constexprs, compiled with an explicit sm_90 target.
"""

from __future__ import annotations

import json
import os
import re
import sys
from types import ModuleType

os.environ.pop("TRITON_INTERPRET", None)

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from v1_engine import kernels
from v1_engine.kernels import (
    pdl,
    triton_attention,
    triton_cache,
    triton_fused,
    triton_fused_quant,
    triton_gemv,
    triton_gemv_fp8,
    triton_gemv_fp8_decode,
    triton_mla,
    triton_moe,
    triton_quant,
    triton_rope,
)

_TYPES = {
    torch.bfloat16: "*bf16",
    torch.float16: "*fp16",
    torch.float32: "*fp32",
    torch.int32: "*i32",
    torch.int64: "*i64",
    torch.float8_e4m3fn: "*fp8e4nv",
}
_LAUNCH_OPTIONS = ("num_warps", "num_stages", "launch_pdl")
_MEMORY_OP = re.compile(
    r"\b(ld\.global|ld\.volatile\.global|st\.global|atom\.|red\.global|cp\.async\.)"
)
_LOAD = re.compile(r"\bld\.(volatile\.)?global")

recorded: dict[str, tuple[triton.JITFunction, tuple, dict]] = {}


def _recorder(kernel: triton.JITFunction):
    def run(*args, grid, warmup, **kwargs):
        recorded[kernel.fn.__name__] = (kernel, args, kwargs)

    return run


def _signature(kernel: triton.JITFunction, args: tuple, kwargs: dict) -> tuple[dict, dict]:
    bound = dict(zip(kernel.arg_names, args)) | kwargs
    signature, constexprs = {}, {}
    for param in kernel.params:
        value = bound[param.name]
        if param.is_constexpr:
            signature[param.name] = "constexpr"
            constexprs[param.name] = value
        elif isinstance(value, torch.Tensor):
            signature[param.name] = _TYPES[value.dtype]
        elif isinstance(value, bool):
            signature[param.name] = "i1"
        elif isinstance(value, int):
            signature[param.name] = "i32" if -(2**31) <= value < 2**31 else "i64"
        else:
            signature[param.name] = "fp32"
    return signature, constexprs


def _positions(ptx: str) -> dict:
    lines = [line.strip() for line in ptx.splitlines()]

    def first(pattern: str) -> int:
        return next((i for i, line in enumerate(lines) if pattern in line), -1)

    memory = [i for i, line in enumerate(lines) if _MEMORY_OP.search(line)]
    wait = first("griddepcontrol.wait")
    before = [lines[i] for i in memory if i < wait]
    releases = [i for i, line in enumerate(lines) if "griddepcontrol.launch_dependents" in line]
    return {
        "launch_dependents": first("griddepcontrol.launch_dependents"),
        "last_launch_dependents": releases[-1] if releases else -1,
        "releases": len(releases),
        "wait": wait,
        "first_memory_op": memory[0] if memory else -1,
        "first_memory_op_after_wait": next((i for i in memory if i > wait), -1),
        "memory_ops": len(memory),
        "loads_before_wait": sum(1 for line in before if _LOAD.search(line)),
        "others_before_wait": sum(1 for line in before if not _LOAD.search(line)),
    }


def _launch_all() -> None:
    bf16, dev = torch.bfloat16, torch.device("cpu")
    x = torch.randn(2, 256, dtype=bf16, device=dev)
    w = torch.randn(128, 256, dtype=bf16, device=dev)
    triton_gemv.skinny_gemm(x, w)
    triton_fused.add_rms_norm(x, x.clone(), torch.ones(256, dtype=bf16), 1e-6)
    triton_fused.silu_and_mul(x)
    triton_fused_quant.rms_norm_quant(x, x.clone(), torch.ones(256, dtype=bf16), 1e-6, 128)
    triton_fused_quant.silu_and_mul_quant(x, 128)
    triton_quant.per_token_group_quant(x, 128)
    triton_quant.static_quant(x, torch.ones(1))
    a8 = x.to(torch.float8_e4m3fn)
    b8 = w.to(torch.float8_e4m3fn)
    triton_gemv_fp8.fp8_skinny_gemm(a8, b8, torch.ones(2, 1), torch.ones(128, 1), bf16)
    triton_gemv_fp8.fp8_block_skinny_gemm(a8, b8, torch.ones(2, 2), torch.ones(1, 2), bf16)
    triton_gemv_fp8_decode.fp8_gated_gemm(a8, b8, torch.ones(2, 1), torch.ones(128, 1), bf16)
    q = torch.randn(3, 4, 64, dtype=bf16)
    k = torch.randn(3, 2, 64, dtype=bf16)
    cos_sin = torch.randn(16, 32, dtype=torch.float32)
    triton_rope.rotary_embedding(
        torch.arange(3, dtype=torch.int64), q, k, cos_sin, cos_sin.clone(), True
    )
    kv_cache = torch.zeros(2, 4, 16, 2, 64, dtype=bf16)
    seq_lens = torch.tensor([40], dtype=torch.int32)
    # Split twice: merged by `_merge_splits_kernel`, then in the launch (the kernel checked).
    for fused in (0, 1):
        triton_attention.paged_attention(
            q[:1],
            kv_cache,
            torch.tensor([[0, 1, 2]], dtype=torch.int32),
            seq_lens,
            torch.tensor([0, 1], dtype=torch.int32),
            1,
            40,
            0.125,
            torch.empty_like(q[:1]),
            num_splits=2,
            launch={"fused_merge": fused},
        )
    heads, rank, rope = 16, 64, 16
    latent_cache = torch.zeros(4, 16, rank + rope, dtype=bf16)
    triton_cache.write_latent_cache(
        torch.randn(2, rank, dtype=bf16),
        torch.randn(2, rope, dtype=bf16),
        latent_cache,
        torch.arange(2, dtype=torch.int64),
    )
    triton_mla.mla_decode(
        torch.randn(2, heads, rank, dtype=bf16),
        torch.randn(2, heads, rope, dtype=bf16),
        latent_cache,
        torch.tensor([[0, 1], [2, 3]], dtype=torch.int32),
        torch.tensor([20, 30], dtype=torch.int32),
        torch.tensor([0, 1, 2], dtype=torch.int32),
        30,
        0.1,
        torch.empty(2, heads, rank, dtype=bf16),
        num_splits=2,
    )
    experts, hidden, inter = 4, 128, 128
    triton_moe.fused_moe_triton(
        torch.randn(3, hidden, dtype=bf16),
        torch.randn(experts, 2 * inter, hidden, dtype=bf16),
        torch.randn(experts, hidden, inter, dtype=bf16),
        torch.rand(3, 2),
        torch.tensor([[0, 1], [2, 3], [1, 2]], dtype=torch.int32),
    )
    fp8_cache = torch.zeros(2, 4, 16, 2, 64, dtype=torch.float8_e4m3fn)
    triton_cache.quantize_and_cache(
        k, k.clone(), fp8_cache, torch.arange(3, dtype=torch.int64), torch.ones(1), torch.ones(1)
    )


def _compile_recorded(name: str) -> tuple:
    """The recorded launch of kernel `name` compiled for sm_90, and its constexprs."""
    kernel, args, kwargs = recorded[name]
    kwargs = dict(kwargs)
    options = {key: kwargs.pop(key) for key in _LAUNCH_OPTIONS if key in kwargs}
    signature, constexprs = _signature(kernel, args, kwargs)
    compiled = triton.compile(
        ASTSource(fn=kernel, signature=signature, constexprs=constexprs),
        target=GPUTarget("cuda", 90, 32),
        options=options,
    )
    return compiled, constexprs


def main() -> None:
    kernel_modules = [module for module in vars(kernels).values() if isinstance(module, ModuleType)]
    for module in kernel_modules:
        for value in vars(module).values():
            if isinstance(value, triton.JITFunction) and value.fn.__module__ == module.__name__:
                value.run = _recorder(value)
    pdl.use_pdl = lambda device: True
    _launch_all()
    report = {}
    for name in sorted(recorded):
        compiled, constexprs = _compile_recorded(name)
        report[name] = _positions(compiled.asm["ptx"]) | {
            "launch_pdl": bool(compiled.metadata.launch_pdl),
            "pdl_constexpr": bool(constexprs.get("PDL")),
        }
    # The FP8 decode kernel and the bf16 skinny GEMM with their last waves signalling right
    # after the wait, as a GPU launch compiles them (CPU tensors launch them without:
    # early_release_from gives the whole grid there).
    pdl.early_release_from = lambda programs, device, per_sm: 0
    a8 = torch.randn(2, 256).to(torch.float8_e4m3fn)
    b8 = torch.randn(128, 256).to(torch.float8_e4m3fn)
    triton_gemv_fp8_decode.fp8_gated_gemm(
        a8, b8, torch.ones(2, 1), torch.ones(128, 1), torch.bfloat16
    )
    compiled, _ = _compile_recorded("_fp8_decode_kernel")
    report["_fp8_decode_kernel+early"] = _positions(compiled.asm["ptx"])
    triton_gemv.skinny_gemm(torch.randn(2, 256, dtype=torch.bfloat16),
                            torch.randn(64, 256, dtype=torch.bfloat16))  # fmt: skip
    compiled, _ = _compile_recorded("_skinny_gemm_kernel")
    report["_skinny_gemm_kernel+early"] = _positions(compiled.asm["ptx"])
    json.dump(report, sys.stdout)


if __name__ == "__main__":
    main()
