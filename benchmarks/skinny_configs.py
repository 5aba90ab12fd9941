"""The launch-configuration space of benchmarks/sweep_skinny_gemm.py: for each GEMM kind (the
bf16 skinny GEMM and the FP8 kinds of kernels/fp8_launch.py), the bodies, tiles, K steps, warps,
stages and split-K factors it times, most promising first, and which of them fit an SM at a
given M (registers of the fma body, shared memory of the pipeline buffers). Plain python over
the launch rules; nothing here compiles or launches a kernel."""

from __future__ import annotations

import itertools

from v1_engine.kernels import fp8_launch, skinny_launch

SMEM_BYTES = 200 * 1024
"""Pipeline buffers above this cannot fit an SM's shared memory (with room for the epilogue)."""
FMA_MAX_M = skinny_launch.FMA_MAX_M
"""The fma body keeps M rows of partial products in registers: only small M."""


KINDS = ("bf16", "channel", "block", "weight_only", "gated", "norm", "norm_gated")
"""bf16: triton_gemv vs cuBLAS; channel / block: triton_gemv_fp8's kinds vs CUTLASS;
weight_only: the bf16-activation kernel vs CUTLASS on the quantized activation (its quant kernel
not counted: a conservative comparison where the op saves it, o_proj); gated: gate_up with
SiLU-and-mul in the epilogue vs the CUTLASS GEMM + the SiLU-and-mul + quant kernel it replaces
(shape gate_up); norm / norm_gated: the GEMM with the add + RMSNorm folded in vs the add +
RMSNorm + quant kernel and the GEMM the engine runs today (scaled_mm's dispatch; the gated
kernel's table launch)."""
GATED_KINDS = ("gated", "norm_gated")
NORM_KINDS = ("norm", "norm_gated")


def element_bytes(kind: str) -> int:
    return 2 if kind == "bf16" else 1


def block_ks(kind: str, fma: bool) -> tuple[int, ...]:
    """K steps, most promising first: the block kind steps one 128-wide scale group."""
    if kind == "block":
        return (fp8_launch.SCALE_GROUP,)
    if kind != "bf16":  # e4m3 weights: twice the bf16 kernel's K step, as many bytes
        return (1024, 512, 2048, 256) if fma else (512, 1024, 256)
    return (512, 256, 1024) if fma else (256, 128, 512)


def smem_bytes(kind: str, launch: dict, m: int) -> int:
    """Shared memory of the pipeline buffers: num_stages weight and x tiles (the gated kind
    reads two weight tiles, weight_only a bf16 x)."""
    weight_rows = launch["block_n"] * (2 if kind in GATED_KINDS else 1)
    # The norm kinds read x, the residual and the norm weight each K step (bf16).
    x_bytes = {"bf16": 2, "weight_only": 2, "norm": 6, "norm_gated": 6}.get(kind, 1)
    x_rows = skinny_launch.block_rows(launch["mode"], m)
    step = weight_rows * element_bytes(kind) + x_rows * x_bytes
    return launch["num_stages"] * launch["block_k"] * step


def launches(space) -> list[dict]:
    """Launch dicts of (num_stages, block_k, block_n, num_warps, mode) tuples, in order."""
    keys = ("num_stages", "block_k", "block_n", "num_warps", "mode")
    return [dict(zip(keys, values, strict=True)) for values in space]


def dot_configs(kind: str) -> list[dict]:
    """Tensor-core bodies, most promising first: those whose pipeline buffers fit shared memory
    at the smallest BLOCK_M (`applies` checks each M's own)."""
    space = itertools.product(
        (4, 3, 6), block_ks(kind, fma=False), (16, 32, 64), (4, 8), ("dot_swap", "dot")
    )
    return [launch for launch in launches(space) if smem_bytes(kind, launch, 1) <= SMEM_BYTES]


def fma_fits(kind: str, launch: dict, m: int) -> bool:
    """Whether the fma body's float32 accumulators (M's bucket x block_n x block_k; the gated
    kind has two) stay within 64 registers a thread."""
    values = skinny_launch.m_bucket(m) * launch["block_n"] * launch["block_k"]
    values *= 2 if kind in GATED_KINDS else 1
    return values <= 64 * 32 * launch["num_warps"]


def fma_block_ns(kind: str) -> tuple[int, ...]:
    """fma column tiles. The block kind's K step is one 128-wide group, so it needs the wider
    tiles for 16-byte loads (32 x 128 e4m3 = 32 bytes a thread at 4 warps)."""
    return (32, 16, 64, 8) if kind == "block" else (8, 16, 4, 32, 2)


def wgmma_configs(kind: str) -> list[dict]:
    """The FP8 kinds' "wgmma" body (e4m3 tiles straight into FP8 warpgroup MMAs): column tiles
    of one or two warpgroup MMAs' 64 rows, K steps of whole 128-wide promotion intervals,
    fitting shared memory at the smallest BLOCK_M."""
    if "wgmma" not in fp8_launch.KIND_MODES.get(kind, ()):
        return []
    block_ks = (fp8_launch.SCALE_GROUP,) if kind == "block" else (256, 128, 512)
    space = itertools.product((4, 3, 6), block_ks, (64, 128), (4, 8), ("wgmma",))
    return [launch for launch in launches(space) if smem_bytes(kind, launch, 1) <= SMEM_BYTES]


def fma_configs(kind: str) -> list[dict]:
    """Broadcast multiply-reduce bodies, each fitting registers and shared memory at M = 1 at
    least (`applies` checks each M's own), the most accumulator values a thread first: a K
    step's fixed costs (the activation row's conversion, addresses, the loop) then spread over
    more weight bytes. In the sm_90 builds of the FP8 kinds (`python
    tests/kernels/fp8_decode_probe.py --rank KIND M`) the launches with 64 values a thread issue
    0.11-0.13 warp instructions a weight byte at M = 1, those with 32 (the default) 0.16."""
    if "fma" not in (skinny_launch.MODES if kind == "bf16" else fp8_launch.KIND_MODES[kind]):
        return []
    space = itertools.product(
        (4, 3, 6), block_ks(kind, fma=True), fma_block_ns(kind), (4, 8), ("fma",)
    )
    configs = [
        launch
        for launch in launches(space)
        if fma_fits(kind, launch, 1) and smem_bytes(kind, launch, 1) <= SMEM_BYTES
    ]
    return sorted(configs, key=lambda c: -c["block_n"] * c["block_k"] // c["num_warps"])


def split_configs(kind: str, splits: list[int]) -> list[dict]:
    """Split-K launches: the dot configs of the narrower width below, also at the wider one, each
    split `splits` ways. bf16 (meant for M = 32..64): 64 and 128 columns, wider tiles re-reading
    x from L2 fewer times while the split keeps their programs many; FP8 (any M): 32 and 64
    columns, the split putting more programs, so more loads, in flight per SM. The FP8 channel
    and block kinds also split their fma configs (M <= 4; the decode kinds never split):
    wide fma tiles leave few programs on the short shapes (o_proj: 128 of 32 columns)."""
    if not splits:
        return []
    narrow, wide = (64, 128) if kind == "bf16" else (32, 64)
    configs = []
    for launch in dot_configs(kind):
        if launch["block_n"] != narrow:
            continue
        for block_n, split in itertools.product((narrow, wide), splits):
            config = launch | {"block_n": block_n, "split_k": split}
            if smem_bytes(kind, config, 1) <= SMEM_BYTES:
                configs.append(config)
    if kind in ("channel", "block"):
        for launch, split in itertools.product(wgmma_configs(kind), splits):
            if smem_bytes(kind, launch, 1) <= SMEM_BYTES:
                configs.append(launch | {"split_k": split})
        for launch, split in itertools.product(fma_configs(kind), splits):
            if launch["block_n"] >= 16:
                configs.append(launch | {"split_k": split})
    return configs


def interleave(dot: list[dict], fma: list[dict]) -> list[dict]:
    """Both lists in their own order, three of the first to one of the second, so a short budget
    still samples both (the dot and wgmma bodies, then those and the fma body)."""
    merged = []
    for i, launch in enumerate(dot):
        merged.append(launch)
        if i % 3 == 2 and fma:
            merged.append(fma.pop(0))
    return merged + fma


def sweep_configs(kind: str, splits: list[int], modes: list[str] | None) -> list[dict]:
    """Every config the sweep times for `kind`, most promising first: the bodies interleaved,
    the split launches (`splits` ways) alternating with them, only `modes` (default: the
    kind's bodies)."""
    kind_modes = skinny_launch.MODES if kind == "bf16" else fp8_launch.KIND_MODES[kind]
    modes = set(modes or kind_modes)
    configs = interleave(interleave(dot_configs(kind), wgmma_configs(kind)), fma_configs(kind))
    split = split_configs(kind, splits)
    if split:
        configs = [c for pair in itertools.zip_longest(configs, split) for c in pair if c]
    return [c for c in configs if c["mode"] in modes]


def applies(kind: str, launch: dict, m: int) -> bool:
    """Whether the config runs at M: the fma body only up to FMA_MAX_M rows, and the pipeline
    buffers of M's BLOCK_M must fit shared memory."""
    if launch["mode"] == "fma" and (m > FMA_MAX_M or not fma_fits(kind, launch, m)):
        return False
    return smem_bytes(kind, launch, m) <= SMEM_BYTES
