"""The optional FlashAttention backend, its selection, its config field and its CLI flag.

The package it wraps is not installed in CI, so the CPU tests put a stand-in module in its place:
its `flash_attn_varlen_func` follows the documented paged varlen semantics in plain PyTorch (pages
gathered through the block table, the causal mask aligned to the end of each sequence, query
heads grouped onto kv heads) and records what it was called with. The backend must then match the
reference backend exactly as the real library would. The `gpu` case runs the real package against
the Triton backend and is skipped wherever the package does not import.
"""

from __future__ import annotations

import sys
import types

import pytest
import torch

from v1_engine.attention import flash_attn as fa
from v1_engine.attention.backend import AttentionMetadata
from v1_engine.attention.cpu import CPUAttentionBackend
from v1_engine.attention.flash_attn import FlashAttentionBackend, flash_attn_available
from v1_engine.attention.selector import (
    BACKEND_CHOICES,
    BACKEND_ENV_VAR,
    get_attn_backend,
    resolve_backend_name,
)
from v1_engine.config import ATTENTION_BACKEND_CHOICES, EngineConfig
from v1_engine.entrypoints.cli import engine_kwargs, make_parser
from v1_engine.kernels.cache_ops import FP8_DTYPE

CUDA = torch.device("cuda")
CPU = torch.device("cpu")


# ---- the stand-in package -----------------------------------------------------------------------


def reference_varlen(q, k, v, cu_seqlens_q, seqused_k, block_table, scale) -> torch.Tensor:
    """Paged varlen causal attention as documented: request b's queries are the last ones of its
    seqused_k[b] keys, read from pages block_table[b]; query head h reads kv head h // group."""
    block_size, num_kv_heads = k.shape[1], k.shape[2]
    group = q.shape[1] // num_kv_heads
    out = torch.zeros(q.shape, dtype=torch.float32)
    starts = cu_seqlens_q.tolist()
    for b, seq_len in enumerate(seqused_k.tolist()):
        start, end = starts[b], starts[b + 1]
        positions = torch.arange(seq_len)
        pages = block_table[b].long()[positions // block_size]
        keys = k[pages, positions % block_size].float().repeat_interleave(group, dim=1)
        values = v[pages, positions % block_size].float().repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q[start:end].float(), keys) * scale
        query_pos = torch.arange(seq_len - (end - start), seq_len)[:, None]
        scores = scores.masked_fill(positions[None, :] > query_pos, float("-inf"))
        out[start:end] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), values)
    return out


def _record_and_compute(calls: list[dict], args: dict) -> torch.Tensor:
    """What the stand-in's entry points share: record the call, check it, fill `out`."""
    calls.append(args)
    assert args["cu_seqlens_k"] is None and args["causal"] is True
    q, k, v, out = args["q"], args["k"], args["v"], args["out"]
    assert q.dtype == k.dtype == v.dtype == out.dtype
    assert k.shape[1:] == v.shape[1:] and q.shape[2] == k.shape[3] and out.shape == q.shape
    tables = args["cu_seqlens_q"], args["seqused_k"], args["block_table"]
    result = reference_varlen(q, k, v, *tables, args["softmax_scale"])
    out.copy_(result.to(out.dtype))
    return out


def make_stand_in(calls: list[dict], with_version: bool = True, paged: bool = True):
    """A module shaped like the optional package, of the API generation the flags choose: the
    current one (fa_version and its support queries), one without fa_version, or an old one
    without the paged varlen arguments."""
    module = types.ModuleType(fa.FLASH_ATTN_MODULE)

    def flash_attn_varlen_func(
        q,
        k,
        v,
        max_seqlen_q,
        cu_seqlens_q,
        max_seqlen_k,
        cu_seqlens_k=None,
        seqused_k=None,
        softmax_scale=None,
        causal=False,
        block_table=None,
        out=None,
        fa_version=2,
    ):
        return _record_and_compute(calls, dict(locals()))

    def varlen_without_version(
        q,
        k,
        v,
        max_seqlen_q,
        cu_seqlens_q,
        max_seqlen_k,
        cu_seqlens_k=None,
        seqused_k=None,
        softmax_scale=None,
        causal=False,
        block_table=None,
        out=None,
    ):
        return _record_and_compute(calls, dict(locals()))

    def varlen_without_paging(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, block_table=None
    ):
        raise AssertionError("a package without seqused_k must be refused before any call")

    if not paged:
        module.flash_attn_varlen_func = varlen_without_paging
    elif not with_version:
        module.flash_attn_varlen_func = varlen_without_version
    else:
        module.flash_attn_varlen_func = flash_attn_varlen_func
        module.is_fa_version_supported = lambda version, device=None: version in (2, 3)
        module.fa_version_unsupported_reason = lambda version, device=None: None
    return module


@pytest.fixture
def calls(monkeypatch) -> list[dict]:
    """Install the stand-in package; the list collects the arguments of every call."""
    recorded: list[dict] = []
    monkeypatch.setitem(sys.modules, fa.FLASH_ATTN_MODULE, make_stand_in(recorded))
    monkeypatch.delenv(BACKEND_ENV_VAR, raising=False)
    return recorded


@pytest.fixture
def no_package(monkeypatch) -> None:
    """The package absent, even on a machine that has it (None in sys.modules blocks import)."""
    monkeypatch.setitem(sys.modules, fa.FLASH_ATTN_MODULE, None)
    monkeypatch.delenv(BACKEND_ENV_VAR, raising=False)


# ---- a mixed batch ------------------------------------------------------------------------------

# (cached context, new tokens): a prefill chunk over cached context, a fresh prefill, and three
# decodes, one of them crossing into a new block.
MIXED_BATCH = [(21, 9), (40, 1), (0, 6), (16, 1), (3, 1)]


def make_case(
    batch: list[tuple[int, int]],
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_size: int = 16,
    block_size: int = 16,
    dtype: torch.dtype = torch.bfloat16,
    device: str = "cpu",
    pad: int = 2,
    seed: int = 0,
) -> dict:
    """Random new tokens, a cache whose context is already filled, blocks in shuffled order."""
    gen = torch.Generator().manual_seed(seed)
    seq_lens = [c + n for c, n in batch]
    blocks_per_req = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(blocks_per_req) + 2
    shape = (2, num_blocks, block_size, num_kv_heads, head_size)
    kv_cache = torch.randn(shape, generator=gen).to(dtype)
    order = torch.randperm(num_blocks, generator=gen)
    block_table = torch.zeros(len(batch), max(blocks_per_req), dtype=torch.int32)
    slots, used = [], 0
    for i, ((context, new), n) in enumerate(zip(batch, blocks_per_req)):
        block_table[i, :n] = order[used : used + n].int()
        used += n
        for p in range(context, context + new):
            slots.append(int(block_table[i, p // block_size]) * block_size + p % block_size)
    num_tokens = sum(n for _, n in batch)
    query_lens = torch.tensor([n for _, n in batch], dtype=torch.int32)
    query_start_loc = torch.zeros(len(batch) + 1, dtype=torch.int32)
    query_start_loc[1:] = query_lens.cumsum(0)
    seq_lens_t = torch.tensor(seq_lens, dtype=torch.int32)
    metadata = AttentionMetadata(
        num_actual_tokens=num_tokens,
        query_start_loc=query_start_loc.to(device),
        seq_lens=seq_lens_t.to(device),
        block_table=block_table.to(device),
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        max_query_len=int(query_lens.max()),
        max_seq_len=max(seq_lens),
        query_start_loc_cpu=query_start_loc,
        seq_lens_cpu=seq_lens_t,
    )
    rows = num_tokens + pad

    def new(heads: int) -> torch.Tensor:
        return torch.randn(rows, heads, head_size, generator=gen).to(dtype).to(device)

    return {
        "query": new(num_heads),
        "key": new(num_kv_heads),
        "value": new(num_kv_heads),
        "kv_cache": kv_cache.to(device),
        "metadata": metadata,
        "scale": head_size**-0.5,
    }


def run(backend, case: dict, kv_cache: torch.Tensor) -> torch.Tensor:
    output = torch.full_like(case["query"], float("nan"))
    backend.forward(
        case["query"],
        case["key"],
        case["value"],
        kv_cache,
        case["metadata"],
        case["scale"],
        output,
    )
    return output


# ---- the backend against the reference ----------------------------------------------------------


def test_mixed_batch_matches_reference_backend(calls):
    case = make_case(MIXED_BATCH)
    cache_fa, cache_ref = case["kv_cache"].clone(), case["kv_cache"].clone()
    out_fa = run(FlashAttentionBackend(CPU), case, cache_fa)
    out_ref = run(CPUAttentionBackend(), case, cache_ref)
    num_tokens = case["metadata"].num_actual_tokens
    assert len(calls) == 1
    assert torch.equal(cache_fa, cache_ref)  # the same K/V write
    torch.testing.assert_close(out_fa[:num_tokens], out_ref[:num_tokens], atol=1e-2, rtol=1e-2)
    assert torch.equal(out_fa[num_tokens:], torch.zeros_like(out_fa[num_tokens:]))


def test_larger_gqa_group_and_blocks_match_reference_backend(calls):
    case = make_case(
        [(37, 5), (70, 1), (0, 33)], 8, 1, head_size=32, block_size=32, dtype=torch.float16, seed=3
    )
    cache_fa, cache_ref = case["kv_cache"].clone(), case["kv_cache"].clone()
    out_fa = run(FlashAttentionBackend(CPU), case, cache_fa)
    out_ref = run(CPUAttentionBackend(), case, cache_ref)
    n = case["metadata"].num_actual_tokens
    torch.testing.assert_close(out_fa[:n], out_ref[:n], atol=2e-3, rtol=2e-3)


def test_arguments_are_views_and_int32_metadata(calls):
    case = make_case(MIXED_BATCH)
    kv_cache, metadata = case["kv_cache"], case["metadata"]
    output = run(FlashAttentionBackend(CPU, fa_version=3), case, kv_cache)
    (args,) = calls
    num_tokens = metadata.num_actual_tokens
    # The paged cache goes in as views of our cache: no copy.
    assert args["k"].shape == (kv_cache.shape[1], 16, 2, 16)
    assert args["k"].data_ptr() == kv_cache[0].data_ptr()
    assert args["v"].data_ptr() == kv_cache[1].data_ptr()
    assert args["k"].untyped_storage().data_ptr() == kv_cache.untyped_storage().data_ptr()
    assert args["q"].shape == (num_tokens, 4, 16)
    assert args["out"].shape == (num_tokens, 4, 16)
    assert args["out"].data_ptr() == output.data_ptr()
    for name in ("cu_seqlens_q", "seqused_k", "block_table"):
        assert args[name].dtype == torch.int32, name
    assert args["cu_seqlens_q"].tolist() == [0, 9, 10, 16, 17, 18]
    assert args["seqused_k"].tolist() == [30, 41, 6, 17, 4]
    assert torch.equal(args["block_table"], metadata.block_table)
    assert args["max_seqlen_q"] == 9 and args["max_seqlen_k"] == 41
    assert args["softmax_scale"] == 0.25 and args["causal"] is True
    assert args["fa_version"] == 3


def test_fa_version_is_chosen_from_the_device(calls, monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert FlashAttentionBackend(CUDA).fa_version == 3
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    assert FlashAttentionBackend(CUDA).fa_version == 2
    assert FlashAttentionBackend(CPU).fa_version == 2
    assert FlashAttentionBackend(CUDA, fa_version=3).fa_version == 3
    with pytest.raises(ValueError, match=r"fa_version must be one of \(2, 3\)"):
        FlashAttentionBackend(CPU, fa_version=4)


def test_package_without_fa_version_gets_no_fa_version(monkeypatch):
    calls: list[dict] = []
    monkeypatch.setitem(sys.modules, fa.FLASH_ATTN_MODULE, make_stand_in(calls, False))
    backend = FlashAttentionBackend(CUDA)
    assert backend.fa_version is None
    case = make_case(MIXED_BATCH)
    run(backend, case, case["kv_cache"])
    assert "fa_version" not in calls[0]  # the package runs its only version
    with pytest.raises(ValueError, match="takes no fa_version"):
        FlashAttentionBackend(CUDA, fa_version=3)


def test_package_without_paged_varlen_is_refused(monkeypatch):
    monkeypatch.setitem(sys.modules, fa.FLASH_ATTN_MODULE, make_stand_in([], paged=False))
    with pytest.raises(ValueError, match=r"too old.*seqused_k.*install"):
        FlashAttentionBackend(CUDA)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"dtype": FP8_DTYPE}, r"kv_cache_dtype must be one of \('auto',\)"),
        ({"dtype": torch.float32}, r"dtype must be one of \('float16', 'bfloat16'\)"),
        ({"block_size": 8}, "block_size must be a multiple of 16"),
        ({"head_size": 12}, "head size that is a multiple of 8"),
    ],
)
def test_unsupported_caches_are_refused(calls, change, message):
    dtype = change.pop("dtype", torch.bfloat16)
    case = make_case(MIXED_BATCH, **change)
    kv_cache = case["kv_cache"].to(dtype)
    with pytest.raises(ValueError, match=message):
        run(FlashAttentionBackend(CPU), case, kv_cache)
    assert not calls


# ---- selection ----------------------------------------------------------------------------------


def test_auto_selection_is_unchanged_with_the_package_present(calls):
    assert resolve_backend_name(CUDA) == "triton"
    assert resolve_backend_name(CPU) == "cpu"
    assert isinstance(get_attn_backend(CPU), CPUAttentionBackend)


def test_flash_attn_is_selected_when_asked(calls, monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    backend = get_attn_backend(CUDA, "flash_attn")
    assert isinstance(backend, FlashAttentionBackend) and backend.fa_version == 3
    assert backend.supports_cudagraph
    monkeypatch.setenv(BACKEND_ENV_VAR, "flash_attn")
    assert resolve_backend_name(CUDA) == "flash_attn"
    monkeypatch.setenv(BACKEND_ENV_VAR, "cpu")
    assert resolve_backend_name(CUDA, "flash_attn") == "flash_attn"  # the option wins


def test_selection_errors_are_clear(calls, monkeypatch):
    with pytest.raises(ValueError, match=r"attention_backend must be one of \('cpu', 'triton'"):
        get_attn_backend(CUDA, "flash")
    with pytest.raises(ValueError, match="runs on CUDA only"):
        get_attn_backend(CPU, "flash_attn")
    monkeypatch.setenv(BACKEND_ENV_VAR, "flashattention")
    with pytest.raises(ValueError, match=f"{BACKEND_ENV_VAR} must be one of"):
        resolve_backend_name(CUDA)


def test_missing_package_error_says_how_to_install(no_package):
    with pytest.raises(ValueError, match=r"vllm_flash_attn is not importable: install"):
        get_attn_backend(CUDA, "flash_attn")
    with pytest.raises(ValueError, match="not importable"):
        FlashAttentionBackend(CUDA)
    assert not flash_attn_available()
    assert resolve_backend_name(CUDA) == "triton"


# ---- config field and CLI flag ------------------------------------------------------------------


def test_config_field_is_validated():
    assert {c for c in ATTENTION_BACKEND_CHOICES if c is not None} == set(BACKEND_CHOICES)
    assert EngineConfig.from_kwargs().cache_config.attention_backend is None
    config = EngineConfig.from_kwargs(attention_backend="flash_attn")
    assert config.cache_config.attention_backend == "flash_attn"
    with pytest.raises(ValueError, match="attention_backend must be one of"):
        EngineConfig.from_kwargs(attention_backend="flash")
    with pytest.raises(ValueError, match="kv_cache_dtype must be 'auto'"):
        EngineConfig.from_kwargs(attention_backend="flash_attn", kv_cache_dtype="fp8")
    with pytest.raises(ValueError, match="block_size must be a multiple of 16"):
        EngineConfig.from_kwargs(attention_backend="flash_attn", block_size=8)


def test_cli_flag_reaches_engine_kwargs():
    args = make_parser().parse_args(["--attention-backend", "flash_attn"])
    assert engine_kwargs(args)["attention_backend"] == "flash_attn"
    assert "attention_backend" not in engine_kwargs(make_parser().parse_args([]))
    with pytest.raises(SystemExit):
        make_parser().parse_args(["--attention-backend", "flash"])


# ---- GPU: the real package against the Triton backend -------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not flash_attn_available(), reason="needs the optional vllm_flash_attn")
@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "head_size", "block_size"),
    [(32, 8, 128, 16), (28, 4, 128, 32), (9, 3, 64, 16)],
)
def test_matches_triton_on_cuda(num_heads, num_kv_heads, head_size, block_size):
    from v1_engine.attention.triton_attn import TritonAttentionBackend

    batch = [(300, 77), (1000, 1), (0, 129), (48, 1), (5, 1), (2000, 1)]
    case = make_case(batch, num_heads, num_kv_heads, head_size, block_size, device="cuda", seed=7)
    cache_fa, cache_triton = case["kv_cache"].clone(), case["kv_cache"].clone()
    out_fa = run(FlashAttentionBackend(CUDA), case, cache_fa)
    out_triton = run(TritonAttentionBackend(), case, cache_triton)
    n = case["metadata"].num_actual_tokens
    assert torch.equal(cache_fa, cache_triton)
    torch.testing.assert_close(out_fa[:n], out_triton[:n], atol=2e-2, rtol=2e-2)
    assert torch.equal(out_fa[n:], torch.zeros_like(out_fa[n:]))
