"""The rescored FP8 LM head's second pass (layers/embedding.py, ModelConfig.lm_head_quantization
"fp8_rescored"): each slice of a logits row keeps its approximate (FP8) values except its TOP
largest, which are recomputed against the model-dtype weight rows, in place, in one launch.

A row of V logits is cut into S = cdiv(V, CHUNK) strided slices: slice c holds the tokens c,
c + S, c + 2S, ... (CHUNK of them). Strided, not contiguous: neighbouring token ids are often
near-synonyms (digits, case and space variants) whose logits sit within the FP8 error of each
other, and in one contiguous slice they crowd its top places (on the default model the greedy
token ranked up to 8th in its 1024-token contiguous slice, at most 2nd in its strided one).

Program (row, slice) loads its CHUNK logits, picks the TOP largest one after the other (the
lowest index among equal values first, as a stable descending sort orders them), then computes
their dot products with the row's hidden state together, a [TOP, BLOCK_K] tile of weight rows a
K step, accumulated in float32, and stores them over the approximate values. At batch 1 on the
Llama-3-8B vocabulary that is 126 programs reading 504 weight rows (4 MB) against the 525 MB the
FP8 scoring saves. `rescore_slice_tops_ref` (layers/embedding.py) is the oracle.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from v1_engine.kernels import pdl

_NO_INDEX = tl.constexpr(2**31 - 1)


@triton.jit
def _rescore_kernel(
    logits_ptr,
    hidden_ptr,
    weight_ptr,
    vocab,
    hidden_size,
    stride_logits,
    stride_hidden,
    stride_weight,
    CHUNK: tl.constexpr,
    TOP: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl.pdl_enter(PDL)  # a short kernel: the scoring GEMM before it may still be draining
    row = tl.program_id(0)
    offs = tl.program_id(1) + tl.arange(0, CHUNK) * tl.num_programs(1)
    row_logits = logits_ptr + row.to(tl.int64) * stride_logits
    live = offs < vocab
    values = tl.load(row_logits + offs, mask=live, other=float("-inf")).to(tl.float32)
    picks = tl.arange(0, TOP)
    chosen = tl.full([TOP], _NO_INDEX, tl.int32)
    for t in tl.static_range(TOP):
        best = tl.max(tl.where(live, values, float("-inf")), 0)
        # The lowest live index holding the max (a row of -inf too); none left past the
        # vocabulary: _NO_INDEX, never stored.
        first = tl.min(tl.where(live & (values == best), offs, _NO_INDEX), 0)
        chosen = tl.where(picks == t, first, chosen)
        live = live & (offs != first)
    valid = chosen < vocab
    rows = weight_ptr + chosen.to(tl.int64) * stride_weight
    acc = tl.zeros([TOP, BLOCK_K], dtype=tl.float32)
    for k0 in range(0, hidden_size, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        in_k = ks < hidden_size
        h = tl.load(hidden_ptr + row.to(tl.int64) * stride_hidden + ks, mask=in_k, other=0.0)
        w = tl.load(rows[:, None] + ks[None, :], mask=valid[:, None] & in_k[None, :], other=0.0)
        acc += w.to(tl.float32) * h.to(tl.float32)[None, :]
    exact = tl.sum(acc, 1)
    tl.store(row_logits + chosen, exact.to(logits_ptr.dtype.element_ty), mask=valid)


def rescore_slice_tops(
    logits: torch.Tensor, hidden: torch.Tensor, weight: torch.Tensor, chunk: int, top: int
) -> torch.Tensor:
    """Recompute, in place, the `top` largest values of every slice (cdiv(V, chunk) strided
    slices of `chunk` tokens) of each logits row as hidden @ weight[index] (float32 sums, stored
    in logits' dtype); returns `logits`.
    logits [M, V] and hidden [M, K] with unit column stride, weight [V, K] contiguous rows."""
    m, vocab = logits.shape
    k = hidden.shape[1]
    assert hidden.shape[0] == m and weight.shape == (vocab, k)
    assert logits.stride(1) == 1 and hidden.stride(1) == 1 and weight.stride(1) == 1
    assert vocab < _NO_INDEX.value and top <= chunk and top & (top - 1) == 0
    if m == 0:
        return logits
    _rescore_kernel[(m, triton.cdiv(vocab, chunk))](
        logits,
        hidden,
        weight,
        vocab,
        k,
        logits.stride(0),
        hidden.stride(0),
        weight.stride(0),
        CHUNK=chunk,
        TOP=top,
        BLOCK_K=min(1024, triton.next_power_of_2(k)),
        num_warps=4,
        **pdl.launch_options(logits.device),
    )
    return logits
