"""Compiles the paged-attention and MLA decode kernels for sm_90 (no GPU needed) at launches with
three pipeline stages and prints, as JSON, how many buffers Triton's pipeliner gave the cached
tiles each step loads (K/V, latents). Run by test_pipelining.py in a fresh process, since the
kernel tests turn on Triton's interpreter for the rest of the session.

The launchers run on small CPU tensors with their kernels' `run` replaced by pdl_ptx_probe's
recorder; the recorded arguments compile with the 16-byte divisibility a GPU launch would give
them (without it every load is scalar and nothing is pipelined as on the device).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile

os.environ.pop("TRITON_INTERPRET", None)

import pdl_ptx_probe as probe
import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from v1_engine.kernels import triton_attention, triton_mla

# Multi-buffered shared-memory allocations: memdesc<{buffers}x{rows}x{cols}x{type}.
_BUFFERS = re.compile(r"ttg\.local_alloc : \(\) -> !ttg\.memdesc<(\d+)x(\d+)x(\d+)x")


def _attrs(kernel: triton.JITFunction, args: tuple, kwargs: dict) -> dict:
    bound = dict(zip(kernel.arg_names, args)) | kwargs
    attrs = {}
    for i, param in enumerate(kernel.params):
        value = bound[param.name]
        if param.is_constexpr:
            continue
        aligned_tensor = isinstance(value, torch.Tensor) and value.data_ptr() % 16 == 0
        aligned_int = type(value) is int and value % 16 == 0
        if aligned_tensor or aligned_int:
            attrs[(i,)] = [["tt.divisibility", 16]]
    return attrs


def compile_recorded(name: str) -> tuple:
    """(compiled kernel, launch options, constexprs) of the recorded launch of kernel `name`,
    compiled for sm_90 with the launch's divisibility and options (maxnreg included)."""
    kernel, args, kwargs = probe.recorded[name]
    kwargs = dict(kwargs)
    keys = (*probe._LAUNCH_OPTIONS, "maxnreg")
    options = {key: kwargs.pop(key) for key in keys if key in kwargs}
    signature, constexprs = probe._signature(kernel, args, kwargs)
    source = ASTSource(kernel, signature, constexprs, _attrs(kernel, args, kwargs))
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)
    return compiled, options, constexprs


def _buffers(name: str) -> dict:
    compiled, _, _ = compile_recorded(name)
    allocs = [tuple(map(int, m)) for m in _BUFFERS.findall(compiled.asm["ttgir"])]
    return {"allocs": allocs, "shared": compiled.metadata.shared}


def register_usage(compiled) -> tuple[int, int]:
    """(registers a thread, bytes of stack a thread: spills) of a compiled kernel, read from its
    cubin by the cuobjdump Triton ships."""
    tools = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(compiled.asm["cubin"])
        cubin.flush()
        usage = subprocess.run(
            [os.path.join(tools, "cuobjdump"), "-res-usage", cubin.name],
            capture_output=True, text=True, check=True,
        ).stdout  # fmt: skip
    return int(re.search(r"REG:(\d+)", usage).group(1)), int(
        re.search(r"STACK:(\d+)", usage).group(1)
    )


def semaphore_usage(compiled) -> dict:
    """Registers, spills and how a kernel that finishes its work in the program arriving last
    synchronizes, read from its PTX: acq_rel adds and exchanges on the semaphore, whether a CTA
    barrier comes before the first atomic, and the loads that read past L1 (.cg)."""
    ptx = compiled.asm["ptx"]
    atomic = ptx.find("atom.global")
    registers, stack = register_usage(compiled)
    return {
        "registers": registers,
        "stack": stack,
        "acq_rel_adds": len(re.findall(r"atom\.global\.gpu\.acq_rel\.add", ptx)),
        "exchanges": len(re.findall(r"atom\.global\.\S*exch", ptx)),
        "barrier_before_atomic": atomic > 0 and "bar.sync" in ptx[:atomic],
        "reads_past_l1": ptx.count("ld.global.cg"),
    }


def _resources(name: str) -> dict:
    """Registers a thread, shared memory and warps of the recorded launch of `name`."""
    compiled, options, _ = compile_recorded(name)
    return {
        "registers": register_usage(compiled)[0],
        "shared": compiled.metadata.shared,
        "num_warps": options["num_warps"],
        "num_stages": options["num_stages"],
    }


def _attention_inputs(reqs: int, ctx: int) -> tuple:
    """A decode step of paged attention: 32 query / 8 KV heads, head 128, block 16."""
    heads, kv_heads, head, block = 32, 8, 128, 16
    blocks = reqs * ctx // block
    cache = torch.zeros(2, blocks, block, kv_heads, head, dtype=torch.bfloat16)
    table = torch.arange(blocks, dtype=torch.int32).view(reqs, -1)
    query = torch.zeros(reqs, heads, head, dtype=torch.bfloat16)
    return query, cache, table, *_request_tensors(reqs, ctx), 1, ctx, 0.1, torch.zeros_like(query)


def _mla_inputs(reqs: int, ctx: int) -> tuple:
    """A decode step of MLA: 16 heads, latent 512 + rope 64, block 64."""
    heads, rank, rope, block = 16, 512, 64, 64
    blocks = reqs * ctx // block
    latents = torch.zeros(blocks, block, rank + rope, dtype=torch.bfloat16)
    table = torch.arange(blocks, dtype=torch.int32).view(reqs, -1)
    q_nope = torch.zeros(reqs, heads, rank, dtype=torch.bfloat16)
    q_pe = torch.zeros(reqs, heads, rope, dtype=torch.bfloat16)
    out = torch.zeros(reqs, heads, rank, dtype=torch.bfloat16)
    return q_nope, q_pe, latents, table, *_request_tensors(reqs, ctx), ctx, 0.1, out


def _request_tensors(reqs: int, ctx: int) -> tuple[torch.Tensor, torch.Tensor]:
    """seq_lens and query_start_loc of `reqs` one-token decode requests at `ctx` tokens."""
    lens = torch.full((reqs,), ctx, dtype=torch.int32)
    return lens, torch.arange(reqs + 1, dtype=torch.int32)


def main() -> None:
    for module in (triton_attention, triton_mla):
        for value in vars(module).values():
            if isinstance(value, triton.JITFunction) and value.fn.__module__ == module.__name__:
                value.run = probe._recorder(value)
    # Three stages: 4 requests x 1k context; MLA one cache block per 32-token step, transposed.
    triton_attention.paged_attention(*_attention_inputs(4, 1024), launch={"num_stages": 3})
    triton_mla.mla_decode(
        *_mla_inputs(4, 1024), tile=32, num_warps=4, num_stages=3, swap=True, page_tile=True
    )
    names = ("_paged_attention_kernel", "_mla_decode_kernel")
    results = {name: _buffers(name) for name in names}
    # The default launches at batch 64 x 1k (registers, shared memory), and with capped registers.
    attention, mla = _attention_inputs(64, 1024), _mla_inputs(64, 1024)
    for key, cap in (("default_decode_attention", None), ("capped_decode_attention", 64)):
        triton_attention.paged_attention(*attention, launch={"maxnreg": cap} if cap else None)
        results[key] = _resources("_paged_attention_kernel")
    # The decode launch with the rotary embedding and the new K/V write fused in.
    query, cache = attention[0], attention[1]
    reqs, _, head = query.shape
    kv_heads = cache.shape[3]
    kv = torch.zeros(reqs, kv_heads, head, dtype=torch.bfloat16)
    tables = torch.zeros(4096, head // 2, dtype=torch.float32)
    positions = torch.zeros(reqs, dtype=torch.int64)
    rope = (kv, kv, positions, tables, tables, True, positions)
    triton_attention.paged_attention(*attention, rope=rope)
    results["rope_decode_attention"] = _resources("_paged_attention_kernel")
    for key, cap in (("default_mla", None), ("capped_mla", 128)):
        triton_mla.mla_decode(*mla, maxnreg=cap)
        results[key] = _resources("_mla_decode_kernel")
    json.dump(results, sys.stdout)


if __name__ == "__main__":
    main()
