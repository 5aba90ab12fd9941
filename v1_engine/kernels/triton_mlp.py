"""A decoder layer's MLP and the residual add + RMSNorm after it in one persistent Triton kernel,
for decode-sized batches of an unquantized model:

    h = silu(x @ W_gate^T) * (x @ W_up^T)                     [M, I]
    y = h @ W_down^T                                          [M, N]
    residual_out = y + residual;  normed = norm_w * rmsnorm(residual_out)

Unfused, a decode step runs this as four kernels (the gate_up GEMM, SiLU-and-mul, the down GEMM,
the add + RMSNorm; kernels/triton_gemv.py, triton_fused.py), and each boundary costs a drain of
one grid and the ramp-up of the next. Here one launch does all of it as a queue of work items,
which the programs take in order from a shared counter until none is left:

1. gated column tiles of h (a tile of gate rows and the matching up rows of W_gate_up, as the
   gated skinny GEMM reads them; silu(gate) * up stored); each counts itself in on its K slice's
   counter (the K slices of the down GEMM);
2. (K slice, column tile) float32 partials of h @ W_down^T, slice by slice: each first waits
   until its slice's h tiles are all counted in, then counts itself in when stored;
3. rows: once every partial is in, the partials summed in slice order, then the add + RMSNorm.

An item only waits for items with lower numbers, which programs took before it and are working
on without waiting for anything later, so the queue cannot deadlock whatever the grid's size
and however many of its programs are resident (a grid barrier would need all of them resident).
Programs that finish early take the next item, so no program idles while work is left, and the
down GEMM's first slices start while the last h tiles are still being computed.

The roundings are those of the unfused kernels (the GEMM output in x's dtype, SiLU, product; the
split-K sum in slice order, the sum with the residual, the normalised value, the weight
product), so the fused op agrees with the chain as the chain agrees with the references.

The counters live on the per-device semaphores (kernels/semaphores.py): increments are atomics
after a CTA barrier (release), waits spin on acquire atomics and the data is read past L1; the
last program out resets every counter, so each launch finds them at zero. Under the Triton
interpreter the programs run one after another: the first takes every item in order.

PDL (kernels/pdl.py): the programs wait before touching memory and let the next kernel launch
once they run out of items.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from v1_engine.kernels import interpreting
from v1_engine.kernels.pdl import launch_options, pdl_release, pdl_wait
from v1_engine.kernels.semaphores import split_semaphores
from v1_engine.kernels.skinny_launch import MODES, block_rows, m_bucket
from v1_engine.kernels.triton_fused_quant import _round_to
from v1_engine.kernels.triton_gemv import _MODE_IDS, _accumulate, _silu_mul, _tile_result

FUSED_MLP_ENABLED = os.environ.get("V1ENGINE_FUSED_MLP", "1") != "0"
"""V1ENGINE_FUSED_MLP=0 keeps the MLP on the unfused kernels even where the table has a launch."""

LAUNCH_KEYS = (
    "mode1",
    "block_n1",
    "block_k1",
    "stages1",
    "mode2",
    "block_n2",
    "block_k2",
    "stages2",
    "split2",
    "num_warps",
    "programs",
    "per_sm",
    "ahead",
)
"""A launch: the gated items' body (kernels/triton_gemv.py's modes), tile width (gate rows; as
many up rows), K step and pipeline depth; the down items' body, tile, K step, depth and number
of K slices; warps; the grid (`programs`, or 0 for `per_sm` programs per SM); `ahead` 1 takes
each program's next item while it works on the current one (holding two items cannot deadlock
either: every wait still points at lower-numbered items)."""

DEFAULT_LAUNCH: dict[str, int | str] = {
    "mode1": "dot",
    "block_n1": 32,
    "block_k1": 128,
    "stages1": 3,
    "mode2": "dot_swap",
    "block_n2": 64,
    "block_k2": 128,
    "stages2": 3,
    "split2": 4,
    "num_warps": 4,
    "programs": 0,
    "per_sm": 2,
    "ahead": 0,
}

TUNED_LAUNCH: dict[tuple[int, int, int], dict[str, int | str]] = {}
"""(M bucket, I, N) -> launch, for the shapes and M buckets where the fused kernel was measured
faster than the unfused chain (benchmarks/benchmark_fused_mlp.py); the op runs the chain
elsewhere. Empty: the kernel measured 5-7% slower than the chain. Inside the engine it gives the
unfused engine's greedy tokens and logprobs (tests/compile/test_mlp_fusion.py's engine test,
which forces a table). Two earlier runs of that test failed with a comparison that took no
near-tie flip; its K split sums the down GEMM in another order than the chain, so a flat logit
of the dummy-weight model may flip (benchmarks/RESULTS.md, "The fused split-KV merge + FP8
o_proj measured")."""

NORM_BLOCK = 1024
"""Columns per chunk of phase 3's row walk."""


@triton.jit
def _wait_for(counter_ptr, target):
    """Spin until the int32 at `counter_ptr` reaches `target` (acquire: the stores released
    before the increments are visible after it, to loads that read past L1)."""
    seen = tl.atomic_add(counter_ptr, 0, sem="acquire")
    while seen < target:
        seen = tl.atomic_add(counter_ptr, 0, sem="acquire")
    tl.debug_barrier()


@triton.jit
def _gated_tile(x_ptr, wgu_ptr, h_ptr, tile, offs_m, m_mask, I, K, stride_xm, stride_wgu,
                DOT_F32: tl.constexpr, BLOCK_M: tl.constexpr, MODE: tl.constexpr,
                BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, STAGES: tl.constexpr,
                HW: tl.constexpr):  # fmt: skip
    """Work of kind 1: columns [tile * BLOCK_N, +BLOCK_N) of h = silu(x W_gate^T) * (x W_up^T)."""
    offs_k = tl.arange(0, BLOCK_K)
    offs_n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < I
    g_ptrs = wgu_ptr + offs_n[:, None].to(tl.int64) * stride_wgu + offs_k[None, :]
    u_ptrs = g_ptrs + I.to(tl.int64) * stride_wgu
    x_ptrs = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm + offs_k[None, :]
    if MODE == 0:
        acc_g = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    elif MODE == 1:
        acc_g = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    else:
        acc_g = tl.zeros([BLOCK_M, BLOCK_N, BLOCK_K], dtype=tl.float32)
    acc_u = tl.zeros_like(acc_g)
    for k in tl.range(0, K, BLOCK_K, num_stages=STAGES):
        k_mask = offs_k[None, :] < K - k
        w_mask = n_mask[:, None] & k_mask
        g = tl.load(g_ptrs, mask=w_mask, other=0.0, eviction_policy="evict_first")
        u = tl.load(u_ptrs, mask=w_mask, other=0.0, eviction_policy="evict_first")
        xv = tl.load(x_ptrs, mask=m_mask[:, None] & k_mask, other=0.0,
                     eviction_policy="evict_last")  # fmt: skip
        if DOT_F32:
            xv = xv.to(tl.float32)
        acc_g = _accumulate(acc_g, xv, g, MODE, DOT_F32)
        acc_u = _accumulate(acc_u, xv, u, MODE, DOT_F32)
        g_ptrs += BLOCK_K
        u_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
    dtype = h_ptr.dtype.element_ty
    h = _silu_mul(_tile_result(acc_g, MODE), _tile_result(acc_u, MODE), dtype, HW)
    h_ptrs = h_ptr + offs_m[:, None].to(tl.int64) * I + offs_n[None, :]
    tl.store(h_ptrs, h.to(dtype), mask=m_mask[:, None] & n_mask[None, :])


@triton.jit
def _down_partial(wd_ptr, h_ptr, partial_ptr, tile, split, offs_m, m_mask, M, N, I,
                  k_per_split, stride_wd, DOT_F32: tl.constexpr, BLOCK_M: tl.constexpr,
                  MODE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                  STAGES: tl.constexpr):  # fmt: skip
    """Work of kind 2: the float32 partial [M, BLOCK_N] tile `tile` of h W_down^T over K slice
    `split`, into partial[split]."""
    offs_k = tl.arange(0, BLOCK_K)
    k_start = split * k_per_split
    k_end = tl.minimum(I, k_start + k_per_split)
    offs_n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    w_ptrs = wd_ptr + offs_n[:, None].to(tl.int64) * stride_wd + (k_start + offs_k)[None, :]
    hv_ptrs = h_ptr + offs_m[:, None].to(tl.int64) * I + (k_start + offs_k)[None, :]
    if MODE == 0:
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    elif MODE == 1:
        acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N, BLOCK_K], dtype=tl.float32)
    for k in tl.range(k_start, k_end, BLOCK_K, num_stages=STAGES):
        k_mask = offs_k[None, :] < k_end - k
        w = tl.load(w_ptrs, mask=n_mask[:, None] & k_mask, other=0.0,
                    eviction_policy="evict_first")  # fmt: skip
        # h was stored by other programs of this grid: read it past L1.
        hv = tl.load(hv_ptrs, mask=m_mask[:, None] & k_mask, other=0.0, cache_modifier=".cg")
        if DOT_F32:
            hv = hv.to(tl.float32)
        acc = _accumulate(acc, hv, w, MODE, DOT_F32)
        w_ptrs += BLOCK_K
        hv_ptrs += BLOCK_K
    part = partial_ptr + split * M.to(tl.int64) * N + offs_m[:, None].to(tl.int64) * N
    tl.store(part + offs_n[None, :], _tile_result(acc, MODE),
             mask=m_mask[:, None] & n_mask[None, :])  # fmt: skip


@triton.jit
def _norm_row(partial_ptr, residual_ptr, norm_w_ptr, normed_ptr, residual_out_ptr, m, M, N,
              stride_rm, eps, SPLIT: tl.constexpr, NORM_BLOCK: tl.constexpr,
              HW: tl.constexpr):  # fmt: skip
    """Work of kind 3: row m's partials summed in slice order and rounded (the down GEMM's
    output), plus the residual, RMSNorm'd (the roundings of kernels/triton_fused.py)."""
    dtype = residual_out_ptr.dtype.element_ty
    offsets = tl.arange(0, NORM_BLOCK)
    slice_size = M.to(tl.int64) * N
    res_out_row = residual_out_ptr + m * N.to(tl.int64)
    squares = tl.zeros([NORM_BLOCK], dtype=tl.float32)
    for chunk in range(0, N, NORM_BLOCK):
        cols = chunk + offsets
        mask = cols < N
        y = tl.zeros([NORM_BLOCK], dtype=tl.float32)
        for s in tl.static_range(SPLIT):
            y += tl.load(partial_ptr + s * slice_size + m * N + cols, mask=mask, other=0.0,
                         cache_modifier=".cg")  # fmt: skip
        y = _round_to(y, dtype, HW)
        r = tl.load(residual_ptr + m * stride_rm + cols, mask=mask, other=0.0)
        summed = _round_to(y + r.to(tl.float32), dtype, HW)
        tl.store(res_out_row + cols, summed.to(dtype), mask=mask)
        squares += summed * summed
    variance = tl.math.div_rn(tl.sum(squares, axis=0), N * 1.0)
    rstd = tl.math.rsqrt(variance + eps)
    out_dtype = normed_ptr.dtype.element_ty
    for chunk in range(0, N, NORM_BLOCK):
        cols = chunk + offsets
        mask = cols < N
        summed = tl.load(res_out_row + cols, mask=mask, other=0.0).to(tl.float32)
        normed = _round_to(summed * rstd, dtype, HW)
        w = tl.load(norm_w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        out = _round_to(w * normed, out_dtype, HW)
        tl.store(normed_ptr + m * N.to(tl.int64) + cols, out.to(out_dtype), mask=mask)


@triton.jit(do_not_specialize=["M"])
def _fused_mlp_kernel(
    x_ptr,
    wgu_ptr,
    wd_ptr,
    h_ptr,
    partial_ptr,
    residual_ptr,
    norm_w_ptr,
    normed_ptr,
    residual_out_ptr,
    counter_ptr,
    programs,
    M,
    N,
    I,
    K,
    k_per_split,
    stride_xm,
    stride_wgu,
    stride_wd,
    stride_rm,
    eps,
    DOT_F32: tl.constexpr,
    BLOCK_M: tl.constexpr,
    MODE1: tl.constexpr,
    BLOCK_N1: tl.constexpr,
    BLOCK_K1: tl.constexpr,
    STAGES1: tl.constexpr,
    MODE2: tl.constexpr,
    BLOCK_N2: tl.constexpr,
    BLOCK_K2: tl.constexpr,
    STAGES2: tl.constexpr,
    SPLIT2: tl.constexpr,
    NORM_BLOCK: tl.constexpr,
    AHEAD: tl.constexpr,
    LANES: tl.constexpr,
    HW: tl.constexpr,
    PDL: tl.constexpr,
):
    """Every program takes work items in order from a shared counter until none is left (see
    the module): gated h tiles, then (K slice, down tile) partials, then norm rows. `programs` is
    the grid's size; counters: [0] the next item, [1] down partials done, [2] programs out,
    [3 + s] h tiles done in K slice s."""
    pdl_wait(PDL)
    offs_m = tl.arange(0, BLOCK_M)
    m_mask = offs_m < M
    gated_items = tl.cdiv(I, BLOCK_N1)
    tiles2 = tl.cdiv(N, BLOCK_N2)
    down_items = tiles2 * SPLIT2
    total = gated_items + down_items + M
    tiles_per_slice = k_per_split // BLOCK_N1
    lanes = tl.arange(0, LANES)
    lead = lanes == 0
    if AHEAD:
        taken = tl.atomic_add(counter_ptr + lanes * 0, lead.to(tl.int32), mask=lead, sem="relaxed")
        item = tl.max(tl.where(lead, taken, -1), axis=0)
    else:
        item = tl.atomic_add(counter_ptr, 1, sem="relaxed")
    while item < total:
        if AHEAD:
            # The next item is taken now by one lane; its value is read only after this item,
            # so the atomic's round trip overlaps the work (a scalar atomic would make every
            # thread wait for it here).
            taken = tl.atomic_add(counter_ptr + lanes * 0, lead.to(tl.int32), mask=lead,
                                  sem="relaxed")  # fmt: skip
        if item < gated_items:
            _gated_tile(x_ptr, wgu_ptr, h_ptr, item, offs_m, m_mask, I, K, stride_xm,
                        stride_wgu, DOT_F32, BLOCK_M, MODE1, BLOCK_N1, BLOCK_K1, STAGES1,
                        HW)  # fmt: skip
            tl.debug_barrier()
            tl.atomic_add(counter_ptr + 3 + item // tiles_per_slice, 1, sem="release")
        elif item < gated_items + down_items:
            # Slice-major order: the first slice's h tiles are the first to be done.
            split = (item - gated_items) // tiles2
            tile = (item - gated_items) % tiles2
            first = split * tiles_per_slice
            _wait_for(counter_ptr + 3 + split,
                      tl.minimum(gated_items, first + tiles_per_slice) - first)  # fmt: skip
            _down_partial(wd_ptr, h_ptr, partial_ptr, tile, split, offs_m, m_mask, M, N, I,
                          k_per_split, stride_wd, DOT_F32, BLOCK_M, MODE2, BLOCK_N2, BLOCK_K2,
                          STAGES2)  # fmt: skip
            tl.debug_barrier()
            tl.atomic_add(counter_ptr + 1, 1, sem="release")
        else:
            _wait_for(counter_ptr + 1, down_items)
            _norm_row(partial_ptr, residual_ptr, norm_w_ptr, normed_ptr, residual_out_ptr,
                      item - gated_items - down_items, M, N, stride_rm, eps, SPLIT2,
                      NORM_BLOCK, HW)  # fmt: skip
        if AHEAD:
            item = tl.max(tl.where(lead, taken, -1), axis=0)
        else:
            item = tl.atomic_add(counter_ptr, 1, sem="relaxed")
    pdl_release(PDL)
    # The last program out resets the counters: every item was taken and finished by then.
    tl.debug_barrier()
    out = tl.atomic_add(counter_ptr + 2, 1, sem="acq_rel")
    if out == programs - 1:
        for c in tl.static_range(3 + SPLIT2):
            tl.atomic_xchg(counter_ptr + c, 0)


def sm_count(device: torch.device) -> int:
    index = device.index if device.index is not None else torch.cuda.current_device()
    return torch.cuda.get_device_properties(index).multi_processor_count


def resolve_launch(
    m: int, i: int, n: int, k: int, launch: dict[str, int | str] | None = None
) -> dict[str, int | str]:
    """The table's launch for (M bucket, I, N) (DEFAULT_LAUNCH where it has none) with `launch`'s
    keys over it; raises ValueError naming a key that is unknown or out of range."""
    config = dict(TUNED_LAUNCH.get((m_bucket(m), i, n), DEFAULT_LAUNCH))
    for key, value in (launch or {}).items():
        if key not in LAUNCH_KEYS:
            raise ValueError(f"unknown fused MLP launch key {key!r}; allowed: {LAUNCH_KEYS}")
        config[key] = value
    for key in ("mode1", "mode2"):
        if config[key] not in MODES:
            raise ValueError(f"{key} must be one of {MODES}, got {config[key]!r}")
    for key in ("block_n1", "block_k1", "block_n2", "block_k2"):
        value = int(config[key])
        if value < 1 or value & (value - 1):
            raise ValueError(f"{key} must be a power of two, got {value}")
    for key in ("stages1", "stages2", "split2", "num_warps", "per_sm"):
        if int(config[key]) < 1:
            raise ValueError(f"{key} must be >= 1, got {config[key]}")
    if config["ahead"] not in (0, 1):
        raise ValueError(f"ahead must be 0 or 1, got {config['ahead']!r}")
    if int(config["programs"]) < 0:
        raise ValueError(f"programs must be >= 0 (0: per_sm per SM), got {config['programs']}")
    return config


def _chains(x, w_gate_up, w_down, residual, norm_weight) -> bool:
    """Whether the operands' shapes chain: x [M, K], w_gate_up [2I, K], w_down [N, I], residual
    [M, N], norm_weight [N]."""
    m, k = x.shape
    i, n = w_gate_up.shape[0] // 2, w_down.shape[0]
    return (
        w_gate_up.shape == (2 * i, k)
        and w_down.shape == (n, i)
        and residual.shape == (m, n)
        and norm_weight.shape == (n,)
    )


def fused_mlp_add_rms_norm(
    x: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    residual: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    **launch: int | str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(normed, residual_out) of the module's formula for x [M, K], w_gate_up [2I, K] (gate rows,
    then up rows), w_down [N, I], residual [M, N] and norm_weight [N], all of x's dtype; `launch`
    overrides keys of the table's launch (LAUNCH_KEYS)."""
    m, k = x.shape
    i = w_gate_up.shape[0] // 2
    n = w_down.shape[0]
    if not _chains(x, w_gate_up, w_down, residual, norm_weight):
        raise ValueError(
            f"fused MLP shapes do not chain: x {tuple(x.shape)}, w_gate_up "
            f"{tuple(w_gate_up.shape)}, w_down {tuple(w_down.shape)}, residual "
            f"{tuple(residual.shape)}, norm_weight {tuple(norm_weight.shape)}"
        )
    assert x.stride(1) == 1 and residual.stride(1) == 1
    assert w_gate_up.stride(1) == 1 and w_down.stride(1) == 1
    config = resolve_launch(m, i, n, k, launch)
    dtype = x.dtype
    h = torch.empty((m, i), dtype=dtype, device=x.device)
    normed = torch.empty((m, n), dtype=dtype, device=x.device)
    residual_out = torch.empty((m, n), dtype=dtype, device=x.device)
    split = int(config["split2"])
    partials = torch.empty((split, m, n), dtype=torch.float32, device=x.device)
    if m == 0:
        return normed, residual_out
    k_steps = triton.cdiv(i, int(config["block_k2"]))
    k_per_split = triton.cdiv(k_steps, split) * int(config["block_k2"])
    if k_per_split % int(config["block_n1"]):
        raise ValueError(
            f"block_n1 {config['block_n1']} must divide the down GEMM's K slice "
            f"({k_per_split} = I {i} over split2 {split} in block_k2 steps)"
        )
    block_m = max(block_rows(str(config["mode1"]), m), block_rows(str(config["mode2"]), m))
    hw = not interpreting()
    args = (
        x,
        w_gate_up,
        w_down,
        h,
        partials,
        residual,
        norm_weight.contiguous(),
        normed,
        residual_out,
    )
    constexprs = {
        "DOT_F32": dtype == torch.float32 or interpreting(),
        "BLOCK_M": block_m,
        "MODE1": _MODE_IDS[str(config["mode1"])],
        "BLOCK_N1": int(config["block_n1"]),
        "BLOCK_K1": int(config["block_k1"]),
        "STAGES1": int(config["stages1"]),
        "MODE2": _MODE_IDS[str(config["mode2"])],
        "BLOCK_N2": int(config["block_n2"]),
        "BLOCK_K2": int(config["block_k2"]),
        "STAGES2": int(config["stages2"]),
        "SPLIT2": split,
        "NORM_BLOCK": NORM_BLOCK,
        "AHEAD": bool(config["ahead"]),
        "LANES": 32 * int(config["num_warps"]),
        "HW": hw,
        "num_warps": int(config["num_warps"]),
    }
    scalars = (m, n, i, k, k_per_split, x.stride(0), w_gate_up.stride(0), w_down.stride(0),
               residual.stride(0), float(eps))  # fmt: skip
    counters = split_semaphores(x.device, 3 + split)
    if interpreting():  # programs run in turn: the first takes every item, the second none
        programs = 2
    else:
        programs = int(config["programs"]) or int(config["per_sm"]) * sm_count(x.device)
    _fused_mlp_kernel[(programs,)](
        *args, counters, programs, *scalars, **constexprs, **launch_options(x.device)
    )
    return normed, residual_out


def fused_mlp_reference(
    x: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    residual: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The module's formula in PyTorch, in float32 with the unfused kernels' roundings to x's
    dtype (GEMM outputs, SiLU, product, the residual sum, the normalised value)."""
    dtype = x.dtype
    i = w_gate_up.shape[0] // 2
    gate_up = (x.float() @ w_gate_up.float().t()).to(dtype).float()
    silu = torch.nn.functional.silu(gate_up[:, :i]).to(dtype).float()
    h = (silu * gate_up[:, i:]).to(dtype)
    y = (h.float() @ w_down.float().t()).to(dtype)
    summed = (y.float() + residual.float()).to(dtype)
    s = summed.float()
    rstd = torch.rsqrt(s.pow(2).mean(dim=-1, keepdim=True) + eps)
    normed = (s * rstd).to(dtype).float()
    return (norm_weight.float() * normed).to(dtype), summed


def fused_mlp_cuda(
    x: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    residual: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The CUDA body of `v1_engine::fused_mlp_add_rms_norm`: the fused kernel for an M bucket and
    shape TUNED_LAUNCH holds (one dtype throughout, unit-stride rows), else the unfused chain a
    decode step runs without the pass (gated or plain gate_up GEMM, the down GEMM, the add +
    RMSNorm kernel)."""
    m = x.shape[0]
    i, n = w_gate_up.shape[0] // 2, w_down.shape[0]
    dtype = x.dtype
    if (
        FUSED_MLP_ENABLED
        and (m_bucket(m), i, n) in TUNED_LAUNCH
        and all(t.dtype == dtype for t in (w_gate_up, w_down, residual, norm_weight))
        and x.stride(1) == 1
        and residual.stride(1) == 1
        and w_gate_up.is_contiguous()
        and w_down.is_contiguous()
        and _chains(x, w_gate_up, w_down, residual, norm_weight)
    ):
        return fused_mlp_add_rms_norm(x, w_gate_up, w_down, residual, norm_weight, eps)
    from v1_engine.kernels.skinny_epilogues import silu_mul_linear_cuda
    from v1_engine.kernels.skinny_linear_op import skinny_linear_cuda
    from v1_engine.kernels.triton_fused import add_rms_norm

    y = skinny_linear_cuda(silu_mul_linear_cuda(x, w_gate_up), w_down)
    if residual.dtype != y.dtype or norm_weight.dtype != y.dtype:
        from compile.passes.fused_ops import fused_add_rms_norm_ref

        return fused_add_rms_norm_ref(y, residual, norm_weight, eps)
    return add_rms_norm(y, residual, norm_weight, eps)
