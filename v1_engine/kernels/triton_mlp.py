"""A decoder layer's MLP and the residual add + RMSNorm after it in one persistent Triton kernel,
for decode-sized batches of an unquantized model:

    h = silu(x @ W_gate^T) * (x @ W_up^T)                     [M, I]
    y = h @ W_down^T                                          [M, N]
    residual_out = y + residual;  normed = norm_w * rmsnorm(residual_out)

Unfused, a decode step runs this as four kernels (the gate_up GEMM, SiLU-and-mul, the down GEMM,
the add + RMSNorm; kernels/triton_gemv.py, triton_fused.py), and each boundary costs a drain of
one grid and the ramp-up of the next while HBM idles: for the short GEMMs of a decode step that
is several microseconds a kernel (benchmarks/RESULTS.md: the gate_up / down GEMMs at batch 64 run
at 0.88 / 0.79 of HBM, the whole step's GEMMs at 0.77). Here one grid of `programs` programs, all
resident at once (at most one per SM), walks three phases separated by grid barriers:

1. gated column tiles of W_gate_up (a tile of gate rows and the matching up rows, as the gated
   skinny GEMM does) round-robin over the programs; each stores its silu(gate) * up tile of h;
2. after a barrier (every tile of h stored), work units (column tile of W_down, K slice) of the
   down GEMM round-robin; each stores its float32 partial tile;
3. after a second barrier, the rows round-robin: the partials summed in slice order, then the
   add + RMSNorm.

The roundings are those of the unfused kernels (the GEMM output in x's dtype, SiLU, product; the
split-K sum in slice order, the sum with the residual, the normalised value, the weight
product), so the fused op agrees with the chain as the chain agrees with the references.

The barriers are one int32 counter on the per-device semaphores (kernels/semaphores.py): each
program adds itself after a CTA barrier (release) and spins with acquire atomics until all have;
the last program out resets the counters, so every launch finds them at zero. A grid barrier is
only safe when every program is resident at once: the launcher caps `programs` at the SM count,
and a program needs less than one SM. Under the Triton interpreter, which runs programs one
after another, each phase is a launch of its own (`PHASE` 1..3) and the barriers are skipped.

PDL (kernels/pdl.py): the programs wait before touching memory, and let the next kernel launch
after the second barrier (phase 3 is short).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from v1_engine.kernels import interpreting
from v1_engine.kernels.pdl import launch_options, pdl_release, pdl_wait
from v1_engine.kernels.semaphores import split_semaphores
from v1_engine.kernels.triton_fused_quant import _round_to
from v1_engine.kernels.triton_gemv import (
    _MODE_IDS,
    MODES,
    _accumulate,
    _silu_mul,
    _tile_result,
    block_rows,
    m_bucket,
)

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
)
"""A launch: phase 1's body (kernels/triton_gemv.py's modes), gated tile width (gate rows; as many
up rows), K step and pipeline depth; phase 2's body, tile, K step, depth and K split; warps; the
number of programs (0: the SM count)."""

DEFAULT_LAUNCH: dict[str, int | str] = {
    "mode1": "dot",
    "block_n1": 32,
    "block_k1": 128,
    "stages1": 4,
    "mode2": "dot_swap",
    "block_n2": 64,
    "block_k2": 128,
    "stages2": 4,
    "split2": 2,
    "num_warps": 4,
    "programs": 128,
}

TUNED_LAUNCH: dict[tuple[int, int, int], dict[str, int | str]] = {}
"""(M bucket, I, N) -> launch, for the shapes and M buckets where the fused kernel was measured
faster than the unfused chain (benchmarks/benchmark_fused_mlp.py); the op runs the chain
elsewhere."""

NORM_BLOCK = 1024
"""Columns per chunk of phase 3's row walk."""


@triton.jit
def _grid_barrier(counter_ptr, target):
    """Every program of the grid: wait until `target` arrivals are counted on `counter_ptr`
    (including this program's, added here). The CTA barrier orders this program's stores before
    its release; the acquire makes the other programs' stores visible to the loads after it
    (which read past L1 anyway)."""
    tl.debug_barrier()
    tl.atomic_add(counter_ptr, 1, sem="release")
    arrived = tl.atomic_add(counter_ptr, 0, sem="acquire")
    while arrived < target:
        arrived = tl.atomic_add(counter_ptr, 0, sem="acquire")
    tl.debug_barrier()


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
    PHASE: tl.constexpr,
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
    HW: tl.constexpr,
    PDL: tl.constexpr,
):
    """PHASE 0: the three phases with grid barriers between them (the GPU); 1, 2, 3: that phase
    alone (the interpreter). `programs` is the grid's size."""
    pdl_wait(PDL)
    pid = tl.program_id(0)
    dtype = h_ptr.dtype.element_ty
    offs_m = tl.arange(0, BLOCK_M)
    m_mask = offs_m < M
    h_rows = offs_m[:, None].to(tl.int64) * I

    if PHASE == 0 or PHASE == 1:
        offs_k = tl.arange(0, BLOCK_K1)
        for tile in range(pid, tl.cdiv(I, BLOCK_N1), programs):
            offs_n = tile * BLOCK_N1 + tl.arange(0, BLOCK_N1)
            n_mask = offs_n < I
            g_ptrs = wgu_ptr + offs_n[:, None].to(tl.int64) * stride_wgu + offs_k[None, :]
            u_ptrs = g_ptrs + I.to(tl.int64) * stride_wgu
            x_ptrs = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm + offs_k[None, :]
            if MODE1 == 0:
                acc_g = tl.zeros([BLOCK_M, BLOCK_N1], dtype=tl.float32)
            elif MODE1 == 1:
                acc_g = tl.zeros([BLOCK_N1, BLOCK_M], dtype=tl.float32)
            else:
                acc_g = tl.zeros([BLOCK_M, BLOCK_N1, BLOCK_K1], dtype=tl.float32)
            acc_u = tl.zeros_like(acc_g)
            for k in tl.range(0, K, BLOCK_K1, num_stages=STAGES1):
                k_mask = offs_k[None, :] < K - k
                w_mask = n_mask[:, None] & k_mask
                g = tl.load(g_ptrs, mask=w_mask, other=0.0, eviction_policy="evict_first")
                u = tl.load(u_ptrs, mask=w_mask, other=0.0, eviction_policy="evict_first")
                xv = tl.load(x_ptrs, mask=m_mask[:, None] & k_mask, other=0.0,
                             eviction_policy="evict_last")  # fmt: skip
                if DOT_F32:
                    xv = xv.to(tl.float32)
                acc_g = _accumulate(acc_g, xv, g, MODE1, DOT_F32)
                acc_u = _accumulate(acc_u, xv, u, MODE1, DOT_F32)
                g_ptrs += BLOCK_K1
                u_ptrs += BLOCK_K1
                x_ptrs += BLOCK_K1
            h = _silu_mul(_tile_result(acc_g, MODE1), _tile_result(acc_u, MODE1), dtype, HW)
            tl.store(h_ptr + h_rows + offs_n[None, :], h.to(dtype),
                     mask=m_mask[:, None] & n_mask[None, :])  # fmt: skip
    if PHASE == 0:
        _grid_barrier(counter_ptr, programs)

    if PHASE == 0 or PHASE == 2:
        offs_k = tl.arange(0, BLOCK_K2)
        tiles2 = tl.cdiv(N, BLOCK_N2)
        for unit in range(pid, tiles2 * SPLIT2, programs):
            tile = unit // SPLIT2
            split = unit % SPLIT2
            k_start = split * k_per_split
            k_end = tl.minimum(I, k_start + k_per_split)
            offs_n = tile * BLOCK_N2 + tl.arange(0, BLOCK_N2)
            n_mask = offs_n < N
            w_ptrs = wd_ptr + offs_n[:, None].to(tl.int64) * stride_wd + (k_start + offs_k)[None, :]
            hv_ptrs = h_ptr + h_rows + (k_start + offs_k)[None, :]
            if MODE2 == 0:
                acc = tl.zeros([BLOCK_M, BLOCK_N2], dtype=tl.float32)
            elif MODE2 == 1:
                acc = tl.zeros([BLOCK_N2, BLOCK_M], dtype=tl.float32)
            else:
                acc = tl.zeros([BLOCK_M, BLOCK_N2, BLOCK_K2], dtype=tl.float32)
            for k in tl.range(k_start, k_end, BLOCK_K2, num_stages=STAGES2):
                k_mask = offs_k[None, :] < k_end - k
                w = tl.load(w_ptrs, mask=n_mask[:, None] & k_mask, other=0.0,
                            eviction_policy="evict_first")  # fmt: skip
                # h was stored by other programs of this grid: read it past L1.
                hv = tl.load(hv_ptrs, mask=m_mask[:, None] & k_mask, other=0.0,
                             cache_modifier=".cg")  # fmt: skip
                if DOT_F32:
                    hv = hv.to(tl.float32)
                acc = _accumulate(acc, hv, w, MODE2, DOT_F32)
                w_ptrs += BLOCK_K2
                hv_ptrs += BLOCK_K2
            part = partial_ptr + split * M.to(tl.int64) * N + offs_m[:, None].to(tl.int64) * N
            tl.store(part + offs_n[None, :], _tile_result(acc, MODE2),
                     mask=m_mask[:, None] & n_mask[None, :])  # fmt: skip
    if PHASE == 0:
        _grid_barrier(counter_ptr, 2 * programs)
        pdl_release(PDL)

    if PHASE == 0 or PHASE == 3:
        offsets = tl.arange(0, NORM_BLOCK)
        slice_size = M.to(tl.int64) * N
        for m in range(pid, M, programs):
            res_out_row = residual_out_ptr + m * N.to(tl.int64)
            squares = tl.zeros([NORM_BLOCK], dtype=tl.float32)
            for chunk in range(0, N, NORM_BLOCK):
                cols = chunk + offsets
                mask = cols < N
                y = tl.zeros([NORM_BLOCK], dtype=tl.float32)
                for s in tl.static_range(SPLIT2):
                    y += tl.load(partial_ptr + s * slice_size + m * N + cols, mask=mask,
                                 other=0.0, cache_modifier=".cg")  # fmt: skip
                y = _round_to(y, dtype, HW)  # the down GEMM's output
                r = tl.load(residual_ptr + m * stride_rm + cols, mask=mask, other=0.0)
                s_val = _round_to(y + r.to(tl.float32), dtype, HW)
                tl.store(res_out_row + cols, s_val.to(dtype), mask=mask)
                squares += s_val * s_val
            variance = tl.math.div_rn(tl.sum(squares, axis=0), N * 1.0)
            rstd = tl.math.rsqrt(variance + eps)
            for chunk in range(0, N, NORM_BLOCK):
                cols = chunk + offsets
                mask = cols < N
                s_val = tl.load(res_out_row + cols, mask=mask, other=0.0).to(tl.float32)
                normed = _round_to(s_val * rstd, dtype, HW)
                w = tl.load(norm_w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
                out = _round_to(w * normed, normed_ptr.dtype.element_ty, HW)
                tl.store(normed_ptr + m * N.to(tl.int64) + cols,
                         out.to(normed_ptr.dtype.element_ty), mask=mask)  # fmt: skip

    if PHASE == 0:
        # The last program out resets both counters: every program has passed both barriers.
        tl.debug_barrier()
        done = tl.atomic_add(counter_ptr + 1, 1, sem="acq_rel")
        if done == programs - 1:
            tl.atomic_xchg(counter_ptr, 0)
            tl.atomic_xchg(counter_ptr + 1, 0)


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
    for key in ("stages1", "stages2", "split2", "num_warps"):
        if int(config[key]) < 1:
            raise ValueError(f"{key} must be >= 1, got {config[key]}")
    if int(config["programs"]) < 0:
        raise ValueError(f"programs must be >= 0 (0: one per SM), got {config['programs']}")
    return config


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
    if (
        w_gate_up.shape != (2 * i, k)
        or w_down.shape != (n, i)
        or residual.shape != (m, n)
        or norm_weight.shape != (n,)
    ):
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
        "HW": hw,
        "num_warps": int(config["num_warps"]),
    }
    scalars = (m, n, i, k, k_per_split, x.stride(0), w_gate_up.stride(0), w_down.stride(0),
               residual.stride(0), float(eps))  # fmt: skip
    counters = split_semaphores(x.device, 2)
    if not hw:  # the interpreter runs programs in turn: one launch per phase, no barriers
        for phase in (1, 2, 3):
            _fused_mlp_kernel[(4,)](*args, counters, 4, *scalars, PHASE=phase, PDL=False,
                                    **constexprs)  # fmt: skip
        return normed, residual_out
    programs = int(config["programs"]) or sm_count(x.device)
    programs = min(programs, sm_count(x.device))
    _fused_mlp_kernel[(programs,)](
        *args, counters, programs, *scalars, PHASE=0, **constexprs, **launch_options(x.device)
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
    m, k = x.shape
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
        and w_gate_up.shape == (2 * i, k)
        and w_down.shape == (n, i)
        and residual.shape == (m, n)
    ):
        return fused_mlp_add_rms_norm(x, w_gate_up, w_down, residual, norm_weight, eps)
    from v1_engine.kernels.skinny_epilogues import silu_mul_linear_cuda
    from v1_engine.kernels.triton_fused import add_rms_norm
    from v1_engine.kernels.triton_gemv import skinny_linear_cuda

    y = skinny_linear_cuda(silu_mul_linear_cuda(x, w_gate_up), w_down)
    if residual.dtype != y.dtype or norm_weight.dtype != y.dtype:
        from compile.passes.fused_ops import fused_add_rms_norm_ref

        return fused_add_rms_norm_ref(y, residual, norm_weight, eps)
    return add_rms_norm(y, residual, norm_weight, eps)
