"""Writing new K/V into the paged cache.

`torch.ops.v1_engine.reshape_and_cache` is a torch.library custom op, so torch.compile traces it
as one opaque node (through its fake impl) and CUDA graphs capture its kernel. On CUDA it runs the
compiled kernel of csrc/cache_kernels.cu through the C ABI (v1_engine/kernels/_C.py); on every
other device it runs the PyTorch implementation below (eager CPU calls that implementation
directly). There is deliberately no silent CUDA fallback: a CUDA run without the compiled library
raises, so a broken build is never mistaken for a slow kernel.

FP8 cache. A float8_e4m3fn cache stores `clamp(x / scale, -448, 448)` rounded to nearest even,
with one float32 scale per layer for K and one for V (`k_scale`, `v_scale`: [1] tensors on the
cache's device, read by the kernels from memory so a captured CUDA graph never bakes a value in).
On CUDA the quantizing write is the Triton kernel of triton_cache.py (the compiled kernel copies
same-dtype elements only); elsewhere the PyTorch implementation below, which rounds identically.
"""

from __future__ import annotations

import torch

from v1_engine.kernels import _C
from v1_engine.kernels.fp8 import FP8_DTYPE, quantize_with_scale

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32, FP8_DTYPE)
INPUT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def write_to_kv_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """key/value [T, Hkv, D] into kv_cache [2, num_blocks, block_size, Hkv, D] at slot_mapping [T].

    key/value may hold more rows than slot_mapping (a padded batch): only the first T are written.
    A negative slot marks a padding token and is skipped. An fp8 cache needs k_scale / v_scale
    (float32 [1]); other caches ignore them.
    """
    if kv_cache.is_cpu and not torch.compiler.is_compiling():
        # Eager CPU runs the op's own implementation without the dispatcher round trip, which
        # costs more than the copy itself (about 60 us per layer per step at decode sizes).
        _reshape_and_cache_torch(key, value, kv_cache, slot_mapping, k_scale, v_scale)
        return
    torch.ops.v1_engine.reshape_and_cache(key, value, kv_cache, slot_mapping, k_scale, v_scale)


quantize_fp8 = quantize_with_scale
"""x / scale in e4m3 (saturated at +-448, rounded to nearest even): the reference of the write."""


def dequantize_fp8(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """e4m3 values back to float32: x * scale, what every attention reader computes."""
    return x.float() * scale


def check_cache_args(
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """Raises ValueError naming the argument that does not fit the cache layout."""
    if kv_cache.dim() != 5 or kv_cache.shape[0] != 2:
        raise ValueError(
            "kv_cache must have shape [2, num_blocks, block_size, num_kv_heads, head_size], "
            f"got {tuple(kv_cache.shape)}"
        )
    if not kv_cache.is_contiguous():
        raise ValueError("kv_cache must be contiguous")
    if kv_cache.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"kv_cache dtype must be one of {SUPPORTED_DTYPES}, got {kv_cache.dtype}")
    if slot_mapping.dim() != 1 or slot_mapping.dtype != torch.int64:
        raise ValueError(
            f"slot_mapping must be a 1-D int64 tensor, got {slot_mapping.dim()}-D "
            f"{slot_mapping.dtype}"
        )
    heads_and_size = tuple(kv_cache.shape[3:])
    num_tokens = slot_mapping.shape[0]
    for name, tensor in (("key", key), ("value", value)):
        if tensor.dim() != 3 or tuple(tensor.shape[1:]) != heads_and_size:
            raise ValueError(
                f"{name} must have shape [num_tokens, {heads_and_size[0]}, {heads_and_size[1]}] "
                f"to match kv_cache, got {tuple(tensor.shape)}"
            )
        if tensor.shape[0] < num_tokens:
            raise ValueError(
                f"{name} has {tensor.shape[0]} rows, fewer than slot_mapping's {num_tokens}"
            )
        if kv_cache.dtype == FP8_DTYPE:
            if tensor.dtype not in INPUT_DTYPES:
                raise ValueError(f"{name} dtype must be one of {INPUT_DTYPES}, got {tensor.dtype}")
        elif tensor.dtype != kv_cache.dtype:
            raise ValueError(
                f"{name} dtype {tensor.dtype} differs from kv_cache's {kv_cache.dtype}"
            )
    for name, tensor in (("key", key), ("value", value), ("slot_mapping", slot_mapping)):
        if tensor.device != kv_cache.device:
            raise ValueError(f"{name} is on {tensor.device}, kv_cache on {kv_cache.device}")
    if kv_cache.dtype == FP8_DTYPE:
        check_fp8_scales(k_scale, v_scale, kv_cache.device)


def check_fp8_scales(
    k_scale: torch.Tensor | None, v_scale: torch.Tensor | None, device: torch.device
) -> None:
    """An fp8 cache needs both scales as float32 [1] tensors on its device."""
    for name, scale in (("k_scale", k_scale), ("v_scale", v_scale)):
        if scale is None:
            raise ValueError(f"an fp8 kv_cache needs {name} (a float32 tensor of shape [1])")
        if scale.shape != (1,) or scale.dtype != torch.float32 or scale.device != device:
            raise ValueError(
                f"{name} must be a float32 tensor of shape [1] on {device}, got "
                f"{scale.dtype} {tuple(scale.shape)} on {scale.device}"
            )


@torch.library.custom_op("v1_engine::reshape_and_cache", mutates_args=("kv_cache",))
def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """PyTorch implementation (CPU and any device without a compiled kernel)."""
    _reshape_and_cache_torch(key, value, kv_cache, slot_mapping, k_scale, v_scale)


def _reshape_and_cache_torch(
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None,
    v_scale: torch.Tensor | None,
) -> None:
    check_cache_args(key, value, kv_cache, slot_mapping, k_scale, v_scale)
    num_tokens = slot_mapping.shape[0]
    key, value = key[:num_tokens], value[:num_tokens]
    flat = kv_cache.view(2, -1, kv_cache.shape[-2], kv_cache.shape[-1])
    if bool((slot_mapping < 0).any()):  # padding tokens present: drop them first
        keep = slot_mapping >= 0
        slot_mapping, key, value = slot_mapping[keep], key[keep], value[keep]
    if kv_cache.dtype == FP8_DTYPE:
        # index_copy_ has no fp8 kernel on the CPU: copy the bytes.
        key = quantize_fp8(key, k_scale).view(torch.uint8)
        value = quantize_fp8(value, v_scale).view(torch.uint8)
        flat = flat.view(torch.uint8)
    flat[0].index_copy_(0, slot_mapping, key)
    flat[1].index_copy_(0, slot_mapping, value)


@reshape_and_cache.register_kernel("cuda")
def _reshape_and_cache_cuda(
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    check_cache_args(key, value, kv_cache, slot_mapping, k_scale, v_scale)
    if kv_cache.dtype == FP8_DTYPE:
        # Imported here: the bf16/fp16 path and CPU-only installs never need triton.
        from v1_engine.kernels.triton_cache import quantize_and_cache

        with torch.cuda.device(kv_cache.device):
            quantize_and_cache(key, value, kv_cache, slot_mapping.contiguous(), k_scale, v_scale)
        return
    lib = _C.load_library()
    if lib is None:
        raise RuntimeError(
            f"v1_engine.reshape_and_cache on CUDA needs the compiled kernel library, but "
            f"{_C.library_path()} does not exist: build it with `pip install -e .` where nvcc is "
            f"on PATH, or point {_C.LIBRARY_ENV_VAR} at a built {_C.LIBRARY_FILENAME}"
        )
    from v1_engine.kernels.pdl import use_pdl  # CUDA only, where triton is installed

    key, value = _with_dense_rows(key), _with_dense_rows(value)
    slot_mapping = slot_mapping.contiguous()
    num_blocks, block_size, num_kv_heads, head_size = kv_cache.shape[1:]
    with torch.cuda.device(kv_cache.device):
        stream = torch.cuda.current_stream().cuda_stream
        code = lib.v1e_reshape_and_cache(
            key.data_ptr(),
            value.data_ptr(),
            kv_cache.data_ptr(),
            slot_mapping.data_ptr(),
            slot_mapping.shape[0],
            num_kv_heads,
            head_size,
            key.stride(0),
            value.stride(0),
            num_blocks,
            block_size,
            _C.DTYPE_CODES[kv_cache.dtype],
            int(use_pdl(kv_cache.device)),
            stream,
        )
    _C.check_status(lib, code, "v1e_reshape_and_cache")


@reshape_and_cache.register_fake
def _reshape_and_cache_fake(
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    check_cache_args(key, value, kv_cache, slot_mapping, k_scale, v_scale)


def _with_dense_rows(x: torch.Tensor) -> torch.Tensor:
    """x itself when each row's [Hkv, D] is dense (the kernel takes only a row stride), else a copy.

    A K or V slice of a fused qkv projection qualifies, so the common case copies nothing.
    """
    num_heads, head_size = x.shape[1], x.shape[2]
    dense = (
        (head_size == 1 or x.stride(2) == 1)
        and (num_heads == 1 or x.stride(1) == head_size)
        and x.stride(0) >= num_heads * head_size
    )
    return x if dense else x.contiguous()
