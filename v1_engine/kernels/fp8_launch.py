"""Launch rules of the skinny FP8 GEMMs (kernels/triton_gemv_fp8.py, and the decode kinds of
kernels/triton_gemv_fp8_decode.py), per kind:

- the measured table FP8_TUNED_LAUNCH (kernels/skinny_tuned_fp8.py, keyed by M bucket, N, K;
  None where CUTLASS measured faster), read by `fp8_launch_config`;
- `default_fp8_launch`, the config of a shape the table does not hold (explicit calls only: the
  ops keep CUTLASS there);
- `resolve_fp8_launch`, a config with a launch's overrides applied and validated: a ValueError
  names the key that is unknown or out of range and the values it allows (skinny_launch's rules,
  plus each kind's bodies, the wgmma body's tile multiples, the block kind's scale group and the
  decode kinds' unsplit K);
- `prefers_fp8_skinny`, the dispatch rule of the ops: the Triton kernel only where the skinny
  GEMMs are enabled and the table holds a measured config for the shape, CUTLASS (or the
  quantized chain) everywhere else.

Plain Python without kernels, extending the bf16 kernel's launch rules (kernels/skinny_launch.py):
importing it imports neither triton nor torch.
"""

from __future__ import annotations

from v1_engine.kernels import skinny_launch
from v1_engine.kernels.skinny_launch import m_bucket
from v1_engine.kernels.skinny_tuned_fp8 import FP8_TUNED_LAUNCH

KIND_MODES = {
    "channel": ("dot_swap", "wgmma", "fma"),
    "block": ("dot_swap", "wgmma", "fma"),
    "weight_only": ("fma",),
    "gated": ("fma", "wgmma"),
    "norm": ("fma", "wgmma"),
    "norm_gated": ("fma", "wgmma"),
}
"""Bodies each FP8 kernel has (see kernels/triton_gemv_fp8.py's docstring): skinny_launch.MODES'
"dot_swap" and "fma" (only for M <= skinny_launch.FMA_MAX_M, as in the bf16 kernel), and "wgmma",
FP8's own: dot_swap on the e4m3 tiles as loaded (block_n a multiple of WGMMA_ROWS)."""
KINDS = tuple(KIND_MODES)
WGMMA_ROWS = 64
"""Weight rows of one warpgroup's FP8 MMA: the "wgmma" body's block_n is a multiple (Triton
lowers smaller tiles to mma.sync, which has no e4m3 form on sm_90)."""
WGMMA_PROMOTE_K = 128
"""K extent the "wgmma" body accumulates in the tensor core before adding to float32 (the
max_num_imprecise_acc of triton_gemv_fp8._swapped_dot): its block_k is a multiple."""
DECODE_KINDS = ("weight_only", "gated", "norm", "norm_gated")
"""The kinds of kernels/triton_gemv_fp8_decode.py (the fma body, the gated and norm kinds also
wgmma; never split), which shares this module's table and launch rules. "norm" / "norm_gated" are
weight_only / gated (on a bf16 activation) with the residual add and RMSNorm before them folded
in."""
NORM_WGMMA_MAX_K = 8192
"""Longest row the norm kinds' wgmma body holds in registers for its prologue (the row padded to
a power of two: 64 float32 values a thread at 4 warps)."""
SCALE_GROUP = 128
"""K (and N) extent of one block scale; the block kind's K step is exactly one group."""


def _check_kind(kind: str) -> None:
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")


def default_fp8_launch(kind: str, m: int, n: int, k: int) -> dict[str, int | str]:
    """Launch config for shapes the sweep has not measured (explicit calls only; the ops keep
    CUTLASS there): the bf16 default's column tiles, with a K step of as many bytes (512 e4m3
    values) for the channel kind and one scale group for the block kind."""
    _check_kind(kind)
    if kind in DECODE_KINDS:
        # The bf16 kernel's M = 1 fma launches in as many bytes a K step; the K step shrinks as
        # M grows, so the float32 accumulator stays at 32 registers a thread.
        block_n = 2 if kind in ("gated", "norm_gated") else 4
        block_k = max(128, 1024 // m_bucket(m))
        return {"mode": "fma", "block_n": block_n, "block_k": block_k, "num_warps": 4,
                "num_stages": 4, "split_k": 1}  # fmt: skip
    config = skinny_launch.default_launch(m, n, k) | {"mode": "dot_swap", "block_n": 32}
    if kind == "channel":
        return config | {"block_k": 512}
    return config | {"block_k": SCALE_GROUP, "num_stages": 6}


def fp8_launch_config(kind: str, m: int, n: int, k: int) -> dict[str, int | str]:
    """The launch config of an M x N x K FP8 skinny GEMM: FP8_TUNED_LAUNCH's entry, else the
    default."""
    _check_kind(kind)
    tuned = FP8_TUNED_LAUNCH[kind].get((m_bucket(m), n, k))
    return dict(tuned or default_fp8_launch(kind, m, n, k))


def resolve_fp8_launch(
    kind: str, m: int, n: int, k: int, launch: dict[str, int | str]
) -> dict[str, int | str]:
    """`fp8_launch_config` with the `launch` overrides applied; raises ValueError naming a key
    that is unknown or out of range (skinny_launch's rules, plus block_k == 128 and
    block_n <= 128 for the block kind, and for the wgmma body block_n a multiple of 64 and
    block_k of 128, and for the norm kinds' K <= NORM_WGMMA_MAX_K)."""
    config = fp8_launch_config(kind, m, n, k) | launch
    mode = config["mode"]
    # A complete config overrides every key of skinny_launch's own default, so this only checks
    # (the wgmma body under dot_swap's rules: it is dot_swap on e4m3 operands).
    checked = config | {"mode": "dot_swap"} if mode == "wgmma" else config
    config = skinny_launch.resolve_launch(m, n, k, checked) | {"mode": mode}
    if config["mode"] not in KIND_MODES[kind]:
        raise ValueError(
            f"launch mode must be one of {KIND_MODES[kind]} for the FP8 {kind} kernel, got "
            f"{config['mode']!r}"
        )
    if mode == "wgmma" and config["block_n"] % WGMMA_ROWS:
        raise ValueError(
            f"launch block_n must be a multiple of {WGMMA_ROWS} in mode 'wgmma' (one FP8 "
            f"warpgroup MMA's rows), got {config['block_n']!r}"
        )
    if mode == "wgmma" and config["block_k"] % WGMMA_PROMOTE_K:
        raise ValueError(
            f"launch block_k must be a multiple of {WGMMA_PROMOTE_K} in mode 'wgmma' (its "
            f"float32 promotion interval), got {config['block_k']!r}"
        )
    if kind in ("norm", "norm_gated") and mode == "wgmma" and k > NORM_WGMMA_MAX_K:
        raise ValueError(
            f"launch mode 'wgmma' of the {kind} kind takes K <= {NORM_WGMMA_MAX_K} (the row it "
            f"norms in registers), got K = {k}"
        )
    if kind in DECODE_KINDS and config["split_k"] != 1:
        raise ValueError(f"launch split_k must be 1 for the {kind} kind, got {config['split_k']!r}")
    if kind == "block":
        if config["block_k"] != SCALE_GROUP:
            raise ValueError(
                f"launch block_k must be {SCALE_GROUP} (one scale group) for the block kind, "
                f"got {config['block_k']!r}"
            )
        if config["block_n"] > SCALE_GROUP:
            raise ValueError(
                f"launch block_n must be <= {SCALE_GROUP} for the block kind (one weight scale "
                f"per tile), got {config['block_n']!r}"
            )
    return config


def prefers_fp8_skinny(kind: str, m: int, n: int, k: int) -> bool:
    """True only where the skinny GEMMs are enabled (V1ENGINE_SKINNY_GEMM) and FP8_TUNED_LAUNCH
    holds a measured config for the shape (for the decode kinds, only up to the fma body's
    skinny_launch.FMA_MAX_M rows): every other shape stays on CUTLASS."""
    _check_kind(kind)
    if not skinny_launch.SKINNY_GEMM_ENABLED:
        return False
    if kind in DECODE_KINDS and m_bucket(m) > skinny_launch.FMA_MAX_M:  # the fma body only
        return False
    return FP8_TUNED_LAUNCH[kind].get((m_bucket(m), n, k)) is not None
