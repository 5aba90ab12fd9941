"""Launch rules of the bf16 skinny GEMM (kernels/triton_gemv.py), which the FP8 skinny GEMMs'
rules (kernels/fp8_launch.py) and the fused MLP (kernels/triton_mlp.py) build on:

- the bounds: SKINNY_MAX_M rows for the kernel at all, FMA_MAX_M for its "fma" body, and the
  switch SKINNY_GEMM_ENABLED (V1ENGINE_SKINNY_GEMM);
- the bodies (MODES) and launch keys (LAUNCH_KEYS), `m_bucket` (the row count the tables are
  keyed by) and `block_rows` (a body's BLOCK_M);
- the measured table TUNED_LAUNCH (kernels/skinny_tuned.py, keyed by M bucket, N, K; None where
  F.linear measured faster), read by `launch_config`, and `default_launch`, the config of a
  shape the table does not hold (explicit calls only: the op keeps F.linear there);
- `resolve_launch`, a config with a launch's overrides applied and validated: a ValueError names
  the key that is unknown or out of range and the values it allows; `k_per_split`, the K slice
  each program of a split launch walks;
- `prefers_skinny`, the op's dispatch rule: the kernel only where the table holds a measured
  config for the shape, F.linear everywhere else.

Plain Python over ints and the table, without kernels: importing it imports neither triton nor
torch.
"""

from __future__ import annotations

import os

from v1_engine.kernels.skinny_tuned import TUNED_LAUNCH

SKINNY_MAX_M = 64
"""Largest row count the skinny kernel takes; more rows go to F.linear (compute starts to
matter there and the vendor GEMM's tiles fit). Within it the op still runs the kernel only on
shapes and M buckets TUNED_LAUNCH holds a measured config for."""

FMA_MAX_M = 4
"""Largest row count of the "fma" body: its float32 accumulator holds BLOCK_M x BLOCK_N x BLOCK_K
values in registers, so more rows spill (`resolve_launch` rejects the body beyond it)."""

SKINNY_GEMM_ENABLED = os.environ.get("V1ENGINE_SKINNY_GEMM", "1") != "0"
"""V1ENGINE_SKINNY_GEMM=0 keeps the unquantized linear layers on F.linear everywhere."""

MODES = ("dot", "dot_swap", "fma")
LAUNCH_KEYS = ("mode", "block_n", "block_k", "num_warps", "num_stages", "split_k")
_DOT_ROWS = 16
"""tl.dot needs every dimension >= 16: the dot bodies pad x's rows to at least this."""


def m_bucket(m: int) -> int:
    """M rounded up to a power of two: the row count the launch table is keyed by."""
    return 1 << max(0, m - 1).bit_length()


def block_rows(mode: str, m: int) -> int:
    """BLOCK_M, the rows x is tiled into for M in body `mode`: M's bucket, and at least the 16
    rows tl.dot needs in the tensor-core bodies."""
    bucket = m_bucket(m)
    return bucket if mode == "fma" else max(_DOT_ROWS, bucket)


def default_launch(m: int, n: int, k: int) -> dict[str, int | str]:
    """Launch config for shapes the sweep has not measured: enough column tiles to give every
    SM of a large GPU about two programs, 256-wide K steps and four stages in flight."""
    if n >= 16384:
        block_n = 64
    elif n >= 8192:
        block_n = 32
    else:
        block_n = 16
    return {
        "mode": "dot",
        "block_n": block_n,
        "block_k": 256,
        "num_warps": 4,
        "num_stages": 4,
        "split_k": 1,
    }


def launch_config(m: int, n: int, k: int) -> dict[str, int | str]:
    """The launch config of an M x N x K skinny GEMM: TUNED_LAUNCH's entry (split_k 1 unless it
    says), else the default."""
    return {"split_k": 1} | (TUNED_LAUNCH.get((m_bucket(m), n, k)) or default_launch(m, n, k))


def prefers_skinny(m: int, n: int, k: int) -> bool:
    """True only for shapes TUNED_LAUNCH holds a measured config for. An unmeasured shape stays
    on F.linear: the untuned default lost to cuBLAS on 4 of the 5 Llama-3-8B shapes it was
    measured on, so extending the table (sweep_skinny_gemm.py) is how a model gains."""
    return TUNED_LAUNCH.get((m_bucket(m), n, k)) is not None


def _is_pow2(value: object) -> bool:
    return isinstance(value, int) and value > 0 and value & (value - 1) == 0


def resolve_launch(m: int, n: int, k: int, launch: dict[str, int | str]) -> dict[str, int | str]:
    """`launch_config` with the `launch` overrides applied; raises ValueError naming a key that
    is unknown or out of range."""
    for key in launch:
        if key not in LAUNCH_KEYS:
            raise ValueError(f"unknown launch key {key!r}; allowed keys are {LAUNCH_KEYS}")
    config = launch_config(m, n, k) | launch
    if config["mode"] not in MODES:
        raise ValueError(f"launch mode must be one of {MODES}, got {config['mode']!r}")
    if config["mode"] == "fma" and m_bucket(m) > FMA_MAX_M:
        raise ValueError(
            f"launch mode 'fma' needs M in 1..{FMA_MAX_M}, got M = {m} (M bucket {m_bucket(m)})"
        )
    floor = 1 if config["mode"] == "fma" else _DOT_ROWS
    for key in ("block_n", "block_k"):
        if not _is_pow2(config[key]) or config[key] < floor:
            raise ValueError(
                f"launch {key} must be a power of two >= {floor} in mode {config['mode']!r}, "
                f"got {config[key]!r}"
            )
    if not _is_pow2(config["num_warps"]):
        raise ValueError(f"launch num_warps must be a power of two, got {config['num_warps']!r}")
    if not isinstance(config["num_stages"], int) or config["num_stages"] < 1:
        raise ValueError(f"launch num_stages must be an integer >= 1, got {config['num_stages']!r}")
    k_steps = -(-k // config["block_k"])
    split = config["split_k"]
    if not isinstance(split, int) or not 1 <= split <= k_steps:
        raise ValueError(
            f"launch split_k must be an integer in 1..{k_steps} (K = {k} in block_k "
            f"{config['block_k']} steps), got {split!r}"
        )
    per_slice = -(-k_steps // split)
    if -(-k_steps // per_slice) != split:
        raise ValueError(
            f"launch split_k {split} would leave a slice empty: {k_steps} block_k steps split "
            f"{per_slice} a slice fill only {-(-k_steps // per_slice)} slices"
        )
    return config


def k_per_split(k: int, config: dict) -> int:
    """The K slice each program of a split launch walks: whole block_k steps, the last slice
    taking what remains."""
    k_steps = -(-k // config["block_k"])
    return -(-k_steps // config["split_k"]) * config["block_k"]
