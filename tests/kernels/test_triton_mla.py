"""The Triton MLA decode kernel and backend against PyTorch references.

Without CUDA the kernels run under the Triton interpreter (TRITON_INTERPRET=1) on tiny shapes:
block tables with shuffled blocks, several cache blocks per request, split-KV with its merge,
more heads than one head tile, sizes that are not powers of two, and mixed batches whose prefill
rows the kernel must leave alone; each launch variant (transposed dots, value slices, one cache
block per step) on the same cases. The `gpu` cases run DeepSeek-V2-Lite (16 heads) and V3
(128 heads) shapes: kv_lora_rank 512, rope 64, block sizes 16 and 64, the variants at the
launches the sweep tries, and a CUDA graph replay. Outputs are poisoned with NaN first, so an
unwritten element fails the comparison.
"""

from __future__ import annotations

import pytest
import torch

# On the CPU the kernels run under Triton's interpreter, which tests/conftest.py turns on
# before any kernel module is imported.
pytest.importorskip("triton")

from v1_engine.attention.backend import AttentionMetadata
from v1_engine.attention.mla_cpu import CPUMLABackend
from v1_engine.attention.mla_triton import TritonMLABackend
from v1_engine.attention.selector import BACKEND_ENV_VAR, get_mla_backend
from v1_engine.kernels import mla_launch, semaphores
from v1_engine.kernels.triton_cache import write_latent_cache
from v1_engine.kernels.triton_mla import choose_num_splits, mla_decode

_CUDA = torch.cuda.is_available()
interpreter_only = pytest.mark.skipif(_CUDA, reason="the gpu cases cover this on a CUDA machine")
DEVICE = "cuda" if _CUDA else "cpu"


def make_latent_case(seq_lens, block_size, rank, rope, dtype, seed, extra_blocks=3):
    """A random latent cache whose blocks are handed out in shuffled order, and block tables."""
    gen = torch.Generator().manual_seed(seed)
    blocks_per_req = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(blocks_per_req) + extra_blocks
    cache = torch.randn(num_blocks, block_size, rank + rope, generator=gen)
    order = torch.randperm(num_blocks, generator=gen)
    table = torch.zeros(len(seq_lens), max(blocks_per_req), dtype=torch.int32)
    used = 0
    for i, n in enumerate(blocks_per_req):
        table[i, :n] = order[used : used + n].int()
        used += n
    return cache.to(DEVICE, dtype), table.to(DEVICE)


def reference_decode(q_nope, q_pe, cache, table, seq_lens, scale):
    """Float64 absorbed attention per request: [B, H, R]."""
    rank = q_nope.shape[-1]
    block_size = cache.shape[1]
    outs = []
    for b, n in enumerate(seq_lens):
        blocks = table[b, : -(-n // block_size)].long()
        latent = cache[blocks].reshape(-1, cache.shape[-1])[:n].double()
        scores = q_nope[b].double() @ latent[:, :rank].T + q_pe[b].double() @ latent[:, rank:].T
        outs.append((scores * scale).softmax(-1) @ latent[:, :rank])
    return torch.stack(outs)


def _queries(num_tokens, heads, rank, rope, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    q_nope = torch.randn(num_tokens, heads, rank, generator=gen) * 0.3
    q_pe = torch.randn(num_tokens, heads, rope, generator=gen) * 0.3
    return q_nope.to(DEVICE, dtype), q_pe.to(DEVICE, dtype)


def _run_decode(seq_lens, heads, rank, rope, block_size, dtype, num_splits, seed=0, **launch):
    cache, table = make_latent_case(seq_lens, block_size, rank, rope, dtype, seed)
    q_nope, q_pe = _queries(len(seq_lens), heads, rank, rope, dtype, seed + 1)
    scale = 0.7 / (rank + rope) ** 0.5
    out = torch.full_like(q_nope, float("nan"))
    starts = torch.arange(len(seq_lens) + 1, dtype=torch.int32, device=DEVICE)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    mla_decode(
        q_nope, q_pe, cache, table, lens, starts, max(seq_lens), scale, out, num_splits, **launch
    )
    return out, reference_decode(q_nope, q_pe, cache, table, seq_lens, scale)


@interpreter_only
@pytest.mark.parametrize("num_splits", [1, 3, 8, 16])
@pytest.mark.parametrize(
    "heads, rank, rope, block_size",
    [(20, 32, 16, 4), (4, 24, 8, 16)],
    ids=["two-head-tiles", "padded-dims"],
)
def test_decode_float32_matches_reference(heads, rank, rope, block_size, num_splits):
    """Eight splits over a 3-tile request leave splits with no key: the merge must ignore them.
    Up to 8 splits the merge is unrolled over the pieces; 16 takes its loop."""
    out, want = _run_decode(
        [1, 7, 40, 33], heads, rank, rope, block_size, torch.float32, num_splits
    )
    torch.testing.assert_close(out.double(), want, atol=1e-5, rtol=1e-5)


# Launch variants under the interpreter: rank 32 pads to 32, so block_v 16 gives two value
# slices; with rank 24 the second slice is half padding. page_tile takes a tile (16) that
# divides the block size.
VARIANTS = {
    "swap": {"swap": True},
    "slices": {"block_v": 16},
    "swap-slices": {"swap": True, "block_v": 16},
    "page": {"page_tile": True},
    "swap-slices-page": {"swap": True, "block_v": 16, "page_tile": True},
}


@interpreter_only
@pytest.mark.parametrize(
    "variant, num_splits",
    [("swap", 1), ("swap", 3), ("slices", 1), ("slices", 3), ("swap-slices", 8), ("page", 3)]
    + [("swap-slices-page", 1)],
)
@pytest.mark.parametrize(
    "heads, rank, rope", [(20, 32, 16), (4, 24, 8)], ids=["two-head-tiles", "padded-dims"]
)
def test_decode_variants_match_reference(heads, rank, rope, variant, num_splits):
    """Every variant on the lengths of the plain test (not multiples of the 16-token tile, one
    request with a single key, splits with none): split partials per value slice, merged.
    Blocks of 32 hold two tiles each, so a page_tile step may start mid-block."""
    out, want = _run_decode(
        [1, 7, 40, 33],
        heads,
        rank,
        rope,
        32,
        torch.float32,
        num_splits,
        tile=16,
        **VARIANTS[variant],
    )
    torch.testing.assert_close(out.double(), want, atol=1e-5, rtol=1e-5)


@interpreter_only
@pytest.mark.parametrize("launch", [{}, {"swap": True, "block_v": 16}], ids=["plain", "slices"])
def test_split_merge_in_kernel_resets_its_semaphores(launch):
    """The last split of each (request, head tile, value slice) merges the pieces and zeroes its
    semaphore: a second launch on other inputs (same programs) is right too."""
    for seed in (0, 1):
        out, want = _run_decode(
            [9, 40, 33], 20, 32, 16, 16, torch.float32, 3, seed=seed, tile=16, **launch
        )
        torch.testing.assert_close(out.double(), want, atol=1e-5, rtol=1e-5)
        assert not semaphores._SEMAPHORES[out.device].any()


def test_choose_num_splits():
    # DeepSeek-V2-Lite at batch 64 x 4k: 64 programs of 16 heads, two an SM on 132 SMs.
    assert choose_num_splits(64, 4096, 32, 264) == 4
    # 128 heads: 128 programs of 64 heads, one an SM: the 4 idle SMs do not pay for a merge.
    assert choose_num_splits(128, 4096, 64, 132) == 1
    assert choose_num_splits(1, 4096, 32, 264) == 32  # capped by max_splits
    assert choose_num_splits(1, 300, 32, 264) == 2  # each split keeps >= 4 tiles
    assert choose_num_splits(300, 4096, 32, 264) == 1


def test_plan_launch_applies_and_checks_overrides():
    cpu = torch.device("cpu")  # target_programs: 8 there
    # DeepSeek-V2-Lite's 16 heads, rank 512, 64-token blocks, one request at 4k: the default
    # plain form pages 32-token tiles; 1 program, so the split fills the 8 target programs.
    plan = mla_launch.plan_launch(16, 512, 64, 1, 4096, False, cpu)
    assert plan.config == mla_launch.LaunchConfig(16, 32, 4, 3, block_v=512, page_tile=True)
    assert (plan.rank_pad, plan.num_head_tiles, plan.num_v_slices, plan.num_splits) == (
        512, 1, 1, 8,
    )  # fmt: skip
    # 128 heads: 64-head tiles; a 48-token block drops page_tile, the given overrides win and
    # give the grid (2 head tiles x 4 latent slices); num_splits passes through.
    plan = mla_launch.plan_launch(
        128, 500, 48, 3, 4096, False, cpu, 2, block_v=128, swap=True, num_warps=4, tile=None
    )
    assert not plan.config.page_tile and plan.config.swap and plan.config.num_warps == 4
    assert (plan.config.block_h, plan.config.tile, plan.config.block_v) == (64, 64, 128)
    assert (plan.rank_pad, plan.num_head_tiles, plan.num_v_slices, plan.num_splits) == (
        512, 2, 4, 2,
    )  # fmt: skip
    for overrides, match in (
        ({"block_h": 24}, "block_h must be a power of two >= 16, got 24"),
        ({"tile": 8}, "tile must be a power of two >= 16, got 8"),
        ({"block_v": 1024}, r"block_v must be a power of two in \[16, 512\]"),
        ({"tile": 64, "page_tile": True}, r"page_tile needs tile \(64\) to divide .* \(48\)"),
    ):
        with pytest.raises(ValueError, match=match):
            mla_launch.plan_launch(16, 512, 48, 1, 4096, False, cpu, **overrides)
    with pytest.raises(ValueError, match="num_splits must be >= 1, got 0"):
        mla_launch.plan_launch(16, 512, 64, 1, 4096, False, cpu, 0)


@interpreter_only
def test_decode_bfloat16_close_to_reference():
    out, want = _run_decode([5, 38], 16, 32, 16, 8, torch.bfloat16, num_splits=2)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.double(), want, atol=2e-2, rtol=2e-2)


def _check_non_decode_rows_untouched(heads, rank, rope, block_size, dtype, atol, launch):
    """Request 1 is a 3-token prefill chunk and request 2 an empty (padding) request: their rows
    keep the poison; the decode requests around them are computed."""
    seq_lens = [9, 12, 1, 20]
    starts = torch.tensor([0, 1, 4, 4, 5], dtype=torch.int32, device=DEVICE)
    cache, table = make_latent_case(seq_lens, block_size, rank, rope, dtype, seed=3)
    q_nope, q_pe = _queries(5, heads, rank, rope, dtype, seed=4)
    out = torch.full_like(q_nope, float("nan"))
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    for splits in (1, 2):
        mla_decode(
            q_nope, q_pe, cache, table, lens, starts, 20, 0.2, out, num_splits=splits, **launch
        )
        assert out[1:4].isnan().all()
        decode_tokens, decode_reqs = [0, 4], [0, 3]
        want = reference_decode(
            q_nope[decode_tokens],
            q_pe[decode_tokens],
            cache,
            table[decode_reqs],
            [seq_lens[r] for r in decode_reqs],
            0.2,
        )
        torch.testing.assert_close(out[decode_tokens].double(), want, atol=atol, rtol=atol)


@interpreter_only
@pytest.mark.parametrize(
    "block_size, launch",
    [(4, {}), (16, VARIANTS["swap-slices-page"] | {"tile": 16})],
    ids=["plain", "variants"],
)
def test_decode_leaves_prefill_and_empty_requests_alone(block_size, launch):
    _check_non_decode_rows_untouched(4, 32, 16, block_size, torch.float32, 1e-5, launch)


@interpreter_only
def test_latent_write_skips_padding_slots():
    cache = torch.zeros(3, 4, 24)
    kv_c = torch.randn(3, 16)
    k_pe = torch.randn(3, 8)
    write_latent_cache(kv_c, k_pe, cache, torch.tensor([5, -1, 11]))
    flat = cache.view(-1, 24)
    torch.testing.assert_close(flat[5], torch.cat([kv_c[0], k_pe[0]]))
    torch.testing.assert_close(flat[11], torch.cat([kv_c[2], k_pe[2]]))
    assert flat.abs().sum(-1).nonzero().flatten().tolist() == [5, 11]


def _mixed_step(heads, nope, rope, v, rank, block_size, context_lens, query_lens, dtype, seed):
    """A step of decode and prefill requests: (inputs, metadata, w_uk, w_uv, cache)."""
    gen = torch.Generator().manual_seed(seed)
    seq_lens = [c + q for c, q in zip(context_lens, query_lens)]
    cache, table = make_latent_case(seq_lens, block_size, rank, rope, dtype, seed)
    slots = [
        int(table[i, p // block_size]) * block_size + p % block_size
        for i, (c, n) in enumerate(zip(context_lens, seq_lens))
        for p in range(c, n)
    ]
    num_tokens = sum(query_lens)
    starts = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
    metadata = AttentionMetadata(
        num_actual_tokens=num_tokens,
        query_start_loc=starts.to(DEVICE),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE),
        block_table=table,
        slot_mapping=torch.tensor(slots, device=DEVICE),
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        query_start_loc_cpu=starts,
        seq_lens_cpu=torch.tensor(seq_lens, dtype=torch.int32),
    )
    kv_b = torch.randn(heads, nope + v, rank, generator=gen) * rank**-0.5

    def rand(*shape):
        return torch.randn(*shape, generator=gen).to(DEVICE, dtype)

    inputs = (rand(num_tokens, heads, nope), rand(num_tokens, heads, rope))
    inputs += (rand(num_tokens, rank), rand(num_tokens, rope))
    kv_b = kv_b.to(DEVICE, dtype)
    w_uk, w_uv = kv_b[:, :nope], kv_b[:, nope:].transpose(1, 2)
    return inputs, metadata, w_uk, w_uv, cache


def _compare_backends(step, scale, atol, num_splits=None):
    inputs, metadata, w_uk, w_uv, cache = step
    outputs, caches = [], []
    for backend in (CPUMLABackend(), TritonMLABackend(num_splits=num_splits)):
        c = cache.clone()
        out = torch.full(
            (inputs[0].shape[0] + 2, w_uk.shape[0], w_uv.shape[2]),
            float("nan"),
            dtype=inputs[0].dtype,
            device=DEVICE,
        )
        padded = [torch.cat([x, x[:2]]) for x in inputs]  # two padding rows past num_actual
        backend.forward(*padded, c, metadata, w_uk, w_uv, scale, out)
        outputs.append(out)
        caches.append(c)
    torch.testing.assert_close(caches[1], caches[0], atol=0, rtol=0)
    assert not outputs[1][-2:].any()
    torch.testing.assert_close(outputs[1].float(), outputs[0].float(), atol=atol, rtol=atol)


@interpreter_only
@pytest.mark.parametrize(
    "context_lens, query_lens",
    [([6, 4, 0, 30], [1, 3, 5, 1]), ([9, 17, 2], [1, 1, 1])],
    ids=["mixed", "decode-only"],
)
def test_backend_matches_cpu_reference(context_lens, query_lens):
    step = _mixed_step(4, 16, 8, 12, 32, 4, context_lens, query_lens, torch.float32, seed=5)
    _compare_backends(step, scale=(16 + 8) ** -0.5, atol=1e-5, num_splits=2)


def test_selector_picks_the_mla_backend(monkeypatch):
    monkeypatch.setenv(BACKEND_ENV_VAR, "cpu")
    assert isinstance(get_mla_backend(torch.device(DEVICE)), CPUMLABackend)
    monkeypatch.setenv(BACKEND_ENV_VAR, "triton")
    assert isinstance(get_mla_backend(torch.device(DEVICE)), TritonMLABackend)
    monkeypatch.setenv(BACKEND_ENV_VAR, "flash")
    with pytest.raises(ValueError, match="must be one of"):
        get_mla_backend(torch.device(DEVICE))


@interpreter_only
def test_decode_bfloat16_variant_close_to_reference():
    out, want = _run_decode(
        [5, 38], 16, 32, 16, 16, torch.bfloat16, 2, tile=16, swap=True, block_v=16
    )
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.double(), want, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize(
    "launch, message",
    [
        ({"block_v": 24}, r"block_v must be a power of two in \[16, 32\]"),
        ({"block_v": 64}, r"block_v must be a power of two in \[16, 32\]"),
        ({"block_v": 8}, r"block_v must be a power of two in \[16, 32\]"),
        ({"page_tile": True, "tile": 16}, r"page_tile needs tile \(16\) to divide"),
    ],
)
def test_decode_rejects_bad_launch(launch, message):
    q = torch.zeros(1, 2, 32, device=DEVICE)
    with pytest.raises(ValueError, match=message):
        mla_decode(
            q,
            torch.zeros(1, 2, 16, device=DEVICE),
            torch.zeros(2, 4, 48, device=DEVICE),
            torch.zeros(1, 1, dtype=torch.int32, device=DEVICE),
            torch.ones(1, dtype=torch.int32, device=DEVICE),
            torch.arange(2, dtype=torch.int32, device=DEVICE),
            1,
            1.0,
            torch.empty_like(q),
            **launch,
        )


def test_decode_rejects_mismatched_cache():
    q = torch.zeros(1, 2, 32, device=DEVICE)
    with pytest.raises(ValueError, match="kv_cache must be"):
        mla_decode(
            q,
            torch.zeros(1, 2, 16, device=DEVICE),
            torch.zeros(2, 4, 40, device=DEVICE),
            torch.zeros(1, 1, dtype=torch.int32, device=DEVICE),
            torch.ones(1, dtype=torch.int32, device=DEVICE),
            torch.arange(2, dtype=torch.int32, device=DEVICE),
            1,
            1.0,
            torch.empty_like(q),
        )


# ---- GPU: DeepSeek shapes -------------------------------------------------------------------


def _launch_id(value):
    if isinstance(value, dict):
        return "-".join(f"{k}{v}" for k, v in value.items()) or "default"
    return None


def _random_seq_lens(batch: int, longest: int, seed: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    lens = torch.randint(1, longest + 1, (batch,), generator=gen).tolist()
    lens[0] = longest
    return lens


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("block_size", [16, 64])
@pytest.mark.parametrize("heads", [16, 128], ids=["v2-lite", "v3"])
@pytest.mark.parametrize("num_splits", [None, 1, 7])
def test_gpu_decode_deepseek_shapes(heads, block_size, dtype, num_splits):
    seq_lens = _random_seq_lens(12, 4096, seed=heads + block_size)
    out, want = _run_decode(seq_lens, heads, 512, 64, block_size, dtype, num_splits, seed=heads)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.double(), want, atol=1e-2, rtol=1e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("launch", [{}, {"swap": True, "block_v": 256}], ids=_launch_id)
@pytest.mark.parametrize("batch", [1, 64])
def test_gpu_decode_float32_is_tight(batch, launch):
    seq_lens = _random_seq_lens(batch, 1000, seed=batch)
    out, want = _run_decode(seq_lens, 16, 512, 64, 16, torch.float32, None, seed=batch, **launch)
    torch.testing.assert_close(out.double(), want, atol=1e-5, rtol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("heads", [16, 128], ids=["v2-lite", "v3"])
def test_gpu_backend_mixed_step_matches_cpu_reference(heads):
    """Decode requests and prefill chunks over cached context in one step, DeepSeek sizes."""
    step = _mixed_step(
        heads, 128, 64, 128, 512, 16, [300, 0, 77, 1000], [1, 40, 9, 1], torch.bfloat16, seed=6
    )
    _compare_backends(step, scale=192**-0.5, atol=2e-2)


# Launches of each variant the sweep tries (benchmarks/sweep_mla.py), all within the H200's
# shared memory; 20 heads leave the second head tile mostly empty.
GPU_VARIANTS = [
    (16, {"swap": True, "tile": 64, "num_warps": 8, "num_stages": 2}),
    (16, {"swap": True, "tile": 32, "num_warps": 4, "num_stages": 3, "page_tile": True}),
    (16, {"swap": True, "tile": 32, "num_warps": 4, "num_stages": 3, "block_v": 256}),
    (20, {"swap": True, "tile": 32, "num_warps": 8, "num_stages": 3, "block_v": 128}),
    (128, {"block_h": 64, "tile": 32, "num_warps": 8, "num_stages": 2, "block_v": 256}),
    (128, {"block_h": 64, "tile": 32, "num_warps": 8, "num_stages": 2, "block_v": 128}),
    (
        128,
        {"swap": True, "block_h": 64, "tile": 32, "num_warps": 8, "num_stages": 2, "block_v": 128},
    ),
    (
        128,
        {
            "swap": True,
            "block_h": 128,
            "tile": 32,
            "num_warps": 16,
            "num_stages": 2,
            "block_v": 128,
        },
    ),
    (16, {"tile": 32, "num_warps": 4, "num_stages": 2, "page_tile": True}),
]


@pytest.mark.gpu
@pytest.mark.parametrize("num_splits", [None, 1, 7])
@pytest.mark.parametrize("heads, launch", GPU_VARIANTS, ids=_launch_id)
def test_gpu_decode_variants_deepseek_shapes(heads, launch, num_splits):
    seq_lens = _random_seq_lens(12, 4096, seed=heads)
    out, want = _run_decode(
        seq_lens, heads, 512, 64, 64, torch.bfloat16, num_splits, seed=heads, **launch
    )
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.double(), want, atol=1e-2, rtol=1e-2)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "heads, launch", [(16, {}), GPU_VARIANTS[1], GPU_VARIANTS[6]], ids=_launch_id
)
def test_gpu_decode_leaves_prefill_and_empty_requests_alone(heads, launch):
    _check_non_decode_rows_untouched(heads, 512, 64, 64, torch.bfloat16, 1e-2, launch)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "heads, launch", [(16, {}), GPU_VARIANTS[2], GPU_VARIANTS[4]], ids=_launch_id
)
def test_gpu_decode_cuda_graph_replay(heads, launch):
    """Captured once with split-KV, replayed with new queries and sequence lengths: the launch
    takes only python ints from the host, everything per request comes from device tensors."""
    batch, context, scale = 8, 2048, 0.05
    cache, table = make_latent_case([context] * batch, 64, 512, 64, torch.bfloat16, seed=2)
    q_nope, q_pe = _queries(batch, heads, 512, 64, torch.bfloat16, seed=3)
    lens = torch.full((batch,), context, dtype=torch.int32, device=DEVICE)
    starts = torch.arange(batch + 1, dtype=torch.int32, device=DEVICE)
    out = torch.empty_like(q_nope)

    def step():
        mla_decode(q_nope, q_pe, cache, table, lens, starts, context, scale, out, 4, **launch)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()  # compile outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for seed in (4, 5):
        seq_lens = _random_seq_lens(batch, context, seed)
        lens.copy_(torch.tensor(seq_lens, dtype=torch.int32))
        new_nope, new_pe = _queries(batch, heads, 512, 64, torch.bfloat16, seed)
        q_nope.copy_(new_nope)
        q_pe.copy_(new_pe)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        want = reference_decode(q_nope, q_pe, cache, table, seq_lens, scale)
        torch.testing.assert_close(out.double(), want, atol=1e-2, rtol=1e-2)
