"""A decode step's inputs into a captured CUDA graph's buffers in one launch.

Before each replay the decode graph (compile/cuda_graphs.py `DecodeCudaGraphs`) needs the step's
token ids, positions, cache slots, sequence lengths and block-table rows in its persistent
buffers, the previous step's sampled tokens fed in where this step consumes them, and padding
rows (a batch padded up to a captured size) marked as writing no cache (slot -1) and attending
over one position. As tensor ops that is a gather and a scatter for the feed, five copies and up
to two fills: each a separate launch with its own gap on the device, outside the graph. Here
program r writes row r of every buffer.

Values are copied exactly (integers; the block table as int32, the others as the buffers' own
dtypes); block-table entries past the step's width keep what they held, as the kernel reading
them stops at the sequence length.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

TABLE_BLOCK = 128
"""Block-table entries one loop step copies."""


@triton.jit
def _copy_table_row(
    table_ptr, table_stride, out_table_ptr, out_table_stride, r, width, BLOCK: tl.constexpr
):
    """Block-table row r's first `width` entries into the graph's row r."""
    src_row = table_ptr + r.to(tl.int64) * table_stride
    dst_row = out_table_ptr + r.to(tl.int64) * out_table_stride
    for start in range(0, width, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        valid = offs < width
        tl.store(dst_row + offs, tl.load(src_row + offs, mask=valid), mask=valid)


@triton.jit
def _decode_inputs_kernel(
    ids_ptr,
    pos_ptr,
    slot_ptr,
    seq_ptr,
    table_ptr,
    table_stride,
    width,
    feed_ptr,
    pending_ptr,
    pending_stride,
    out_ids_ptr,
    out_pos_ptr,
    out_slot_ptr,
    out_seq_ptr,
    out_table_ptr,
    out_table_stride,
    n,
    HAS_FEED: tl.constexpr,
    BLOCK: tl.constexpr,
):
    r = tl.program_id(0)
    if r < n:
        token = tl.load(ids_ptr + r)
        if HAS_FEED:
            # The previous step's sampled token where this row consumes one (source row >= 0).
            src = tl.load(feed_ptr + r)
            fed = tl.load(pending_ptr + tl.maximum(src, 0) * pending_stride)
            token = tl.where(src >= 0, fed.to(token.dtype), token)
        tl.store(out_ids_ptr + r, token.to(out_ids_ptr.dtype.element_ty))
        tl.store(out_pos_ptr + r, tl.load(pos_ptr + r).to(out_pos_ptr.dtype.element_ty))
        tl.store(out_slot_ptr + r, tl.load(slot_ptr + r).to(out_slot_ptr.dtype.element_ty))
        tl.store(out_seq_ptr + r, tl.load(seq_ptr + r).to(out_seq_ptr.dtype.element_ty))
        _copy_table_row(table_ptr, table_stride, out_table_ptr, out_table_stride, r, width, BLOCK)
    else:  # a padding row of the captured size: no cache write, one position to attend over
        tl.store(out_slot_ptr + r, tl.full([], -1, out_slot_ptr.dtype.element_ty))
        tl.store(out_seq_ptr + r, tl.full([], 1, out_seq_ptr.dtype.element_ty))


def _check_rows(
    name: str, tensor: torch.Tensor, rows: int, device: torch.device, contiguous: bool = True
) -> None:
    if tensor.dim() != 1 or tensor.shape[0] < rows or (contiguous and tensor.stride(0) != 1):
        kind = "a contiguous 1-D" if contiguous else "a 1-D"
        raise ValueError(
            f"{name} must be {kind} tensor of at least {rows} rows, got shape "
            f"{tuple(tensor.shape)} strides {tensor.stride()}"
        )
    if tensor.device != device:
        raise ValueError(f"{name} is on {tensor.device}, the graph's buffers on {device}")
    if tensor.dtype.is_floating_point or tensor.dtype == torch.bool:
        raise ValueError(f"{name} must hold integers, got {tensor.dtype}")


def write_decode_inputs(
    src: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
    dst: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
    size: int,
    feed: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> None:
    """Write a step's (input_ids, positions, slot_mapping, seq_lens, block_table) `src`, n rows,
    into a graph's buffers `dst` (the same five, at least `size` rows; block tables int32 with
    unit column stride, dst at least as wide): rows < n copied, input_ids[r] replaced by
    `feed[1][feed[0][r]]` where feed[0][r] >= 0 (feed[0]: [n] int64 source rows, -1 where the
    row keeps its staged id; feed[1]: the previous step's sampled tokens); rows n..size-1 get
    slot -1 and sequence length 1. ValueError naming the argument that does not fit."""
    ids, positions, slots, seq_lens, table = src
    out_ids, out_pos, out_slots, out_seq, out_table = dst
    n = ids.shape[0]
    device = out_ids.device
    if not n <= size:
        raise ValueError(f"size ({size}) must be at least the step's {n} rows")
    names = ("input_ids", "positions", "slot_mapping", "seq_lens")
    for name, tensor in zip(names, src[:4]):
        _check_rows(name, tensor, n, device)
    for name, tensor in zip(names, dst[:4]):
        _check_rows(f"graph {name}", tensor, size, device)
    for name, t in (("block_table", table), ("graph block_table", out_table)):
        if t.dim() != 2 or t.dtype != torch.int32 or t.stride(1) != 1 or t.device != device:
            raise ValueError(
                f"{name} must be a 2-D int32 tensor with unit column stride on {device}, got "
                f"{tuple(t.shape)} {t.dtype} strides {t.stride()} on {t.device}"
            )
    if table.shape[0] < n or out_table.shape[0] < size or table.shape[1] > out_table.shape[1]:
        raise ValueError(
            f"block_table {tuple(table.shape)} must hold the step's {n} rows and fit the "
            f"graph's {tuple(out_table.shape)} (at least {size} rows)"
        )
    if feed is not None:
        rows, pending = feed
        _check_rows("feed rows", rows, n, device)
        _check_rows("pending tokens", pending, 1, device, contiguous=False)
    if size == 0:
        return
    feed_rows, pending = feed if feed is not None else (ids, ids)  # never read without a feed
    _decode_inputs_kernel[(size,)](
        ids,
        positions,
        slots,
        seq_lens,
        table,
        table.stride(0),
        table.shape[1],
        feed_rows,
        pending,
        pending.stride(0),
        out_ids,
        out_pos,
        out_slots,
        out_seq,
        out_table,
        out_table.stride(0),
        n,
        HAS_FEED=feed is not None,
        BLOCK=TABLE_BLOCK,
        num_warps=1,
    )


# ---- steps of any query length up to a graph's (verify steps of speculative decoding) ------------


@triton.jit
def _varlen_inputs_kernel(
    ids_ptr,
    pos_ptr,
    slot_ptr,
    qsl_ptr,
    seq_ptr,
    table_ptr,
    table_stride,
    width,
    out_ids_ptr,
    out_pos_ptr,
    out_slot_ptr,
    out_qsl_ptr,
    out_seq_ptr,
    out_table_ptr,
    out_table_stride,
    n,
    num_tokens,
    size,
    graph_tokens,
    TOKEN_BLOCK: tl.constexpr,
    BLOCK: tl.constexpr,
):
    r = tl.program_id(0)
    if r < n:  # a request of the step: its metadata row and its query tokens
        start = tl.load(qsl_ptr + r)
        end = tl.load(qsl_ptr + r + 1)
        tl.store(out_qsl_ptr + r, start.to(out_qsl_ptr.dtype.element_ty))
        tl.store(out_seq_ptr + r, tl.load(seq_ptr + r).to(out_seq_ptr.dtype.element_ty))
        _copy_table_row(table_ptr, table_stride, out_table_ptr, out_table_stride, r, width, BLOCK)
        for tok in range(start, end, TOKEN_BLOCK):
            offs = tok + tl.arange(0, TOKEN_BLOCK)
            valid = offs < end
            ids = tl.load(ids_ptr + offs, mask=valid)
            tl.store(out_ids_ptr + offs, ids.to(out_ids_ptr.dtype.element_ty), mask=valid)
            pos = tl.load(pos_ptr + offs, mask=valid)
            tl.store(out_pos_ptr + offs, pos.to(out_pos_ptr.dtype.element_ty), mask=valid)
            slot = tl.load(slot_ptr + offs, mask=valid)
            tl.store(out_slot_ptr + offs, slot.to(out_slot_ptr.dtype.element_ty), mask=valid)
    elif r < size:  # a padding request of the captured size: no query token
        tl.store(out_qsl_ptr + r, tl.full([], num_tokens, out_qsl_ptr.dtype.element_ty))
        tl.store(out_seq_ptr + r, tl.full([], 1, out_seq_ptr.dtype.element_ty))
    else:  # the graph's last request: every padding token, attending over its own positions
        rest = graph_tokens - num_tokens
        tl.store(out_qsl_ptr + r, tl.full([], num_tokens, out_qsl_ptr.dtype.element_ty))
        tl.store(out_qsl_ptr + r + 1, tl.full([], graph_tokens, out_qsl_ptr.dtype.element_ty))
        tl.store(out_seq_ptr + r, tl.maximum(rest, 1).to(out_seq_ptr.dtype.element_ty))
        for tok in range(num_tokens, graph_tokens, TOKEN_BLOCK):
            offs = tok + tl.arange(0, TOKEN_BLOCK)
            valid = offs < graph_tokens
            zero = tl.zeros([TOKEN_BLOCK], dtype=tl.int32)
            tl.store(out_ids_ptr + offs, zero.to(out_ids_ptr.dtype.element_ty), mask=valid)
            tl.store(out_pos_ptr + offs, zero.to(out_pos_ptr.dtype.element_ty), mask=valid)
            tl.store(out_slot_ptr + offs, (zero - 1).to(out_slot_ptr.dtype.element_ty), mask=valid)


def write_varlen_inputs(
    src: tuple[torch.Tensor, ...],
    dst: tuple[torch.Tensor, ...],
    size: int,
    graph_tokens: int,
) -> None:
    """Write a step of n requests and T tokens, `src` = (input_ids [T], positions [T],
    slot_mapping [T], query_start_loc [n + 1], seq_lens [n], block_table [n, w]), into the
    buffers `dst` (the same six) of a graph captured for `size` requests and `graph_tokens`
    tokens, whose metadata covers size + 1 requests:

    - requests 0..n-1 and tokens 0..T-1 are copied (block-table rows up to the step's width;
      entries past it keep what they held, as the kernels reading them stop at the sequence
      length);
    - requests n..size-1 get no query token (their query start is T) and sequence length 1;
    - request `size` owns tokens T..graph_tokens-1, the padding: ids and positions 0, slot -1
      (no cache write), sequence length graph_tokens - T (at least 1), so every token the graph
      computes belongs to a request and its attention output is defined.

    ValueError naming the argument that does not fit."""
    ids, positions, slots, qsl, seq_lens, table = src
    out_ids, out_pos, out_slots, out_qsl, out_seq, out_table = dst
    num_tokens, n = ids.shape[0], seq_lens.shape[0]
    device = out_ids.device
    if not n <= size:
        raise ValueError(f"size ({size}) must be at least the step's {n} requests")
    if not num_tokens <= graph_tokens:
        raise ValueError(f"graph_tokens ({graph_tokens}) must be at least the step's {num_tokens}")
    for name, tensor, rows in (
        ("input_ids", ids, num_tokens),
        ("positions", positions, num_tokens),
        ("slot_mapping", slots, num_tokens),
        ("query_start_loc", qsl, n + 1),
        ("seq_lens", seq_lens, n),
        ("graph input_ids", out_ids, graph_tokens),
        ("graph positions", out_pos, graph_tokens),
        ("graph slot_mapping", out_slots, graph_tokens),
        ("graph query_start_loc", out_qsl, size + 2),
        ("graph seq_lens", out_seq, size + 1),
    ):
        _check_rows(name, tensor, rows, device)
    for name, t in (("block_table", table), ("graph block_table", out_table)):
        if t.dim() != 2 or t.dtype != torch.int32 or t.stride(1) != 1 or t.device != device:
            raise ValueError(
                f"{name} must be a 2-D int32 tensor with unit column stride on {device}, got "
                f"{tuple(t.shape)} {t.dtype} strides {t.stride()} on {t.device}"
            )
    if table.shape[0] < n or out_table.shape[0] < size + 1 or table.shape[1] > out_table.shape[1]:
        raise ValueError(
            f"block_table {tuple(table.shape)} must hold the step's {n} rows and fit the "
            f"graph's {tuple(out_table.shape)} (at least {size + 1} rows)"
        )
    _varlen_inputs_kernel[(size + 1,)](
        ids,
        positions,
        slots,
        qsl,
        seq_lens,
        table,
        table.stride(0),
        table.shape[1],
        out_ids,
        out_pos,
        out_slots,
        out_qsl,
        out_seq,
        out_table,
        out_table.stride(0),
        n,
        num_tokens,
        size,
        graph_tokens,
        TOKEN_BLOCK=16,
        BLOCK=TABLE_BLOCK,
        num_warps=1,
    )
