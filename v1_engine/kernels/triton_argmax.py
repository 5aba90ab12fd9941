"""Greedy sampling's argmax over long rows (decode logits, [rows, vocab]) in one launch.

torch.argmax reduces each row in a single thread block (27 us for a 128k vocabulary at batch 1
on the H200), and cutting the row into chunks with torch ops costs four launches (max, argmax,
gather, index arithmetic). Here program (row, chunk) reduces BLOCK values of its row, stores the
chunk's best (order key, first index), counts itself in on the row's semaphore
(kernels/semaphores.py), and the row's last program to arrive reduces the chunks' bests and
stores the token, then resets the semaphore.

The result is torch.argmax's, bit for bit: the first index among equal maxima, every NaN
counting as the largest value (the first NaN wins), -0.0 equal to +0.0. Values compare through
an order-preserving int32 key of their float32 value (exact for bf16 / fp16 / fp32 inputs).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from v1_engine.kernels.semaphores import split_semaphores

BLOCK = 2048
"""Values one program reduces (one load of a 128k row splits it over 63 programs)."""
_NO_INDEX = tl.constexpr(2**31 - 1)
_MIN_KEY = tl.constexpr(-(2**31))
"""Below every value's key (-inf's is -2**31 + 2**23 - 1): masked chunk slots never win."""


@triton.jit
def _order_key(values):
    """int32 keys ordered as float32 `values` under torch.argmax's rules: NaN the largest, -0.0
    equal to +0.0. A negative float's magnitude bits are flipped, so larger magnitudes sort
    lower; non-negative floats keep their bits."""
    values = tl.where(values == 0.0, 0.0, values)
    bits = values.to(tl.int32, bitcast=True)
    bits = tl.where(values != values, 0x7FC00000, bits)  # noqa: PLR0124 - NaN test
    return bits ^ ((bits >> 31) & 0x7FFFFFFF)


@triton.jit
def _row_argmax_kernel(
    x_ptr,
    stride_row,
    vocab,
    part_key_ptr,
    part_idx_ptr,
    arrivals_ptr,
    out_ptr,
    num_chunks,
    BLOCK: tl.constexpr,
    CHUNKS_POW2: tl.constexpr,
):
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    offs = chunk * BLOCK + tl.arange(0, BLOCK)
    values = tl.load(
        x_ptr + row.to(tl.int64) * stride_row + offs, mask=offs < vocab, other=float("-inf")
    )
    keys = _order_key(values.to(tl.float32))
    # A padding lane reads -inf: a real -inf before it ties and wins by its lower index.
    best = tl.max(keys, 0)
    first = tl.min(tl.where(keys == best, offs, _NO_INDEX), 0)
    slot = row * num_chunks + chunk
    tl.store(part_key_ptr + slot, best)
    tl.store(part_idx_ptr + slot, first)
    # Every thread's stores before the one atomic, whose release publishes them; its acquire in
    # the last program makes the other chunks' visible there (read past L1: .cg).
    tl.debug_barrier()
    if tl.atomic_add(arrivals_ptr + row, 1, sem="acq_rel") == num_chunks - 1:
        chunks = tl.arange(0, CHUNKS_POW2)
        valid = chunks < num_chunks
        row_slots = part_key_ptr + row * num_chunks + chunks
        chunk_keys = tl.load(row_slots, mask=valid, other=_MIN_KEY, cache_modifier=".cg")
        chunk_firsts = tl.load(
            part_idx_ptr + row * num_chunks + chunks,
            mask=valid,
            other=_NO_INDEX,
            cache_modifier=".cg",
        )
        top = tl.max(chunk_keys, 0)
        token = tl.min(tl.where(chunk_keys == top, chunk_firsts, _NO_INDEX), 0)
        tl.store(out_ptr + row, token.to(tl.int64))
        tl.atomic_xchg(arrivals_ptr + row, 0)


def row_argmax(x: torch.Tensor) -> torch.Tensor:
    """int64 [rows]: torch.argmax(x, dim=-1) of a float [rows, vocab] tensor with unit column
    stride, in one launch. ValueError naming what does not fit otherwise."""
    if x.dim() != 2 or x.stride(1) != 1:
        raise ValueError(f"x must be [rows, vocab] with unit column stride, got {tuple(x.shape)}")
    if x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"x must be float32, bfloat16 or float16, got {x.dtype}")
    rows, vocab = x.shape
    if vocab == 0:
        raise ValueError("x has no columns: argmax of an empty row")
    if vocab >= _NO_INDEX.value:
        raise ValueError(f"vocab {vocab} does not fit int32 indices")
    out = torch.empty(rows, dtype=torch.int64, device=x.device)
    if rows == 0:
        return out
    num_chunks = triton.cdiv(vocab, BLOCK)
    part_key = torch.empty(rows * num_chunks, dtype=torch.int32, device=x.device)
    part_idx = torch.empty_like(part_key)
    arrivals = split_semaphores(x.device, rows)
    _row_argmax_kernel[(rows, num_chunks)](
        x,
        x.stride(0),
        vocab,
        part_key,
        part_idx,
        arrivals,
        out,
        num_chunks,
        BLOCK=BLOCK,
        CHUNKS_POW2=triton.next_power_of_2(num_chunks),
        num_warps=4,
    )
    return out
