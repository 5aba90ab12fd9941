"""The optional FlashAttention backend: our K/V write, then one paged varlen FlashAttention call.

It runs only where the optional `vllm_flash_attn` package imports; nothing requires it and auto
selection never picks it (the Triton backend is the tested CUDA path). The package's
`flash_attn_varlen_func` takes a paged cache as K and V tensors [num_blocks, block_size, Hkv, D]
with a dense last dim: our cache [2, num_blocks, block_size, Hkv, D] is exactly those two stacked,
so `kv_cache[0]` / `kv_cache[1]` are passed as views and nothing is copied per step. New K/V go
in through the same write as the other backends (`write_to_kv_cache`).

Every tensor handed to the library is one of the step's metadata tensors, and the host reads only
python ints (the longest query and sequence): a decode graph that keeps the metadata in persistent
buffers can capture this backend, as it does the Triton one. The FlashAttention-3 scheduler
metadata is left to the library, which builds it inside the call (so inside a captured graph too).

Refused, with a ValueError naming the setting: an fp8 cache (the library reads fp8 K/V only with
an fp8 query and per-request descales, and our layers keep the query in the model dtype), a cache
that is not float16/bfloat16, block sizes that are not a multiple of 16, head sizes the kernels do
not build, and a package too old to take `seqused_k` / `block_table` / `out`.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable
from types import ModuleType

import torch

from v1_engine.attention.backend import AttentionMetadata
from v1_engine.kernels.cache_ops import FP8_DTYPE, write_to_kv_cache

FLASH_ATTN_MODULE = "vllm_flash_attn"
FA_VERSIONS = (2, 3)
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16)
SUPPORTED_KV_CACHE_DTYPES = ("auto",)
BLOCK_SIZE_MULTIPLE = 16
HEAD_SIZE_MULTIPLE = 8
MAX_HEAD_SIZE = 256
REQUIRED_PARAMETERS = ("seqused_k", "block_table", "out")
"""Arguments of the paged varlen API this backend calls; older builds of the package lack them."""


def install_hint() -> str:
    """How to get the optional package: said by every error about it being absent or too old."""
    return (
        f"install the optional {FLASH_ATTN_MODULE} package (pip distribution vllm-flash-attn) "
        f"built for your torch and CUDA, whose flash_attn_varlen_func takes "
        f"{', '.join(REQUIRED_PARAMETERS)}; or use attention_backend 'triton'"
    )


def import_flash_attn() -> ModuleType:
    """The optional package; ValueError with the install hint when it does not import."""
    try:
        return importlib.import_module(FLASH_ATTN_MODULE)
    except ImportError as e:
        raise ValueError(
            f"attention_backend 'flash_attn' needs {FLASH_ATTN_MODULE}, which is not importable "
            f"({e}): {install_hint()}"
        ) from e


def flash_attn_available() -> bool:
    """Whether the optional package imports here (it is never required)."""
    try:
        importlib.import_module(FLASH_ATTN_MODULE)
    except ImportError:
        return False
    return True


def _parameter_names(func: Callable) -> set[str] | None:
    """The keyword names `func` takes, or None when its signature cannot be read (a C function)."""
    try:
        return set(inspect.signature(func).parameters)
    except (TypeError, ValueError):
        return None


def _varlen_func(module: ModuleType) -> tuple[Callable, bool]:
    """The package's paged varlen entry point, and whether it takes `fa_version`."""
    func = getattr(module, "flash_attn_varlen_func", None)
    if func is None:
        raise ValueError(f"{FLASH_ATTN_MODULE} has no flash_attn_varlen_func: {install_hint()}")
    names = _parameter_names(func)
    if names is None:
        return func, hasattr(module, "is_fa_version_supported")
    missing = [p for p in REQUIRED_PARAMETERS if p not in names]
    if missing:
        raise ValueError(
            f"the installed {FLASH_ATTN_MODULE} is too old: flash_attn_varlen_func lacks "
            f"{missing}: {install_hint()}"
        )
    return func, "fa_version" in names


def _unsupported_reason(module: ModuleType, version: int, device: torch.device) -> str:
    reason = getattr(module, "fa_version_unsupported_reason", None)
    return str(reason(version, device)) if reason is not None else "not supported on this device"


def choose_fa_version(
    module: ModuleType,
    device: torch.device | None,
    requested: int | None = None,
    accepts_version: bool = True,
) -> int | None:
    """The FlashAttention version to run: `requested`, else 3 on Hopper (sm_90) when the package
    says it is supported there, else 2. None when the package takes no `fa_version` (it runs its
    only version). Support is asked only where the package can answer (`is_fa_version_supported`)
    and the device is CUDA; otherwise the package's default, 2, is assumed."""
    if requested is not None and requested not in FA_VERSIONS:
        raise ValueError(f"fa_version must be one of {FA_VERSIONS} or None, got {requested!r}")
    if not accepts_version:
        if requested is not None:
            raise ValueError(
                f"the installed {FLASH_ATTN_MODULE} takes no fa_version: leave fa_version None"
            )
        return None
    is_supported = getattr(module, "is_fa_version_supported", None)
    if is_supported is None or device is None or device.type != "cuda":
        return 2 if requested is None else requested
    if requested is not None:
        if not is_supported(requested, device):
            raise ValueError(
                f"fa_version {requested} cannot run on {device}: "
                f"{_unsupported_reason(module, requested, device)}"
            )
        return requested
    if torch.cuda.get_device_capability(device)[0] == 9 and is_supported(3, device):
        return 3
    if is_supported(2, device):
        return 2
    raise ValueError(
        f"attention_backend 'flash_attn' cannot run on {device}: "
        f"{_unsupported_reason(module, 2, device)}; use attention_backend 'triton'"
    )


def check_flash_attn_inputs(query: torch.Tensor, kv_cache: torch.Tensor) -> None:
    """Raises ValueError naming the setting that puts this step outside what the kernels take."""
    if kv_cache.dtype == FP8_DTYPE:
        raise ValueError(
            f"kv_cache_dtype must be one of {SUPPORTED_KV_CACHE_DTYPES} with attention_backend "
            "'flash_attn' (an fp8 cache needs an fp8 query and per-request descales), got an fp8 "
            "cache: use kv_cache_dtype 'auto', or attention_backend 'triton' for an fp8 cache"
        )
    if kv_cache.dtype not in SUPPORTED_DTYPES:
        raise ValueError(
            f"dtype must be one of ('float16', 'bfloat16') with attention_backend 'flash_attn', "
            f"got a {kv_cache.dtype} cache"
        )
    if query.dtype != kv_cache.dtype:
        raise ValueError(f"query dtype {query.dtype} differs from kv_cache's {kv_cache.dtype}")
    if kv_cache.dim() != 5 or kv_cache.shape[0] != 2 or kv_cache.stride(-1) != 1:
        raise ValueError(
            "attention_backend 'flash_attn' needs kv_cache [2, num_blocks, block_size, "
            f"num_kv_heads, head_size] with a dense last dim, got shape {tuple(kv_cache.shape)} "
            f"strides {kv_cache.stride()}"
        )
    block_size, head_size = kv_cache.shape[2], kv_cache.shape[4]
    if block_size % BLOCK_SIZE_MULTIPLE:
        raise ValueError(
            f"block_size must be a multiple of {BLOCK_SIZE_MULTIPLE} (16, 32, 64 or 128) with "
            f"attention_backend 'flash_attn', got {block_size}"
        )
    if head_size % HEAD_SIZE_MULTIPLE or head_size > MAX_HEAD_SIZE:
        raise ValueError(
            f"attention_backend 'flash_attn' needs a head size that is a multiple of "
            f"{HEAD_SIZE_MULTIPLE} and at most {MAX_HEAD_SIZE}, got {head_size}: use "
            "attention_backend 'triton'"
        )


class FlashAttentionBackend:
    """AttentionBackend on the optional package's paged varlen FlashAttention (2 or 3)."""

    name = "flash_attn"
    supports_cudagraph = True
    """Only metadata tensors and python ints fixed at capture reach the library: capturable."""

    def __init__(self, device: torch.device | None = None, fa_version: int | None = None) -> None:
        """`device` is where the backend runs (its capability picks the version); `fa_version`
        pins 2 or 3, None picks (3 on Hopper when supported, else 2)."""
        module = import_flash_attn()
        self._varlen, accepts_version = _varlen_func(module)
        self.fa_version = choose_fa_version(module, device, fa_version, accepts_version)
        self._version_kwargs = {} if self.fa_version is None else {"fa_version": self.fa_version}

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
        scale: float,
        output: torch.Tensor,
        k_scale: torch.Tensor | None = None,
        v_scale: torch.Tensor | None = None,
    ) -> None:
        """See AttentionBackend.forward. The scales are unused: an fp8 cache is refused."""
        check_flash_attn_inputs(query, kv_cache)
        num_actual = metadata.num_actual_tokens
        write_to_kv_cache(
            key[:num_actual],
            value[:num_actual],
            kv_cache,
            metadata.slot_mapping[:num_actual],
        )
        self._varlen(
            q=query[:num_actual],
            k=kv_cache[0],
            v=kv_cache[1],
            max_seqlen_q=metadata.max_query_len,
            cu_seqlens_q=metadata.query_start_loc,
            max_seqlen_k=metadata.max_seq_len,
            seqused_k=metadata.seq_lens,
            softmax_scale=scale,
            causal=True,
            block_table=metadata.block_table,
            out=output[:num_actual],
            **self._version_kwargs,
        )
        # Padding rows (a batch padded for a captured graph) get zeros, never stale values.
        if output.shape[0] > num_actual:
            output[num_actual:].zero_()
