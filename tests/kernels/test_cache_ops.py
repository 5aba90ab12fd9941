"""reshape_and_cache: the custom op writes each token's K/V into exactly its slot.

Every case poisons the cache with NaN first and compares the whole cache with a plain Python loop,
so a write to a wrong slot, a missed slot or a write for a padding token all show up.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from v1_engine.kernels import _C
from v1_engine.kernels.cache_ops import write_to_kv_cache

NUM_BLOCKS = 6
BLOCK_SIZE = 4
# write_to_kv_cache skips the dispatcher on eager CPU; the op itself must behave the same.
WRITERS = pytest.mark.parametrize(
    "write", [write_to_kv_cache, torch.ops.v1_engine.reshape_and_cache], ids=["function", "op"]
)


def poisoned_cache(
    num_kv_heads: int, head_size: int, dtype: torch.dtype, device: str = "cpu"
) -> torch.Tensor:
    shape = (2, NUM_BLOCKS, BLOCK_SIZE, num_kv_heads, head_size)
    return torch.full(shape, float("nan"), dtype=dtype, device=device)


def reference_write(
    key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slots: list[int]
) -> torch.Tensor:
    """The expected cache after the write, computed one token at a time."""
    expected = kv_cache.clone()
    for token, slot in enumerate(slots):
        if slot < 0:
            continue
        block, offset = divmod(slot, BLOCK_SIZE)
        expected[0, block, offset] = key[token]
        expected[1, block, offset] = value[token]
    return expected


def scattered_slots(num_tokens: int, num_padding: int, generator: torch.Generator) -> list[int]:
    """Distinct random slots across the whole cache, with `num_padding` of them replaced by -1."""
    slots = torch.randperm(NUM_BLOCKS * BLOCK_SIZE, generator=generator)[:num_tokens].tolist()
    for index in torch.randperm(num_tokens, generator=generator)[:num_padding].tolist():
        slots[index] = -1
    return slots


def assert_same_cache(actual: torch.Tensor, expected: torch.Tensor) -> None:
    torch.testing.assert_close(actual, expected, rtol=0, atol=0, equal_nan=True)


@WRITERS
def test_writes_exactly_the_given_slots(write: Callable[..., None]) -> None:
    gen = torch.Generator().manual_seed(0)
    key, value = torch.randn(2, 9, 2, 16, generator=gen)
    slots = scattered_slots(9, num_padding=0, generator=gen)
    cache = poisoned_cache(2, 16, torch.float32)
    expected = reference_write(key, value, cache, slots)

    write(key, value, cache, torch.tensor(slots))

    assert_same_cache(cache, expected)
    written = ~cache.isnan().all(dim=(-1, -2))
    assert written.sum().item() == 2 * 9  # 9 K rows and 9 V rows, nothing else


@WRITERS
def test_negative_slots_are_padding_and_skipped(write: Callable[..., None]) -> None:
    gen = torch.Generator().manual_seed(1)
    key, value = torch.randn(2, 8, 1, 8, generator=gen)
    slots = scattered_slots(8, num_padding=3, generator=gen)
    cache = poisoned_cache(1, 8, torch.float32)
    expected = reference_write(key, value, cache, slots)

    write(key, value, cache, torch.tensor(slots))

    assert_same_cache(cache, expected)
    written = ~cache.isnan().all(dim=(-1, -2))
    assert written.sum().item() == 2 * 5  # the 3 padding tokens wrote nothing


@WRITERS
def test_strided_key_value_rows_of_a_fused_qkv(write: Callable[..., None]) -> None:
    num_tokens, num_heads, num_kv_heads, head_size = 5, 4, 2, 8
    gen = torch.Generator().manual_seed(2)
    qkv = torch.randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_size, generator=gen)
    _, key, value = qkv.split(
        [num_heads * head_size, num_kv_heads * head_size, num_kv_heads * head_size], dim=-1
    )
    key = key.view(num_tokens, num_kv_heads, head_size)
    value = value.view(num_tokens, num_kv_heads, head_size)
    assert not key.is_contiguous() and key.stride(0) == qkv.shape[1]
    slots = scattered_slots(num_tokens, num_padding=1, generator=gen)
    cache = poisoned_cache(num_kv_heads, head_size, torch.bfloat16)
    expected = reference_write(key.bfloat16(), value.bfloat16(), cache, slots)

    write(key.bfloat16(), value.bfloat16(), cache, torch.tensor(slots))

    assert_same_cache(cache, expected)


@WRITERS
def test_rows_past_the_slot_mapping_are_ignored(write: Callable[..., None]) -> None:
    gen = torch.Generator().manual_seed(3)
    key, value = torch.randn(2, 7, 2, 4, generator=gen)  # a batch padded to 7 rows
    slots = scattered_slots(4, num_padding=0, generator=gen)
    cache = poisoned_cache(2, 4, torch.float16)
    expected = reference_write(key.half(), value.half(), cache, slots)

    write(key.half(), value.half(), cache, torch.tensor(slots))

    assert_same_cache(cache, expected)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"slot_mapping": torch.tensor([0, 1], dtype=torch.int32)}, "slot_mapping"),
        ({"key": torch.zeros(2, 2, 5)}, "key must have shape"),
        ({"value": torch.zeros(2, 2, 4, dtype=torch.float64)}, "value dtype"),
        ({"key": torch.zeros(1, 2, 4)}, "key has 1 rows"),
        ({"kv_cache": torch.zeros(3, 2, 4, 2, 4)}, "kv_cache must have shape"),
        ({"kv_cache": torch.zeros(2, 2, 4, 2, 4, dtype=torch.int32)}, "kv_cache dtype"),
    ],
)
def test_bad_arguments_raise_value_error_naming_them(change: dict, message: str) -> None:
    args = {
        "key": torch.zeros(2, 2, 4),
        "value": torch.zeros(2, 2, 4),
        "kv_cache": torch.zeros(2, 2, 4, 2, 4),
        "slot_mapping": torch.tensor([0, 5]),
    }
    args.update(change)
    with pytest.raises(ValueError, match=message):
        write_to_kv_cache(**args)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_opcheck(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(4)
    key, value = torch.randn(2, 6, 2, 8, generator=gen).to(dtype)
    slots = torch.tensor(scattered_slots(6, num_padding=2, generator=gen))
    cache = torch.zeros(2, NUM_BLOCKS, BLOCK_SIZE, 2, 8, dtype=dtype)
    torch.library.opcheck(torch.ops.v1_engine.reshape_and_cache.default, (key, value, cache, slots))


def test_traces_into_one_graph_under_torch_compile() -> None:
    gen = torch.Generator().manual_seed(5)
    key, value = torch.randn(2, 5, 2, 8, generator=gen)
    slots = scattered_slots(5, num_padding=1, generator=gen)
    eager_cache, compiled_cache = (
        poisoned_cache(2, 8, torch.float32),
        poisoned_cache(2, 8, torch.float32),
    )

    def step(k: torch.Tensor, v: torch.Tensor, cache: torch.Tensor, s: torch.Tensor) -> None:
        write_to_kv_cache(k * 2, v + 1, cache, s)

    step(key, value, eager_cache, torch.tensor(slots))
    torch.compile(step, backend="aot_eager", fullgraph=True)(
        key, value, compiled_cache, torch.tensor(slots)
    )

    assert_same_cache(compiled_cache, eager_cache)
    assert_same_cache(
        eager_cache, reference_write(key * 2, value + 1, poisoned_cache(2, 8, torch.float32), slots)
    )


requires_library = pytest.mark.skipif(
    _C.load_library() is None, reason="libv1engine_kernels.so was not built (no nvcc)"
)
CUDA_ERROR_INVALID_VALUE = 1


@requires_library
def test_library_reports_its_abi_and_cuda_error_text() -> None:
    lib = _C.load_library()
    assert lib.v1e_abi_version() == _C.ABI_VERSION
    assert lib.v1e_error_string(0) == b"no error"
    assert lib.v1e_error_string(CUDA_ERROR_INVALID_VALUE) == b"invalid argument"


@requires_library
@pytest.mark.parametrize(
    ("field", "bad"),
    [("dtype", 7), ("num_kv_heads", 0), ("key_row_stride", 15), ("block_size", 0)],
)
def test_library_rejects_bad_arguments_before_touching_the_device(field: str, bad: int) -> None:
    args = {
        "key": 16,
        "value": 16,
        "kv_cache": 16,
        "slot_mapping": 16,
        "num_tokens": 1,
        "num_kv_heads": 2,
        "head_size": 8,
        "key_row_stride": 16,
        "value_row_stride": 16,
        "num_blocks": 1,
        "block_size": 4,
        "dtype": 0,
        "pdl": 0,
        "stream": None,
    }
    args[field] = bad
    assert _C.load_library().v1e_reshape_and_cache(*args.values()) == CUDA_ERROR_INVALID_VALUE


@pytest.mark.gpu
@requires_library
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("head_size", [64, 128])
@pytest.mark.parametrize("num_kv_heads", [1, 8])
def test_cuda_kernel_matches_the_cpu_op(
    dtype: torch.dtype, head_size: int, num_kv_heads: int
) -> None:
    gen = torch.Generator().manual_seed(head_size + num_kv_heads)
    num_tokens = 13
    key, value = torch.randn(2, num_tokens, num_kv_heads, head_size, generator=gen).to(dtype)
    slots = torch.tensor(scattered_slots(num_tokens, num_padding=3, generator=gen))
    expected = poisoned_cache(num_kv_heads, head_size, dtype)
    write_to_kv_cache(key, value, expected, slots)
    cache = poisoned_cache(num_kv_heads, head_size, dtype, device="cuda")

    write_to_kv_cache(key.cuda(), value.cuda(), cache, slots.cuda())

    assert_same_cache(cache.cpu(), expected)


@pytest.mark.gpu
@requires_library
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("num_heads_before", [4, 1])
@pytest.mark.parametrize("head_size", [6, 5])  # odd sizes: 8-, 4- and 2-byte copy words
def test_cuda_kernel_reads_strided_rows_of_a_fused_qkv(
    dtype: torch.dtype, num_heads_before: int, head_size: int
) -> None:
    num_tokens, num_kv_heads = 9, 2
    gen = torch.Generator().manual_seed(num_heads_before)
    width = (num_heads_before + 2 * num_kv_heads) * head_size
    qkv = torch.randn(num_tokens, width, generator=gen).to(dtype).cuda()
    start = num_heads_before * head_size
    key = qkv[:, start : start + num_kv_heads * head_size].view(num_tokens, num_kv_heads, head_size)
    value = qkv[:, start + num_kv_heads * head_size :].view(num_tokens, num_kv_heads, head_size)
    slots = scattered_slots(num_tokens, num_padding=2, generator=gen)
    cache = poisoned_cache(num_kv_heads, head_size, dtype, device="cuda")
    expected = reference_write(key.cpu(), value.cpu(), cache.cpu(), slots)

    write_to_kv_cache(key, value, cache, torch.tensor(slots, device="cuda"))

    assert_same_cache(cache.cpu(), expected)


@pytest.mark.gpu
@requires_library
def test_cuda_graph_replay_writes_the_new_key_values() -> None:
    num_tokens, num_kv_heads, head_size = 4, 2, 64
    key = torch.zeros(num_tokens, num_kv_heads, head_size, device="cuda")
    value = torch.zeros_like(key)
    slots = torch.tensor([5, -1, 0, 17], device="cuda")
    cache = poisoned_cache(num_kv_heads, head_size, torch.float32, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up outside capture loads the kernel module
        write_to_kv_cache(key, value, cache, slots)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        write_to_kv_cache(key, value, cache, slots)

    new_key, new_value = torch.randn(2, num_tokens, num_kv_heads, head_size)
    key.copy_(new_key)
    value.copy_(new_value)
    graph.replay()
    torch.cuda.synchronize()

    fresh = poisoned_cache(num_kv_heads, head_size, torch.float32)
    expected = reference_write(new_key, new_value, fresh, slots.tolist())
    assert_same_cache(cache.cpu(), expected)
