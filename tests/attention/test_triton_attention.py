"""The Triton paged-attention kernels against the PyTorch reference.

Without CUDA the kernels run under the Triton interpreter (TRITON_INTERPRET=1) on tiny shapes, so
CI checks their indexing, masks, block tables and split-KV merge (in the launch); on a GPU the `gpu` cases run
the compiled kernels on random shapes the models use. Outputs are poisoned with NaN first, so an
unwritten element fails the comparison.
"""

from __future__ import annotations

import re

import pytest
import torch

# On the CPU the kernels run under Triton's interpreter, which tests/conftest.py turns on
# before any kernel module is imported.
pytest.importorskip("triton")

from v1_engine.attention.backend import AttentionMetadata
from v1_engine.attention.cpu import CPUAttentionBackend, causal_attention, gather_paged_kv
from v1_engine.attention.selector import get_attn_backend
from v1_engine.attention.triton_attn import TritonAttentionBackend
from v1_engine.kernels import attention_launch as al
from v1_engine.kernels import triton_attention as ta
from v1_engine.kernels.attention_launch import SPLIT_DECODE_TILE, AttentionLaunch, plan_launch
from v1_engine.kernels.semaphores import split_semaphores

_CUDA = torch.cuda.is_available()
interpreter_only = pytest.mark.skipif(_CUDA, reason="the gpu cases cover this on a CUDA machine")


def make_paged_case(
    query_lens: list[int],
    context_lens: list[int],
    num_heads: int,
    num_kv_heads: int,
    head_size: int,
    block_size: int,
    dtype: torch.dtype,
    device: str,
    seed: int,
) -> dict:
    """Random query and a filled cache with blocks scattered in shuffled order."""
    gen = torch.Generator().manual_seed(seed)
    seq_lens = [q + c for q, c in zip(query_lens, context_lens)]
    blocks_per_req = [-(-s // block_size) for s in seq_lens]
    max_blocks = max(blocks_per_req)
    num_blocks = sum(blocks_per_req) + 3
    kv_cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_size, generator=gen)
    order = torch.randperm(num_blocks, generator=gen)
    # Unused table entries point at block 0: the kernel must never read past seq_len anyway.
    block_table = torch.zeros(len(query_lens), max_blocks, dtype=torch.int32)
    used = 0
    for i, n in enumerate(blocks_per_req):
        block_table[i, :n] = order[used : used + n].int()
        used += n
    query = torch.randn(sum(query_lens), num_heads, head_size, generator=gen)
    starts = [0]
    for q in query_lens:
        starts.append(starts[-1] + q)
    return {
        "query": query.to(device=device, dtype=dtype),
        "kv_cache": kv_cache.to(device=device, dtype=dtype),
        "block_table": block_table.to(device),
        "seq_lens": torch.tensor(seq_lens, dtype=torch.int32, device=device),
        "query_start_loc": torch.tensor(starts, dtype=torch.int32, device=device),
        "max_query_len": max(query_lens),
        "max_seq_len": max(seq_lens),
        "scale": head_size**-0.5,
    }


def reference(case: dict) -> torch.Tensor:
    """float64 attention, request by request, on the CPU."""
    kv_cache = case["kv_cache"].cpu().double()
    query = case["query"].cpu().double()
    starts = case["query_start_loc"].tolist()
    out = torch.empty_like(query)
    for i, seq_len in enumerate(case["seq_lens"].tolist()):
        k, v = gather_paged_kv(kv_cache, case["block_table"][i].cpu(), seq_len)
        q = query[starts[i] : starts[i + 1]]
        out[starts[i] : starts[i + 1]] = causal_attention(q, k, v, case["scale"])
    return out


def run_kernel(
    case: dict, num_splits: int | None = None, launch: dict[str, int] | None = None
) -> torch.Tensor:
    output = torch.full_like(case["query"], float("nan"))
    ta.paged_attention(
        case["query"],
        case["kv_cache"],
        case["block_table"],
        case["seq_lens"],
        case["query_start_loc"],
        case["max_query_len"],
        case["max_seq_len"],
        case["scale"],
        output,
        num_splits=num_splits,
        launch=launch,
    )
    return output


def rel_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    out = out.cpu().double()
    assert not out.isnan().any(), "some output elements were never written"
    return float((out - ref).norm() / ref.norm())


TOLERANCE = {torch.float32: 1e-5, torch.float16: 3e-3, torch.bfloat16: 2e-2}


# ---- CPU: the Triton interpreter on tiny shapes ------------------------------------------------


@interpreter_only
@pytest.mark.parametrize(
    "heads,kv_heads,head_size,block_size,dtype",
    [
        (4, 2, 16, 4, torch.float32),  # GQA 2, tiny blocks
        (9, 3, 24, 8, torch.float32),  # the default model's GQA 3 (padded to 4), head size padded
        (4, 4, 16, 16, torch.bfloat16),  # MHA, bf16
        (8, 1, 32, 16, torch.float16),  # MQA
    ],
)
def test_interpreter_mixed_batch(heads, kv_heads, head_size, block_size, dtype):
    """One launch: a chunk with cached context, a fresh prompt and decodes."""
    case = make_paged_case(
        [5, 1, 7, 1], [6, 9, 0, 20], heads, kv_heads, head_size, block_size, dtype, "cpu", seed=1
    )
    assert rel_error(run_kernel(case), reference(case)) < TOLERANCE[dtype]


@interpreter_only
def test_interpreter_long_prefill_spans_several_q_blocks():
    """A prompt longer than one q-block and a request with an empty query in between."""
    case = make_paged_case([40, 0, 3], [5, 4, 2], 2, 1, 16, 8, torch.float32, "cpu", seed=2)
    assert rel_error(run_kernel(case), reference(case)) < 1e-5


@interpreter_only
@pytest.mark.parametrize("num_splits", [2, 4, 16])
def test_interpreter_split_kv_matches_unsplit(num_splits):
    """16 splits over a 3-tile context leaves empty splits: they must not disturb the merge."""
    case = make_paged_case([1, 1, 2], [70, 3, 50], 4, 2, 16, 8, torch.float32, "cpu", seed=3)
    ref = reference(case)
    assert rel_error(run_kernel(case, num_splits=num_splits), ref) < 1e-5


@interpreter_only
@pytest.mark.parametrize("num_splits", [2, 4, 8, 16])
@pytest.mark.parametrize("fused", [1, 0])
def test_interpreter_split_pieces_merge_in_the_launch_or_a_second_kernel(num_splits, fused):
    """Merged in the launch (the last piece to arrive merges), the pieces of a 201-token context
    (7 tiles of 32) fill 2, 4 or all 7 of the launch's (more than one merge trip loads), those
    of a 4-token one a single piece written directly (no merge), and 16 splits leave 9 pieces
    empty; by the second kernel, every piece stores a partial. Either way the result matches
    the reference, is the same bits on a second run whichever piece arrived last, and every
    semaphore is zero again."""
    case = make_paged_case([1, 1, 2], [200, 3, 50], 4, 2, 16, 8, torch.float32, "cpu", seed=5)
    launch = {"fused_merge": fused}
    out = run_kernel(case, num_splits=num_splits, launch=launch)
    assert rel_error(out, reference(case)) < 1e-5
    assert torch.equal(out, run_kernel(case, num_splits=num_splits, launch=launch))
    assert int(split_semaphores(torch.device("cpu"), 1).count_nonzero()) == 0


def test_fused_merge_by_split_count():
    assert al.fused_merge_for(al.FUSED_MERGE_MAX_SPLITS, None)
    assert al.fused_merge_for(2, None)
    assert not al.fused_merge_for(al.FUSED_MERGE_MAX_SPLITS * 2, None)
    assert al.fused_merge_for(32, {"fused_merge": 1})
    assert not al.fused_merge_for(4, {"fused_merge": 0, "tile": 32})


@interpreter_only
def test_interpreter_backend_writes_cache_and_matches_cpu_backend():
    """The backend writes the new K/V, attends over context + new tokens, zeroes padding rows."""
    gen = torch.Generator().manual_seed(4)
    num_heads, num_kv_heads, head_size, block_size = 4, 2, 16, 4
    kv_a = torch.randn(2, 12, block_size, num_kv_heads, head_size, generator=gen)
    kv_b = kv_a.clone()
    # Request 0: 6 cached + 3 new (blocks 5, 2, 9); request 1: decode at position 4 (blocks 7, 1).
    block_table = torch.tensor([[5, 2, 9], [7, 1, 0]], dtype=torch.int32)
    new_positions = [(0, 6), (0, 7), (0, 8), (1, 4)]  # (request, position)
    slots = [
        int(block_table[r, p // block_size]) * block_size + p % block_size for r, p in new_positions
    ]
    assert slots == [10, 11, 36, 4]
    metadata = AttentionMetadata(
        num_actual_tokens=4,
        query_start_loc=torch.tensor([0, 3, 4], dtype=torch.int32),
        seq_lens=torch.tensor([9, 5], dtype=torch.int32),
        block_table=block_table,
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        max_query_len=3,
        max_seq_len=9,
        query_start_loc_cpu=torch.tensor([0, 3, 4], dtype=torch.int32),
        seq_lens_cpu=torch.tensor([9, 5], dtype=torch.int32),
    )
    query = torch.randn(6, num_heads, head_size, generator=gen)  # 2 padding rows
    key = torch.randn(6, num_kv_heads, head_size, generator=gen)
    value = torch.randn(6, num_kv_heads, head_size, generator=gen)
    out_triton = torch.full_like(query, float("nan"))
    out_cpu = torch.full_like(query, float("nan"))
    TritonAttentionBackend().forward(query, key, value, kv_a, metadata, 0.25, out_triton)
    CPUAttentionBackend().forward(query, key, value, kv_b, metadata, 0.25, out_cpu)
    assert torch.equal(kv_a, kv_b)
    assert torch.equal(kv_a[0, 9, 0], key[2]) and torch.equal(kv_a[1, 1, 0], value[3])
    torch.testing.assert_close(out_triton, out_cpu, rtol=1e-5, atol=1e-5)
    assert torch.equal(out_triton[4:], torch.zeros_like(out_triton[4:]))


def _packed_into_a_verify_graph(case: dict, size: int, q: int, num_splits: int | None) -> tuple:
    """The step `case` written into a verify graph's buffers (compile/cuda_graphs.py
    VarlenCudaGraphs: size + 1 requests, size x q tokens, the longest query q) by the graph's
    input kernel, and attended with the launch captured for that graph: (output, T)."""
    from v1_engine.kernels.triton_inputs import write_varlen_inputs

    device = case["query"].device
    tokens = case["query"].shape[0]
    graph_tokens = size * q
    block_size = case["kv_cache"].shape[2]
    width = max(case["block_table"].shape[1], -(-graph_tokens // block_size))
    gen = torch.Generator().manual_seed(9)
    # Stale buffers: garbage ids, positions and slots; any valid block ids in the table.
    buffers = (
        torch.randint(0, 1000, (graph_tokens,), generator=gen).to(device),
        torch.randint(0, 1000, (graph_tokens,), generator=gen).to(device),
        torch.randint(0, 1000, (graph_tokens,), generator=gen).to(device),
        torch.zeros(size + 2, dtype=torch.int32, device=device),
        torch.ones(size + 1, dtype=torch.int32, device=device),
        torch.randint(0, case["kv_cache"].shape[1], (size + 1, width), generator=gen)
        .int()
        .to(device),
    )
    zeros = torch.zeros(tokens, dtype=torch.int64, device=device)
    src = (zeros, zeros, zeros, case["query_start_loc"], case["seq_lens"], case["block_table"])
    write_varlen_inputs(src, buffers, size, graph_tokens)
    query = torch.randn(graph_tokens, *case["query"].shape[1:], generator=gen).to(case["query"])
    query[:tokens] = case["query"]
    output = torch.full_like(query, float("nan"))
    ta.paged_attention(
        query, case["kv_cache"], buffers[5], buffers[4], buffers[3], q,
        max(case["max_seq_len"], graph_tokens), case["scale"], output, num_splits=num_splits,
    )  # fmt: skip
    return output, tokens


@pytest.mark.parametrize("num_splits", [None, 1, 2])
@pytest.mark.parametrize(
    ("query_lens", "size"), [([5, 1, 3], 4), ([5, 5], 2), ([1], 8), ([2, 4, 1], 3)]
)
def test_a_step_packed_into_a_verify_graph_attends_as_alone(query_lens, size, num_splits):
    """The verify graph's packing: the step's rows equal its attention alone, and every padding
    row is written and finite (the padding request owns them; empty requests in between)."""
    device = "cuda" if _CUDA else "cpu"
    contexts = [20, 9, 33, 2][: len(query_lens)]
    case = make_paged_case(query_lens, contexts, 4, 2, 16, 8, torch.float32, device, seed=4)
    out, tokens = _packed_into_a_verify_graph(case, size, 5, num_splits)
    assert rel_error(out[:tokens], reference(case)) < 1e-5
    assert bool(out[tokens:].isfinite().all())


def test_verify_graph_capture_inputs_stay_inside_each_graph():
    """What a verify graph's warm-up and capture run on (compile/cuda_graphs.py, captured
    largest first): for every size, the query starts end at that graph's token count and every
    request holds its tokens' positions, so the captured attention launch reads and writes only
    its own rows (the largest graph's starts would run past a smaller graph's tensors)."""
    from compile.cuda_graphs import VarlenCudaGraphs

    device = "cuda" if _CUDA else "cpu"
    q, block_size = 3, 8
    graphs = VarlenCudaGraphs(lambda *a: None, [1, 2, 4], max_blocks_per_req=4, max_seq_len=32,
                              device=torch.device(device), query_len=q,
                              block_size=block_size)  # fmt: skip
    kv_cache = torch.randn(2, 6, block_size, 2, 16).to(device)
    for size in (4, 2, 1):
        graphs._capture_inputs(size)
        metadata = graphs._metadata(size)
        tokens = metadata.num_actual_tokens
        starts = metadata.query_start_loc
        assert tokens == size * q and metadata.num_reqs == size + 1
        assert starts[0] == 0 and starts[-1] == tokens and bool((starts.diff() >= 0).all())
        assert bool((metadata.seq_lens >= starts.diff()).all())
        query = torch.randn(tokens, 4, 16).to(device)
        output = torch.full_like(query, float("nan"))
        ta.paged_attention(
            query, kv_cache, metadata.block_table, metadata.seq_lens, starts, q,
            metadata.max_seq_len, 0.25, output,
        )  # fmt: skip
        assert bool(output.isfinite().all())


@interpreter_only
def test_interpreter_rejects_mismatched_arguments():
    case = make_paged_case([2], [3], 4, 2, 16, 4, torch.float32, "cpu", seed=5)
    case["seq_lens"] = case["seq_lens"].long()
    with pytest.raises(ValueError, match="seq_lens must be int32"):
        run_kernel(case)
    case = make_paged_case([2], [3], 4, 3, 16, 4, torch.float32, "cpu", seed=5)
    with pytest.raises(ValueError, match="multiple of kv heads"):
        run_kernel(case)


@interpreter_only
def test_interpreter_reads_a_head_major_cache_through_its_strides():
    """The kernel addresses K/V by the cache's strides: a [2, blocks, kv_heads, block, head]
    store viewed as [2, blocks, block, kv_heads, head] (what benchmarks/sweep_attention.py
    --layout hnd times) attends like the same values stored contiguously; a cache whose last
    dimension is strided is refused, naming the strides."""
    case = make_paged_case([1, 3, 1], [37, 9, 20], 4, 2, 16, 8, torch.float32, "cpu", seed=11)
    ref = reference(case)
    head_major = case["kv_cache"].transpose(2, 3).contiguous().transpose(2, 3)
    assert not head_major.is_contiguous() and torch.equal(head_major, case["kv_cache"])
    strided = dict(case, kv_cache=head_major)
    out = run_kernel(strided, num_splits=2)
    assert rel_error(out, ref) < 1e-5
    assert torch.equal(out, run_kernel(case, num_splits=2))
    no_unit_stride = case["kv_cache"].transpose(3, 4).contiguous().transpose(3, 4)
    with pytest.raises(ValueError, match="unit last stride"):
        run_kernel(dict(case, kv_cache=no_unit_stride))


@interpreter_only
def test_interpreter_launch_overrides():
    """A capped-register launch (ignored by the interpreter) gives the same output; an unknown
    launch key is named in the error with the allowed ones."""
    case = make_paged_case([1, 1], [20, 33], 4, 2, 16, 4, torch.float32, "cpu", seed=6)
    args = [case[k] for k in ("query", "kv_cache", "block_table", "seq_lens", "query_start_loc")]
    args += [case["max_query_len"], case["max_seq_len"], case["scale"]]
    plain, capped = torch.zeros_like(case["query"]), torch.zeros_like(case["query"])
    ta.paged_attention(*args, plain)
    ta.paged_attention(*args, capped, launch={"maxnreg": 64, "tile": 16})
    torch.testing.assert_close(capped, plain, rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match=r"launch keys must be among .*maxnreg.*\['warps'\]"):
        ta.paged_attention(*args, plain, launch={"warps": 4})


# ---- host-side decisions (no kernel) -----------------------------------------------------------


def test_choose_num_splits():
    # Few programs and a long context: split up to filling the device, a power of two.
    assert al.choose_num_splits(8, 1, 32768, 64, 264) == 32
    assert al.choose_num_splits(3, 1, 100_000, 64, 264) == 64
    # Short context: each piece must keep a few tiles.
    assert al.choose_num_splits(8, 1, 300, 64, 264) == 1
    assert al.choose_num_splits(8, 1, 600, 64, 264) == 2
    # Prefill or a device already full: no split.
    assert al.choose_num_splits(8, 512, 32768, 64, 264) == 1
    assert al.choose_num_splits(512, 1, 32768, 64, 264) == 1


def test_split_decode_tile():
    # A decode step whose programs fill at most a quarter of the device walks 32-row key tiles
    # (more splits at short context: 321 positions give 2 pieces of 32-row tiles, 1 of 64-row).
    assert al.split_decode_tile(64, 1, 8, 264) == 32
    assert al.choose_num_splits(8, 1, 321, 32, 264) == 2
    assert al.choose_num_splits(8, 1, 321, 64, 264) == 1
    assert al.split_decode_tile(64, 1, 64, 264) == 32  # batch 8 x 8 kv heads
    # Programs past a quarter of the device (batch 16 x 8 kv heads), a full device (batch 64),
    # a prefill, or a tile already narrow: unchanged.
    assert al.split_decode_tile(64, 1, 128, 264) == 64
    assert al.split_decode_tile(64, 1, 512, 264) == 64
    assert al.split_decode_tile(64, 512, 8, 264) == 64
    assert al.split_decode_tile(16, 1, 8, 264) == 16


def plan(max_query_len=1, num_tokens=1, num_reqs=1, max_seq_len=32768, target=264,
         num_splits=None, launch=None):  # fmt: skip
    """`plan_launch` for bf16 Llama-3-8B heads (32 over 8 kv heads: group 4, head 128) on a
    device of `target` programs (264: two a SM of the H200)."""
    return plan_launch(torch.bfloat16, num_tokens, num_reqs, 8, 4, 128, max_query_len,
                       max_seq_len, target, num_splits, launch)  # fmt: skip


def test_plan_launch_decode_splits_on_a_narrow_tile():
    # Batch 1: one q-block of 4 tokens x 4 heads (16 rows), 8 programs: 32 splits of 32-row
    # tiles, more than FUSED_MERGE_MAX_SPLITS, so the second kernel merges them.
    assert plan() == AttentionLaunch(block_m=16, block_q=4, tile=SPLIT_DECODE_TILE, num_warps=4,
                                     num_stages=2, num_q_blocks=1, num_splits=32,
                                     fused_merge=False, options={})  # fmt: skip
    # Batch 4 at 4k: 32 programs, 8 splits, merged in the launch.
    batch4 = plan(num_tokens=4, num_reqs=4, max_seq_len=4096)
    assert (batch4.num_q_blocks, batch4.tile, batch4.num_splits) == (5, SPLIT_DECODE_TILE, 8)
    assert batch4.num_splits == al.FUSED_MERGE_MAX_SPLITS and batch4.fused_merge
    # 8 query tokens of one request: 2 q-blocks hold them (the grid's 3 is a bound): 16 programs.
    multi = plan(max_query_len=8, num_tokens=8)
    assert (multi.num_q_blocks, multi.tile, multi.num_splits) == (3, SPLIT_DECODE_TILE, 16)
    # The 8 programs fill the CPU's token target (what paged_attention passes there).
    assert al.target_programs(torch.device("cpu")) == 8
    cpu = plan(target=8)
    assert (cpu.tile, cpu.num_splits, cpu.fused_merge) == (64, 1, False)


def test_plan_launch_prefill_does_not_split():
    # 512 prefill tokens and 3 decodes: 64-row tiles of 16 tokens, 515 // 16 + 4 q-blocks.
    assert plan(max_query_len=512, num_tokens=515, num_reqs=4) == AttentionLaunch(
        block_m=64, block_q=16, tile=64, num_warps=4, num_stages=2, num_q_blocks=36,
        num_splits=1, fused_merge=False, options={},
    )  # fmt: skip
    just_past_decode = plan(max_query_len=17, num_tokens=17)
    assert (just_past_decode.tile, just_past_decode.num_splits) == (64, 1)


def test_plan_launch_overrides_win(monkeypatch):
    # block_m is floored at the padded group (4), a set tile is not narrowed for the split.
    launch = {"block_m": 2, "tile": 128, "num_warps": 8, "num_stages": 3}
    assert plan(launch=launch) == AttentionLaunch(block_m=4, block_q=1, tile=128, num_warps=8,
                                                  num_stages=3, num_q_blocks=2, num_splits=32,
                                                  fused_merge=False, options={})  # fmt: skip
    wide = plan(launch={"block_m": 64})
    assert (wide.block_m, wide.block_q, wide.tile) == (64, 16, SPLIT_DECODE_TILE)
    # maxnreg reaches the compiler's options, except under the interpreter.
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert plan(launch={"maxnreg": 64}).options == {"maxnreg": 64}
    assert plan(launch={"maxnreg": None}).options == {}
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert plan(launch={"maxnreg": 64}).options == {}


def test_plan_launch_forced_splits_and_merge():
    # A forced split count keeps the default tile; where the pieces merge follows the count up
    # to FUSED_MERGE_MAX_SPLITS, or the fused_merge override; one piece never merges.
    forced = plan(num_splits=4)
    assert (forced.tile, forced.num_splits, forced.fused_merge) == (64, 4, True)
    top = al.FUSED_MERGE_MAX_SPLITS
    assert plan(num_splits=top).fused_merge and not plan(num_splits=2 * top).fused_merge
    assert plan(num_splits=2 * top, launch={"fused_merge": 1}).fused_merge
    assert not plan(num_splits=4, launch={"fused_merge": 0}).fused_merge
    assert not plan(num_splits=1, launch={"fused_merge": 1}).fused_merge


def test_plan_launch_rejects_bad_arguments():
    message = f"launch keys must be among {al.LAUNCH_KEYS}; got ['warps']"
    with pytest.raises(ValueError, match=re.escape(message)):
        plan(launch={"warps": 4, "tile": 32})
    with pytest.raises(ValueError, match="num_splits must be >= 1, got 0"):
        plan(num_splits=0)


def test_selector_env_override(monkeypatch):
    monkeypatch.setenv("V1ENGINE_ATTENTION_BACKEND", "cpu")
    assert isinstance(get_attn_backend(torch.device("cpu")), CPUAttentionBackend)
    monkeypatch.setenv("V1ENGINE_ATTENTION_BACKEND", "bogus")
    with pytest.raises(ValueError, match="V1ENGINE_ATTENTION_BACKEND"):
        get_attn_backend(torch.device("cpu"))
    monkeypatch.delenv("V1ENGINE_ATTENTION_BACKEND")
    assert isinstance(get_attn_backend(torch.device("cpu")), CPUAttentionBackend)


# ---- GPU: compiled kernels on random shapes ----------------------------------------------------


GPU_SHAPES = [
    # heads, kv_heads, head_size, block_size
    (9, 3, 64, 16),  # the default model
    (32, 8, 128, 16),  # Llama-3-8B
    (28, 4, 128, 32),  # Qwen2.5-7B
    (16, 16, 80, 8),  # MHA, a head size padded to 128
    (8, 1, 256, 64),  # MQA, the largest head
]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape", GPU_SHAPES)
def test_gpu_mixed_batch_random(shape, dtype):
    heads, kv_heads, head_size, block_size = shape
    gen = torch.Generator().manual_seed(hash(shape) % 1000)
    for trial in range(3):
        num_reqs = int(torch.randint(1, 12, (1,), generator=gen))
        query_lens, context_lens = [], []
        for _ in range(num_reqs):
            decode = bool(torch.rand(1, generator=gen) < 0.5)
            query_lens.append(1 if decode else int(torch.randint(2, 300, (1,), generator=gen)))
            context_lens.append(int(torch.randint(0, 700, (1,), generator=gen)))
        case = make_paged_case(
            query_lens,
            context_lens,
            heads,
            kv_heads,
            head_size,
            block_size,
            dtype,
            "cuda",
            seed=trial,
        )
        err = rel_error(run_kernel(case), reference(case))
        assert err < TOLERANCE[dtype], (query_lens, context_lens, err)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_gpu_chunked_prefill_with_long_context(dtype):
    case = make_paged_case([1000, 17, 1], [3000, 4000, 5000], 32, 8, 128, 16, dtype, "cuda", 7)
    assert rel_error(run_kernel(case), reference(case)) < TOLERANCE[dtype]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("num_splits", [None, 8, 64])
def test_gpu_long_decode_split_kv(dtype, num_splits):
    """Two requests with 32k-token contexts: the heuristic splits them (checked), forced too."""
    case = make_paged_case([1, 1], [32767, 20000], 32, 8, 128, 16, dtype, "cuda", seed=8)
    if num_splits is None:
        programs = 2 * 8
        target = 2 * torch.cuda.get_device_properties(0).multi_processor_count
        assert al.choose_num_splits(programs, 1, 32768, 64, target) > 1
    assert rel_error(run_kernel(case, num_splits=num_splits), reference(case)) < TOLERANCE[dtype]


@pytest.mark.gpu
def test_gpu_backend_matches_cpu_backend_on_the_model_step_shape():
    """The backend end to end (compiled K/V write + kernel) against the reference backend."""
    heads, kv_heads, head_size, block_size = 9, 3, 64, 16
    gen = torch.Generator().manual_seed(9)
    num_blocks = 64
    kv = torch.randn(2, num_blocks, block_size, kv_heads, head_size, generator=gen)
    kv_gpu, kv_cpu = kv.cuda(), kv.clone()
    # Request 0: 40 cached + 24 new; request 1: decode at position 100 (its blocks are random).
    table = torch.randperm(num_blocks, generator=gen)[:16].view(2, 8).int()
    seq_lens = [64, 101]
    new_positions = [list(range(40, 64)), [100]]
    slots = [
        int(table[r, p // block_size]) * block_size + p % block_size
        for r, positions in enumerate(new_positions)
        for p in positions
    ]
    num_tokens = len(slots)
    qsl = torch.tensor([0, 24, 25], dtype=torch.int32)

    def metadata(device: str) -> AttentionMetadata:
        return AttentionMetadata(
            num_actual_tokens=num_tokens,
            query_start_loc=qsl.to(device),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
            block_table=table.to(device),
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
            max_query_len=24,
            max_seq_len=101,
            query_start_loc_cpu=qsl,
            seq_lens_cpu=torch.tensor(seq_lens, dtype=torch.int32),
        )

    q = torch.randn(num_tokens + 3, heads, head_size, generator=gen)
    k = torch.randn(num_tokens + 3, kv_heads, head_size, generator=gen)
    v = torch.randn(num_tokens + 3, kv_heads, head_size, generator=gen)
    out_gpu = torch.full((num_tokens + 3, heads, head_size), float("nan"), device="cuda")
    out_cpu = torch.full_like(q, float("nan"))
    TritonAttentionBackend().forward(
        q.cuda(), k.cuda(), v.cuda(), kv_gpu, metadata("cuda"), 0.125, out_gpu
    )
    CPUAttentionBackend().forward(q, k, v, kv_cpu, metadata("cpu"), 0.125, out_cpu)
    assert torch.equal(kv_gpu.cpu(), kv_cpu)
    torch.testing.assert_close(out_gpu.cpu(), out_cpu, rtol=1e-4, atol=1e-4)
    assert isinstance(get_attn_backend(torch.device("cuda")), TritonAttentionBackend)
