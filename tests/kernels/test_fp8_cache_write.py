"""The FP8 K/V cache write: quantize into e4m3 with per-layer scales and scatter by slot.

The PyTorch path (CPU, and the op's reference) is checked against the e4m3 error bound and a
per-token loop; the Triton kernel runs under the interpreter on the CPU (on a GPU: compiled) and
must store exactly the values the PyTorch path stores. Caches are poisoned with NaN first, so a
missed slot or a write for a padding token shows up.
"""

from __future__ import annotations

import pytest
import torch

# On the CPU the kernels run under Triton's interpreter, which tests/conftest.py turns on
# before any kernel module is imported.
pytest.importorskip("triton")

from v1_engine.kernels.cache_ops import dequantize_fp8, quantize_fp8, write_to_kv_cache
from v1_engine.kernels.fp8 import FP8_DTYPE, FP8_MAX
from v1_engine.kernels.triton_cache import quantize_and_cache

_CUDA = torch.cuda.is_available()
E4M3_VALUES = torch.arange(256, dtype=torch.uint8).view(FP8_DTYPE).float()
E4M3_VALUES = E4M3_VALUES[~E4M3_VALUES.isnan()]
WRITERS = pytest.mark.parametrize(
    "write", [write_to_kv_cache, torch.ops.v1_engine.reshape_and_cache], ids=["function", "op"]
)


def poisoned_fp8_cache(
    num_blocks: int, block_size: int, num_kv_heads: int, head_size: int, device: str = "cpu"
) -> torch.Tensor:
    shape = (2, num_blocks, block_size, num_kv_heads, head_size)
    return torch.full(shape, float("nan"), device=device).to(FP8_DTYPE)


def scales(k: float, v: float, device: str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    return torch.tensor([k], device=device), torch.tensor([v], device=device)


def expected_after_write(
    cache: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    slots: list[int],
    k_scale: float,
    v_scale: float,
) -> torch.Tensor:
    """The dequantized cache after the write, one token at a time (float32, NaN = unwritten)."""
    expected = cache.float().clone()
    block_size = cache.shape[2]
    for token, slot in enumerate(slots):
        if slot < 0:
            continue
        block, offset = divmod(slot, block_size)
        for index, (x, s) in enumerate(((key, k_scale), (value, v_scale))):
            quantized = (x[token].float() / s).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
            expected[index, block, offset] = quantized.float()
    return expected


def assert_same_values(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """Equal as values (NaN where unwritten); -0 and +0 count as equal."""
    torch.testing.assert_close(actual.float().cpu(), expected.cpu(), rtol=0, atol=0, equal_nan=True)


# ---- the PyTorch path ----------------------------------------------------------------------------


def test_round_trip_error_is_within_e4m3_precision() -> None:
    """Round to nearest with 3 mantissa bits: |x - deq(q(x))| <= 2^-4 |x| in the normal range,
    and at most half the subnormal spacing (2^-10 * scale) below it (|x| <= 448 * scale)."""
    gen = torch.Generator().manual_seed(0)
    values = torch.randn(4096, generator=gen) * torch.logspace(-3, 2, 4096)
    for scale in (1.0, 0.05, 7.0):
        s = torch.tensor([scale])
        x = values[values.abs() <= FP8_MAX * scale]
        assert x.numel() > 3000
        error = (dequantize_fp8(quantize_fp8(x, s), s) - x).abs()
        bound = torch.maximum(x.abs() * 2.0**-4, torch.full_like(x, scale * 2.0**-10))
        assert bool((error <= bound * (1 + 1e-6)).all()), float((error / bound).max())
        # The bound is tight: rounding really costs precision (this is not a 16-bit copy).
        assert float((error / x.abs().clamp_min(1e-30)).max()) > 2.0**-5


def test_values_beyond_the_range_saturate() -> None:
    s = torch.tensor([0.5])
    x = torch.tensor([1e4, -1e4, 224.0, -300.0])
    assert dequantize_fp8(quantize_fp8(x, s), s).tolist() == [224.0, -224.0, 224.0, -224.0]


@WRITERS
def test_fp8_write_quantizes_into_exactly_the_given_slots(write) -> None:
    gen = torch.Generator().manual_seed(1)
    num_tokens, num_kv_heads, head_size = 9, 2, 16
    key, value = torch.randn(2, num_tokens + 2, num_kv_heads, head_size, generator=gen) * 4
    slots = torch.randperm(6 * 4, generator=gen)[:num_tokens].tolist()
    slots[3] = -1  # padding: skipped
    cache = poisoned_fp8_cache(6, 4, num_kv_heads, head_size)
    expected = expected_after_write(cache, key, value, slots, 0.25, 2.0)
    k_scale, v_scale = scales(0.25, 2.0)

    write(key, value, cache, torch.tensor(slots), k_scale, v_scale)

    assert_same_values(cache, expected)
    written = ~cache.float().isnan().all(dim=(-1, -2))
    assert written.sum().item() == 2 * (num_tokens - 1)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fp8_write_takes_16_bit_inputs(dtype) -> None:
    gen = torch.Generator().manual_seed(2)
    key, value = torch.randn(2, 5, 1, 8, generator=gen).to(dtype)
    cache = poisoned_fp8_cache(2, 4, 1, 8)
    expected = expected_after_write(cache, key, value, [0, 1, 2, 5, 7], 1.0, 1.0)
    write_to_kv_cache(key, value, cache, torch.tensor([0, 1, 2, 5, 7]), *scales(1.0, 1.0))
    assert_same_values(cache, expected)


def test_fp8_write_rejects_missing_or_malformed_scales() -> None:
    key = value = torch.randn(2, 1, 8)
    cache = poisoned_fp8_cache(2, 4, 1, 8)
    slots = torch.tensor([0, 1])
    with pytest.raises(ValueError, match="needs k_scale"):
        write_to_kv_cache(key, value, cache, slots)
    with pytest.raises(ValueError, match="v_scale must be a float32 tensor of shape"):
        write_to_kv_cache(key, value, cache, slots, torch.ones(1), torch.ones(1, 1))
    with pytest.raises(ValueError, match="key dtype must be one of"):
        write_to_kv_cache(key.double(), value, cache, slots, *scales(1.0, 1.0))


def test_op_with_fp8_cache_passes_opcheck() -> None:
    """Schema, fake impl and dispatch agree, so torch.compile can trace the fp8 write."""
    gen = torch.Generator().manual_seed(3)
    key, value = torch.randn(2, 6, 2, 8, generator=gen)
    cache = poisoned_fp8_cache(3, 4, 2, 8).view(torch.uint8).zero_().view(FP8_DTYPE)
    args = (key, value, cache, torch.tensor([3, 0, -1, 7, 8, 11]), *scales(0.5, 1.5))
    torch.library.opcheck(
        torch.ops.v1_engine.reshape_and_cache.default,
        args,
        test_utils=("test_faketensor",),
    )


# ---- the Triton kernel --------------------------------------------------------------------------


def _triton_case(
    num_tokens: int,
    num_kv_heads: int,
    head_size: int,
    dtype: torch.dtype,
    device: str,
    seed: int,
) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """K and V as strided slices of a fused qkv tensor, values over a wide range of magnitudes,
    and scattered slots with some padding."""
    gen = torch.Generator().manual_seed(seed)
    magnitudes = torch.logspace(-4, 3, head_size)[torch.randperm(head_size, generator=gen)]
    qkv = torch.randn(num_tokens + 1, 3 * num_kv_heads, head_size, generator=gen) * magnitudes
    qkv = qkv.to(device=device, dtype=dtype)
    key, value = qkv[:, num_kv_heads : 2 * num_kv_heads], qkv[:, 2 * num_kv_heads :]
    slots = torch.randperm(4 * num_tokens, generator=gen)[:num_tokens].tolist()
    for index in range(0, num_tokens, 5):
        slots[index] = -1
    return key, value, slots


@pytest.mark.skipif(_CUDA, reason="the gpu case covers this on a CUDA machine")
@pytest.mark.parametrize(
    "num_kv_heads,head_size,dtype",
    [(3, 24, torch.float32), (2, 16, torch.bfloat16), (1, 64, torch.float16)],
)
def test_interpreter_triton_write_matches_pytorch_path(num_kv_heads, head_size, dtype) -> None:
    key, value, slots = _triton_case(11, num_kv_heads, head_size, dtype, "cpu", seed=4)
    k_scale, v_scale = scales(0.37, 2.5)
    by_triton = poisoned_fp8_cache(11, 4, num_kv_heads, head_size)
    by_torch = by_triton.clone()
    quantize_and_cache(key, value, by_triton, torch.tensor(slots), k_scale, v_scale)
    write_to_kv_cache(key, value, by_torch, torch.tensor(slots), k_scale, v_scale)
    assert_same_values(by_triton, by_torch.float())
    assert by_triton.float().isnan().any()  # padding and unused slots stay untouched


@pytest.mark.skipif(_CUDA, reason="the gpu case covers this on a CUDA machine")
def test_interpreter_triton_rounds_every_e4m3_midpoint_to_even() -> None:
    """Every e4m3 value, every midpoint between neighbours (a tie) and values just off them:
    the kernel's rounding must equal torch's cast to float8_e4m3fn, saturation included."""
    neighbours = (E4M3_VALUES.sort().values[:-1] + E4M3_VALUES.sort().values[1:]) / 2
    x = torch.cat([E4M3_VALUES, neighbours, neighbours * 1.0001, neighbours * 0.9999])
    x = torch.cat([x, torch.tensor([500.0, -1e6, 0.0])])
    x = torch.nn.functional.pad(x, (0, -x.numel() % 16)).view(-1, 1, 16)
    one = torch.ones(1)
    cache = poisoned_fp8_cache(x.shape[0], 1, 1, 16)
    quantize_and_cache(x, x, cache, torch.arange(x.shape[0]), one, one)
    assert_same_values(cache[0].reshape(-1, 1, 16), quantize_fp8(x, one).float())


# ---- GPU: the compiled kernel through the op -----------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("num_kv_heads,head_size", [(8, 128), (3, 64), (1, 256), (4, 80)])
def test_gpu_op_matches_pytorch_path(dtype, num_kv_heads, head_size) -> None:
    key, value, slots = _triton_case(300, num_kv_heads, head_size, dtype, "cuda", seed=5)
    k_scale, v_scale = scales(0.11, 3.0, "cuda")
    on_gpu = poisoned_fp8_cache(300, 4, num_kv_heads, head_size, "cuda")
    on_cpu = on_gpu.cpu()
    torch.ops.v1_engine.reshape_and_cache(
        key, value, on_gpu, torch.tensor(slots, device="cuda"), k_scale, v_scale
    )
    write_to_kv_cache(
        key.cpu(), value.cpu(), on_cpu, torch.tensor(slots), k_scale.cpu(), v_scale.cpu()
    )
    assert_same_values(on_gpu, on_cpu.float())


@pytest.mark.gpu
def test_gpu_graph_replay_reads_the_current_scale() -> None:
    """A captured write follows a scale changed after capture (pointers, not baked values)."""
    key, value, slots = _triton_case(16, 8, 128, torch.bfloat16, "cuda", seed=6)
    slot_tensor = torch.tensor(slots, device="cuda")
    k_scale, v_scale = scales(1.0, 1.0, "cuda")
    cache = poisoned_fp8_cache(16, 4, 8, 128, "cuda")
    write_to_kv_cache(key, value, cache, slot_tensor, k_scale, v_scale)  # warm-up / compile
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        write_to_kv_cache(key, value, cache, slot_tensor, k_scale, v_scale)
    k_scale.fill_(0.5)
    v_scale.fill_(4.0)
    graph.replay()
    expected = expected_after_write(
        poisoned_fp8_cache(16, 4, 8, 128), key.cpu(), value.cpu(), slots, 0.5, 4.0
    )
    assert_same_values(cache, expected)
