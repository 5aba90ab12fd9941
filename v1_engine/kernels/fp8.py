"""FP8 (e4m3) quantization and scaled GEMMs: the ops the FP8 linear layers and KV cache call.

Every op is a `torch.library` custom op in the `v1_engine` namespace with a fake implementation,
so torch.compile traces it as one node and CUDA graphs capture its kernels (no host sync, no host
allocation, launches on the current stream). On CUDA the GEMMs run the CUTLASS sm_90a kernels of
csrc/scaled_mm_*.cu through the C ABI and the quantizers run Triton kernels (triton_quant.py); on
every other device the ops run the PyTorch references below (fp32 math), which are also the
oracle of the tests. A CUDA run without the compiled library raises: a broken build must never
pass for a slow kernel.

Layouts: activations `a` [M, K] row-major; weights `b` [N, K] (the nn.Linear layout, K
contiguous); `y = (a * scale_a) @ (b * scale_b).T + bias` in `out_dtype`.
"""

from __future__ import annotations

import torch

from v1_engine.kernels.fp8_cutlass import (
    block_scaled_mm_cutlass,
    fits_gemv,
    prefers_gemv,
    scaled_mm_cutlass,
    scaled_mm_gemv,
)

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
FP8_MIN_SCALE = 1e-12 / FP8_MAX
"""Floor of every computed scale: an all-zero row quantizes to zeros instead of dividing by 0."""

BLOCK_SIZE = 128
"""Granularity of block-scaled GEMMs: activations per 1x128 group, weights per 128x128 block."""

GEMM_ALIGNMENT = 16
"""K and N must be multiples of this: TMA needs 16-byte aligned rows of e4m3 and of the output."""

INPUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
OUTPUT_DTYPES = (torch.bfloat16, torch.float16)

# --------------------------------------------------------------------------------------------
# PyTorch references (fp32 math): the CPU path and the tests' oracle.
# --------------------------------------------------------------------------------------------


def quantize_with_scale(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x / scale (IEEE division: scale is a tensor on x's device), saturated to the e4m3 range,
    rounded to nearest even: every FP8 quantization reference (activations, the KV-cache write)."""
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def _scale_from_amax(amax: torch.Tensor) -> torch.Tensor:
    """max(amax / 448, FP8_MIN_SCALE) with an IEEE (correctly rounded) fp32 division, as the
    Triton kernels compute it (`div_rn`). The divisor is a tensor on amax's device on purpose:
    CUDA torch turns division by a Python number into multiplication by its rounded reciprocal,
    which is off by one ulp for some amax, and the reference must be exact on every device."""
    amax = amax.float()
    return (amax / torch.full_like(amax, FP8_MAX)).clamp(min=FP8_MIN_SCALE)


def scaled_fp8_quant_ref(
    x: torch.Tensor, scale: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-tensor quantization: static with `scale` ([1] fp32), else scale = amax(|x|) / 448."""
    if scale is None:
        scale = _scale_from_amax(x.abs().amax()).reshape(1)
    return quantize_with_scale(x, scale), scale


def per_token_fp8_quant_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One scale per row (last dim): q [..., K] e4m3, scales [..., 1] fp32."""
    scales = _scale_from_amax(x.abs().amax(dim=-1, keepdim=True))
    return quantize_with_scale(x, scales), scales


def per_token_group_fp8_quant_ref(
    x: torch.Tensor, group_size: int = BLOCK_SIZE
) -> tuple[torch.Tensor, torch.Tensor]:
    """One scale per `group_size` consecutive elements of a row (the last group may be short):
    q [..., K] e4m3, scales [..., ceil(K / group_size)] fp32."""
    k = x.shape[-1]
    num_groups = -(-k // group_size)
    padded = torch.nn.functional.pad(x.float(), (0, num_groups * group_size - k))
    grouped = padded.unflatten(-1, (num_groups, group_size))
    scales = _scale_from_amax(grouped.abs().amax(dim=-1))
    q = quantize_with_scale(grouped, scales.unsqueeze(-1)).flatten(-2)[..., :k]
    return q, scales


def scaled_mm_ref(
    a: torch.Tensor,
    b: torch.Tensor,
    scale_a: torch.Tensor,
    scale_b: torch.Tensor,
    out_dtype: torch.dtype,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """(a @ b.T) accumulated in fp32, then * scale_a (per row or scalar) * scale_b (per column or
    scalar) + bias, the order the kernel's epilogue applies them."""
    acc = a.float() @ b.float().t()
    y = acc * scale_a.float().reshape(-1, 1) * scale_b.float().reshape(1, -1)
    if bias is not None:
        y = y + bias.float()
    return y.to(out_dtype)


def block_scaled_mm_ref(
    a: torch.Tensor,
    b: torch.Tensor,
    scale_a: torch.Tensor,
    scale_b: torch.Tensor,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """Dequantize a per 1x128 group (scale_a [M, ceil(K/128)]) and b per 128x128 block
    (scale_b [ceil(N/128), ceil(K/128)]), then multiply in fp32."""
    k, n = a.shape[1], b.shape[0]
    sa = scale_a.float().repeat_interleave(BLOCK_SIZE, dim=1)[:, :k]
    sb = scale_b.float().repeat_interleave(BLOCK_SIZE, dim=0)[:n]
    sb = sb.repeat_interleave(BLOCK_SIZE, dim=1)[:, :k]
    return ((a.float() * sa) @ (b.float() * sb).t()).to(out_dtype)


# --------------------------------------------------------------------------------------------
# Input validation (user-reachable errors).
# --------------------------------------------------------------------------------------------


def _check_quant_input(x: torch.Tensor) -> None:
    if x.dtype not in INPUT_DTYPES:
        raise ValueError(f"x dtype must be one of {INPUT_DTYPES}, got {x.dtype}")
    if x.dim() < 1 or x.shape[-1] == 0:
        raise ValueError(f"x must have a non-empty last dimension, got shape {tuple(x.shape)}")


def _check_static_scale(scale: torch.Tensor, x: torch.Tensor) -> None:
    if scale.dtype != torch.float32 or scale.numel() != 1:
        raise ValueError(
            f"scale must be a one-element float32 tensor, got {scale.dtype} {tuple(scale.shape)}"
        )
    if scale.device != x.device:
        raise ValueError(f"scale is on {scale.device}, x on {x.device}")


def _check_group_size(group_size: int) -> None:
    if group_size <= 0 or group_size & (group_size - 1):
        raise ValueError(f"group_size must be a positive power of two, got {group_size}")


def _check_gemm_operands(a: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype) -> None:
    for name, t in (("a", a), ("b", b)):
        if t.dtype != FP8_DTYPE:
            raise ValueError(f"{name} must be {FP8_DTYPE}, got {t.dtype}")
        if t.dim() != 2:
            raise ValueError(f"{name} must be 2-D, got shape {tuple(t.shape)}")
        if t.shape[1] > 1 and t.stride(1) != 1:
            raise ValueError(f"{name} must be row-major with K contiguous (stride(1) == 1)")
    if a.shape[1] != b.shape[1]:
        raise ValueError(f"a [M, K] and b [N, K] disagree on K: {a.shape[1]} vs {b.shape[1]}")
    if b.device != a.device:
        raise ValueError(f"b is on {b.device}, a on {a.device}")
    if out_dtype not in OUTPUT_DTYPES:
        raise ValueError(f"out_dtype must be one of {OUTPUT_DTYPES}, got {out_dtype}")


def _tracing() -> bool:
    """True under torch.compile. The number of tokens (a's rows) is then a traced symbol: a
    comparison with it becomes a graph node (a symbolic bool) that Inductor cannot carry from
    one compiled piece to the next, so checks that need it run in eager mode only."""
    return torch.compiler.is_compiling()


def _check_scale(
    name: str,
    scale: torch.Tensor,
    allowed: tuple[int, ...],
    ref: torch.Tensor,
    check_numel: bool = True,
):
    if scale.dtype != torch.float32:
        raise ValueError(f"{name} must be float32, got {scale.dtype}")
    if (check_numel and scale.numel() not in allowed) or scale.dim() > 2:
        raise ValueError(
            f"{name} must hold one value or one per row/column ({allowed}), "
            f"got shape {tuple(scale.shape)}"
        )
    if scale.device != ref.device:
        raise ValueError(f"{name} is on {scale.device}, a on {ref.device}")


def check_scaled_mm_args(
    a: torch.Tensor,
    b: torch.Tensor,
    scale_a: torch.Tensor,
    scale_b: torch.Tensor,
    out_dtype: torch.dtype,
    bias: torch.Tensor | None,
) -> None:
    """Raises ValueError naming the argument that the per-tensor/per-channel GEMM cannot take."""
    _check_gemm_operands(a, b, out_dtype)
    m, n = a.shape[0], b.shape[0]
    if _tracing():
        _check_scale("scale_a", scale_a, (1,), a, check_numel=False)
    else:
        _check_scale("scale_a", scale_a, (1, m), a)
    _check_scale("scale_b", scale_b, (1, n), a)
    if bias is not None and (
        bias.shape != (n,) or bias.dtype != out_dtype or bias.device != a.device
    ):
        raise ValueError(
            f"bias must be a [{n}] {out_dtype} tensor on {a.device}, got "
            f"{tuple(bias.shape)} {bias.dtype} on {bias.device}"
        )


def check_block_scaled_mm_args(
    a: torch.Tensor,
    b: torch.Tensor,
    scale_a: torch.Tensor,
    scale_b: torch.Tensor,
    out_dtype: torch.dtype,
) -> None:
    """Raises ValueError naming the argument that the block-scaled GEMM cannot take."""
    _check_gemm_operands(a, b, out_dtype)
    (m, k), n = a.shape, b.shape[0]
    kb, nb = -(-k // BLOCK_SIZE), -(-n // BLOCK_SIZE)
    for name, scale, shape in (("scale_a", scale_a, (m, kb)), ("scale_b", scale_b, (nb, kb))):
        if name == "scale_a" and _tracing():
            shape_ok = scale.dim() == 2 and scale.shape[1] == kb
        else:
            shape_ok = tuple(scale.shape) == shape
        if scale.dtype != torch.float32 or not shape_ok:
            raise ValueError(
                f"{name} must be a float32 {list(shape)} tensor, got {scale.dtype} "
                f"{list(scale.shape)}"
            )
        if scale.device != a.device:
            raise ValueError(f"{name} is on {scale.device}, a on {a.device}")


def _check_cuda_alignment(a: torch.Tensor, b: torch.Tensor, block_scaled: bool) -> None:
    """Shape limits of the CUTLASS kernels (the references take any shape). Checked inside the
    CUDA implementations of the ops, on real tensors: under torch.compile the wrappers see a
    symbolic row count and fake tensors without data pointers."""
    k, n = a.shape[1], b.shape[0]
    if k % GEMM_ALIGNMENT or n % GEMM_ALIGNMENT:
        raise ValueError(f"K ({k}) and N ({n}) must be multiples of {GEMM_ALIGNMENT} on CUDA")
    if block_scaled and k % BLOCK_SIZE:
        raise ValueError(f"K ({k}) must be a multiple of {BLOCK_SIZE} for block_scaled_mm on CUDA")
    for name, t in (("a", a), ("b", b)):
        if t.shape[0] > 1 and t.stride(0) % GEMM_ALIGNMENT:
            raise ValueError(f"{name} row stride ({t.stride(0)}) must be a multiple of 16")
        if t.data_ptr() % 16:
            raise ValueError(f"{name} must start at a 16-byte aligned address")


# --------------------------------------------------------------------------------------------
# Custom ops.
# --------------------------------------------------------------------------------------------


def _triton_quant():
    """The Triton kernels, imported on first CUDA use so CPU imports never need triton."""
    from v1_engine.kernels import triton_quant

    return triton_quant


@torch.library.custom_op("v1_engine::static_scaled_fp8_quant", mutates_args=())
def _static_scaled_fp8_quant(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return scaled_fp8_quant_ref(x, scale)[0]


@_static_scaled_fp8_quant.register_kernel("cuda")
def _static_scaled_fp8_quant_cuda(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return _triton_quant().static_quant(x, scale)


@_static_scaled_fp8_quant.register_fake
def _static_scaled_fp8_quant_fake(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x, dtype=FP8_DTYPE, memory_format=torch.contiguous_format)


@torch.library.custom_op("v1_engine::dynamic_scaled_fp8_quant", mutates_args=())
def _dynamic_scaled_fp8_quant(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return scaled_fp8_quant_ref(x)


@_dynamic_scaled_fp8_quant.register_kernel("cuda")
def _dynamic_scaled_fp8_quant_cuda(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    # One fused |x| max reduction on the device (no |x| temporary, no host sync).
    scale = _scale_from_amax(torch.linalg.vector_norm(x, float("inf"))).reshape(1)
    return _triton_quant().static_quant(x, scale), scale


@_dynamic_scaled_fp8_quant.register_fake
def _dynamic_scaled_fp8_quant_fake(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    q = torch.empty_like(x, dtype=FP8_DTYPE, memory_format=torch.contiguous_format)
    return q, x.new_empty((1,), dtype=torch.float32)


def scaled_fp8_quant(
    x: torch.Tensor, scale: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-tensor FP8 quantization of x ([..., K], bf16/fp16/fp32).

    Static when `scale` ([1] fp32) is given (it is returned as is), else dynamic with
    scale = max(amax(|x|) / 448, FP8_MIN_SCALE). Returns (q e4m3 contiguous, scale [1] fp32).
    """
    _check_quant_input(x)
    if scale is None:
        return torch.ops.v1_engine.dynamic_scaled_fp8_quant(x)
    _check_static_scale(scale, x)
    return torch.ops.v1_engine.static_scaled_fp8_quant(x, scale.reshape(1)), scale


@torch.library.custom_op("v1_engine::per_token_fp8_quant", mutates_args=())
def _per_token_fp8_quant(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return per_token_fp8_quant_ref(x)


@_per_token_fp8_quant.register_kernel("cuda")
def _per_token_fp8_quant_cuda(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return _triton_quant().per_token_group_quant(x, group_size=None)


@_per_token_fp8_quant.register_fake
def _per_token_fp8_quant_fake(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    q = torch.empty_like(x, dtype=FP8_DTYPE, memory_format=torch.contiguous_format)
    return q, x.new_empty((*x.shape[:-1], 1), dtype=torch.float32)


def per_token_fp8_quant(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic per-token (per-row) FP8 quantization of x [..., K].

    Returns (q [..., K] e4m3, scales [..., 1] fp32) with scale = max(amax(|row|) / 448,
    FP8_MIN_SCALE): the activation side of the per-token x per-channel GEMM.
    """
    _check_quant_input(x)
    return torch.ops.v1_engine.per_token_fp8_quant(x)


@torch.library.custom_op("v1_engine::per_token_group_fp8_quant", mutates_args=())
def _per_token_group_fp8_quant(
    x: torch.Tensor, group_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    return per_token_group_fp8_quant_ref(x, group_size)


@_per_token_group_fp8_quant.register_kernel("cuda")
def _per_token_group_fp8_quant_cuda(
    x: torch.Tensor, group_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    return _triton_quant().per_token_group_quant(x, group_size=group_size)


@_per_token_group_fp8_quant.register_fake
def _per_token_group_fp8_quant_fake(
    x: torch.Tensor, group_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    q = torch.empty_like(x, dtype=FP8_DTYPE, memory_format=torch.contiguous_format)
    num_groups = -(-x.shape[-1] // group_size)
    return q, x.new_empty((*x.shape[:-1], num_groups), dtype=torch.float32)


def per_token_group_fp8_quant(
    x: torch.Tensor, group_size: int = BLOCK_SIZE
) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic FP8 quantization per `group_size` elements of each row of x [..., K] (the
    activation side of the block-scaled GEMM). Returns (q [..., K] e4m3, scales
    [..., ceil(K / group_size)] fp32, row-major)."""
    _check_quant_input(x)
    _check_group_size(group_size)
    return torch.ops.v1_engine.per_token_group_fp8_quant(x, group_size)


@torch.library.custom_op("v1_engine::scaled_mm", mutates_args=())
def _scaled_mm(
    a: torch.Tensor,
    b: torch.Tensor,
    scale_a: torch.Tensor,
    scale_b: torch.Tensor,
    out_dtype: torch.dtype,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    return scaled_mm_ref(a, b, scale_a, scale_b, out_dtype, bias)


@_scaled_mm.register_kernel("cuda")
def _scaled_mm_cuda(
    a: torch.Tensor,
    b: torch.Tensor,
    scale_a: torch.Tensor,
    scale_b: torch.Tensor,
    out_dtype: torch.dtype,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    _check_cuda_alignment(a, b, block_scaled=False)
    from v1_engine.kernels import fp8_launch  # triton imported on CUDA use only
    from v1_engine.kernels import triton_gemv_fp8 as skinny

    m, n, k = a.shape[0], b.shape[0], a.shape[1]
    # Decode-sized M on a measured shape: the GEMV of csrc/fp8_gemv.cu, or the skinny Triton GEMM.
    if prefers_gemv(m, n, k) and fits_gemv(a, b, out_dtype, bias):
        return scaled_mm_gemv(a, b, scale_a, scale_b, out_dtype, bias)
    if skinny.fits_fp8_skinny(a, b, bias) and fp8_launch.prefers_fp8_skinny("channel", m, n, k):
        return skinny.fp8_skinny_gemm(a, b, scale_a, scale_b, out_dtype, bias)
    return scaled_mm_cutlass(a, b, scale_a, scale_b, out_dtype, bias)


@_scaled_mm.register_fake
def _scaled_mm_fake(
    a: torch.Tensor,
    b: torch.Tensor,
    scale_a: torch.Tensor,
    scale_b: torch.Tensor,
    out_dtype: torch.dtype,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    return a.new_empty((a.shape[0], b.shape[0]), dtype=out_dtype)


def scaled_mm(
    a: torch.Tensor,
    b: torch.Tensor,
    scale_a: torch.Tensor,
    scale_b: torch.Tensor,
    out_dtype: torch.dtype,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """y [M, N] = (a * scale_a) @ (b * scale_b).T + bias in out_dtype (bf16/fp16).

    a: e4m3 [M, K] row-major; b: e4m3 [N, K] (K contiguous); scale_a: fp32 [1] (per tensor) or
    [M, 1] (per token); scale_b: fp32 [1] or [N, 1] (per output channel); bias: [N] out_dtype.
    On CUDA, K and N must be multiples of 16.
    """
    check_scaled_mm_args(a, b, scale_a, scale_b, out_dtype, bias)
    return torch.ops.v1_engine.scaled_mm(a, b, scale_a, scale_b, out_dtype, bias)


@torch.library.custom_op("v1_engine::block_scaled_mm", mutates_args=())
def _block_scaled_mm(
    a: torch.Tensor,
    b: torch.Tensor,
    scale_a: torch.Tensor,
    scale_b: torch.Tensor,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    return block_scaled_mm_ref(a, b, scale_a, scale_b, out_dtype)


@_block_scaled_mm.register_kernel("cuda")
def _block_scaled_mm_cuda(
    a: torch.Tensor,
    b: torch.Tensor,
    scale_a: torch.Tensor,
    scale_b: torch.Tensor,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    _check_cuda_alignment(a, b, block_scaled=True)
    # Decode-sized M on a measured shape: the skinny Triton GEMM (triton imported on CUDA use).
    from v1_engine.kernels import fp8_launch
    from v1_engine.kernels import triton_gemv_fp8 as skinny

    m, n, k = a.shape[0], b.shape[0], a.shape[1]
    if skinny.fits_fp8_skinny(a, b) and fp8_launch.prefers_fp8_skinny("block", m, n, k):
        return skinny.fp8_block_skinny_gemm(a, b, scale_a, scale_b, out_dtype)
    return block_scaled_mm_cutlass(a, b, scale_a, scale_b, out_dtype)


@_block_scaled_mm.register_fake
def _block_scaled_mm_fake(
    a: torch.Tensor,
    b: torch.Tensor,
    scale_a: torch.Tensor,
    scale_b: torch.Tensor,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    return a.new_empty((a.shape[0], b.shape[0]), dtype=out_dtype)


def block_scaled_mm(
    a: torch.Tensor,
    b: torch.Tensor,
    scale_a: torch.Tensor,
    scale_b: torch.Tensor,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """y [M, N] in out_dtype from block-scaled e4m3 operands (the DeepSeek-V3 layout).

    a: [M, K] with scale_a fp32 [M, ceil(K/128)] (one per 1x128 group of a row, from
    per_token_group_fp8_quant); b: [N, K] with scale_b fp32 [ceil(N/128), ceil(K/128)] (one per
    128x128 block). On CUDA, N must be a multiple of 16 and K of 128.
    """
    check_block_scaled_mm_args(a, b, scale_a, scale_b, out_dtype)
    return torch.ops.v1_engine.block_scaled_mm(a, b, scale_a, scale_b, out_dtype)
