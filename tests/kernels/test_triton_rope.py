"""The one-kernel rotary (kernels/triton_rope.py) and the `v1_engine::rotary_embedding` op.

Without CUDA the kernel runs under the Triton interpreter (TRITON_INTERPRET=1) on tiny shapes:
both styles, query/key as strided views of a fused QKV output (and DeepSeek's rope slices),
head sizes whose half is not a power of two, more heads than one program's head block, and
attention scaling. Two oracles: the PyTorch reference (`rotary_embedding_ref`, the op's CPU
body) and a float64 complex rotation independent of both. The op itself is checked on CPU
(bit-identical to the module's previous code, eager and under torch.compile with an unbacked
token count; off CUDA the module calls the reference directly so Inductor still fuses it);
the `gpu` cases run Llama-3-8B and DeepSeek shapes on CUDA, including a CUDA graph replay and
a profile of the compiled layer (one rotary kernel, no Inductor kernels).
"""

from __future__ import annotations

import pytest
import torch

# On the CPU the kernel runs under Triton's interpreter, which tests/conftest.py turns on
# before any kernel module is imported.
pytest.importorskip("triton")

from v1_engine.kernels import triton_rope
from v1_engine.layers.rotary import (
    RotaryEmbedding,
    compute_inv_freq,
    get_scaled_rope,
    rotary_embedding_ref,
)

_CUDA = torch.cuda.is_available()
interpreter_only = pytest.mark.skipif(_CUDA, reason="the gpu cases cover this on a CUDA machine")
DEVICE = "cuda" if _CUDA else "cpu"
MAX_POSITION = 4096


def make_rope(head_size: int, is_neox_style: bool, scaling: float = 1.0) -> RotaryEmbedding:
    inv_freq = compute_inv_freq(head_size, {"rope_type": "default", "rope_theta": 10000.0})
    return RotaryEmbedding(head_size, MAX_POSITION, inv_freq, scaling, is_neox_style).to(DEVICE)


def fused_qkv(num_tokens, num_q_heads, num_kv_heads, head_size, dtype, seed):
    """query [T, Hq, D] and key [T, Hkv, D] as views of one [T, (Hq + 2 Hkv) D] GEMM output:
    the layout the attention layers hand to the rotary (token stride > H * D)."""
    gen = torch.Generator().manual_seed(seed)
    width = (num_q_heads + 2 * num_kv_heads) * head_size
    qkv = torch.randn(num_tokens, width, generator=gen).to(DEVICE, dtype)
    q, k, _ = qkv.split(
        [num_q_heads * head_size, num_kv_heads * head_size, num_kv_heads * head_size], dim=-1
    )
    return (
        q.view(num_tokens, num_q_heads, head_size),
        k.view(num_tokens, num_kv_heads, head_size),
    )


def random_positions(num_tokens, seed, device=DEVICE, dtype=torch.int64):
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, MAX_POSITION, (num_tokens,), generator=gen).to(device, dtype)


def rope_fp32_once(positions, x, cos_cache, sin_cache, is_neox_style):
    """What the kernel computes: float32 rotation rounded once to x's dtype; the neox style
    first rounds cos/sin to x's dtype, as the reference does."""
    cos, sin = cos_cache[positions][:, None, :], sin_cache[positions][:, None, :]
    if is_neox_style:
        cos, sin = cos.to(x.dtype).float(), sin.to(x.dtype).float()
    return rotary_embedding_ref_pairs(x.float(), cos, sin, is_neox_style).to(x.dtype)


def rotary_embedding_ref_pairs(x, cos, sin, is_neox_style):
    half = x.shape[-1] // 2
    x1, x2 = (x[..., :half], x[..., half:]) if is_neox_style else (x[..., 0::2], x[..., 1::2])
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def rope_complex64(positions, x, rope: RotaryEmbedding):
    """Independent oracle: each pair as a complex number times scale * e^(i * pos * freq), in
    float64 from the inverse frequencies (not the float32 tables); interleaved output is the
    rotated evens followed by the rotated odds."""
    half = x.shape[-1] // 2
    x = x.double()
    if rope.is_neox_style:
        pairs = torch.complex(x[..., :half], x[..., half:])
    else:
        pairs = torch.complex(x[..., 0::2], x[..., 1::2])
    table = rope.cos_cache.double()[positions] + 1j * rope.sin_cache.double()[positions]
    rotated = pairs * table[:, None, :]
    return torch.cat((rotated.real, rotated.imag), dim=-1)


def _cases():
    # (T, Hq, Hkv, D, neox, scaling): D=12 has a half (6) that is not a power of two; D=128 with
    # 6 query heads needs two head blocks (4 heads each), the second one partial.
    return [
        (1, 6, 2, 128, True, 1.0),
        (5, 6, 2, 128, False, 0.75),
        (5, 5, 3, 12, True, 1.3),
        (1, 4, 1, 64, False, 1.0),
        (5, 3, 3, 64, True, 0.6),
    ]


@interpreter_only
@pytest.mark.parametrize(("tokens", "hq", "hkv", "head_size", "neox", "scaling"), _cases())
def test_kernel_float32_matches_reference(tokens, hq, hkv, head_size, neox, scaling):
    rope = make_rope(head_size, neox, scaling)
    q, k = fused_qkv(tokens, hq, hkv, head_size, torch.float32, seed=tokens + head_size)
    assert q.untyped_storage().data_ptr() == k.untyped_storage().data_ptr()  # views of qkv
    positions = random_positions(tokens, seed=hq)
    q_out, k_out = triton_rope.rotary_embedding(
        positions, q, k, rope.cos_cache, rope.sin_cache, neox
    )
    want_q, want_k = rotary_embedding_ref(positions, q, k, rope.cos_cache, rope.sin_cache, neox)
    assert q_out.is_contiguous() and q_out.shape == q.shape and k_out.shape == k.shape
    torch.testing.assert_close(q_out, want_q, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(k_out, want_k, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(
        q_out.double(), rope_complex64(positions, q, rope), atol=2e-6, rtol=0
    )
    torch.testing.assert_close(
        k_out.double(), rope_complex64(positions, k, rope), atol=2e-6, rtol=0
    )


@interpreter_only
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("neox", [True, False])
def test_kernel_half_precision_rounds_once(neox, dtype):
    rope = make_rope(64, neox, 0.8)
    q, k = fused_qkv(5, 4, 2, 64, dtype, seed=3)
    positions = random_positions(5, seed=4, dtype=torch.int32)
    q_out, k_out = triton_rope.rotary_embedding(
        positions, q, k, rope.cos_cache, rope.sin_cache, neox
    )
    assert q_out.dtype == k_out.dtype == dtype
    for out, x in ((q_out, q), (k_out, k)):
        once = rope_fp32_once(positions, x, rope.cos_cache, rope.sin_cache, neox)
        if dtype == torch.float16:
            assert torch.equal(out, once)
        else:
            # The interpreter converts float32 to bfloat16 by truncation (the GPU rounds to
            # nearest even), so here the result is only within an ulp or two of `once`.
            torch.testing.assert_close(out, once, atol=1e-2, rtol=1.6e-2)
    want_q, want_k = rotary_embedding_ref(positions, q, k, rope.cos_cache, rope.sin_cache, neox)
    torch.testing.assert_close(q_out, want_q, atol=3e-2, rtol=2e-2)
    torch.testing.assert_close(k_out, want_k, atol=3e-2, rtol=2e-2)


@interpreter_only
def test_kernel_on_deepseek_rope_slices():
    """q_pe: the rope tail of [T, H, nope + rope]; k_pe: [T, 1, rope] from the latent
    projection's split, unsqueezed; YaRN scaling (attention factor != 1), interleaved."""
    rope = get_scaled_rope(
        16,
        MAX_POSITION,
        {
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 40.0,
            "original_max_position_embeddings": 64,
            "mscale": 1.0,
            "mscale_all_dim": 0.8,
        },
        is_neox_style=False,
    ).to(DEVICE)
    gen = torch.Generator().manual_seed(7)
    q = torch.randn(5, 3, 24 + 16, generator=gen).to(DEVICE)
    latent = torch.randn(5, 32 + 16, generator=gen).to(DEVICE)
    q_pe = q.split([24, 16], dim=-1)[1]
    k_pe = latent.split([32, 16], dim=-1)[1].unsqueeze(1)
    positions = random_positions(5, seed=8)
    q_out, k_out = triton_rope.rotary_embedding(
        positions, q_pe, k_pe, rope.cos_cache, rope.sin_cache, False
    )
    want_q, want_k = rotary_embedding_ref(
        positions, q_pe, k_pe, rope.cos_cache, rope.sin_cache, False
    )
    torch.testing.assert_close(q_out, want_q, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(k_out, want_k, atol=1e-6, rtol=1e-6)


def test_kernel_rejects_bad_arguments():
    rope = make_rope(8, True)
    q, k = torch.zeros(2, 2, 8, device=DEVICE), torch.zeros(2, 1, 8, device=DEVICE)
    positions = torch.zeros(2, dtype=torch.int64, device=DEVICE)
    cos, sin = rope.cos_cache, rope.sin_cache
    with pytest.raises(ValueError, match="query dtype must be one of"):
        triton_rope.rotary_embedding(positions, q.double(), k.double(), cos, sin, True)
    with pytest.raises(ValueError, match="key dtype must equal"):
        triton_rope.rotary_embedding(positions, q, k.half(), cos, sin, True)
    with pytest.raises(ValueError, match="head sizes must be equal and even"):
        triton_rope.rotary_embedding(positions, q[..., :7], k[..., :7], cos, sin, True)
    with pytest.raises(ValueError, match="disagree on T"):
        triton_rope.rotary_embedding(positions[:1], q, k, cos, sin, True)
    with pytest.raises(ValueError, match="positions dtype"):
        triton_rope.rotary_embedding(positions.float(), q, k, cos, sin, True)
    with pytest.raises(ValueError, match=r"cos_cache must be float32 \[max_position, 4\]"):
        triton_rope.rotary_embedding(positions, q, k, cos.half(), sin, True)
    with pytest.raises(ValueError, match="query and key head size must be 8"):
        rope(positions, q[..., :4], k[..., :4])


def test_launch_config_spreads_a_decode_token_over_programs():
    # Llama-3-8B: 32 query + 8 key heads of 128 → 4 heads per program, 10 programs.
    assert triton_rope.rope_launch_config(32, 128) == (4, 4)
    # DeepSeek rope part (64): 8 heads per program; a single key head gets a block of its own.
    assert triton_rope.rope_launch_config(16, 64)[0] == 8
    assert triton_rope.rope_launch_config(1, 256) == (1, 2)


# ------------------------------------------------------------------------------------------
# The op on CPU: exactly the reference, eager and compiled.
# ------------------------------------------------------------------------------------------


def _legacy_rotary(rope: RotaryEmbedding, positions, query, key):
    """The module's forward before the op existed, kept verbatim: CPU results must not move."""

    def rotate(x, cos, sin):
        if rope.is_neox_style:
            half = rope.head_size // 2
            x1, x2 = x[..., :half], x[..., half:]
        else:
            x1, x2 = x[..., 0::2], x[..., 1::2]
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)

    if not rope.is_neox_style:
        cos = rope.cos_cache[positions][:, None, :]
        sin = rope.sin_cache[positions][:, None, :]
        return rotate(query.float(), cos, sin).to(query.dtype), rotate(key.float(), cos, sin).to(
            key.dtype
        )
    cos = rope.cos_cache[positions].to(query.dtype)[:, None, :]
    sin = rope.sin_cache[positions].to(query.dtype)[:, None, :]
    return rotate(query, cos, sin), rotate(key, cos, sin)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("neox", [True, False])
def test_cpu_module_and_op_are_bit_identical_to_the_previous_module(dtype, neox):
    rope = RotaryEmbedding(32, 64, compute_inv_freq(32, {"rope_theta": 500.0}), 0.9, neox)
    gen = torch.Generator().manual_seed(11)
    qkv = torch.randn(5, (4 + 2 + 2) * 32, generator=gen).to(dtype)
    q, k = qkv[:, :128].view(5, 4, 32), qkv[:, 128:192].view(5, 2, 32)
    positions = torch.tensor([0, 63, 7, 7, 31])
    want_q, want_k = _legacy_rotary(rope, positions, q, k)
    q_out, k_out = rope(positions, q, k)
    assert torch.equal(q_out, want_q) and torch.equal(k_out, want_k)
    assert q_out.dtype == k_out.dtype == dtype
    op_q, op_k = torch.ops.v1_engine.rotary_embedding(
        positions, q, k, rope.cos_cache, rope.sin_cache, neox
    )
    assert torch.equal(op_q, want_q) and torch.equal(op_k, want_k)


@pytest.mark.parametrize("neox", [True, False])
def test_op_under_compile_with_unbacked_tokens_matches_eager(neox):
    """The attention layer's pattern (split of a fused QKV, views, rotary) compiled once with
    the token count unbacked, as compile/compiled_forward.py marks it, for T = 1 and T = 5."""
    rope = RotaryEmbedding(16, 64, compute_inv_freq(16, {"rope_theta": 10000.0}), 1.2, neox)

    def layer(positions, qkv):
        t = qkv.shape[0]
        q, k, _ = qkv.split([64, 32, 32], dim=-1)
        q_out, k_out = torch.ops.v1_engine.rotary_embedding(
            positions, q.view(t, 4, 16), k.view(t, 2, 16), rope.cos_cache, rope.sin_cache, neox
        )
        return q_out * 2, k_out + 1

    from torch._dynamo.testing import CompileCounterWithBackend  # after TRITON_INTERPRET is set

    counter = CompileCounterWithBackend("inductor")
    compiled = torch.compile(layer, backend=counter, fullgraph=True)
    torch._dynamo.reset()
    for tokens in (5, 1, 3):
        qkv = torch.randn(tokens, 128, generator=torch.Generator().manual_seed(tokens))
        positions = random_positions(tokens, seed=tokens, device="cpu") % 64
        torch._dynamo.decorators.mark_unbacked(qkv, 0)
        torch._dynamo.decorators.mark_unbacked(positions, 0)
        got, want = compiled(positions, qkv), layer(positions, qkv)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert counter.frame_count == 1
    torch._dynamo.reset()


# ------------------------------------------------------------------------------------------
# CUDA: the op dispatches to the kernel.
# ------------------------------------------------------------------------------------------

LLAMA3_8B = (32, 8, 128)  # query heads, key heads, head size


def _gpu_case(tokens, hq, hkv, head_size, neox, dtype, scaling=1.0, seed=0):
    rope = make_rope(head_size, neox, scaling)
    q, k = fused_qkv(tokens, hq, hkv, head_size, dtype, seed)
    positions = random_positions(tokens, seed + 1)
    return rope, positions, q, k


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 7, 333])
@pytest.mark.parametrize("neox", [True, False])
def test_gpu_float32_is_tight(tokens, neox):
    rope, positions, q, k = _gpu_case(tokens, *LLAMA3_8B, neox, torch.float32, scaling=0.9)
    q_out, k_out = rope(positions, q, k)
    want_q, want_k = rotary_embedding_ref(positions, q, k, rope.cos_cache, rope.sin_cache, neox)
    torch.testing.assert_close(q_out, want_q, atol=2e-6, rtol=2e-6)
    torch.testing.assert_close(k_out, want_k, atol=2e-6, rtol=2e-6)
    torch.testing.assert_close(
        q_out.double(), rope_complex64(positions, q, rope), atol=4e-6, rtol=0
    )


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("neox", [True, False])
@pytest.mark.parametrize("shape", [LLAMA3_8B, (16, 1, 64), (12, 4, 80), (8, 8, 256)])
def test_gpu_half_precision_matches_reference(dtype, neox, shape):
    rope, positions, q, k = _gpu_case(129, *shape, neox, dtype, scaling=1.1, seed=5)
    q_out, k_out = torch.ops.v1_engine.rotary_embedding(
        positions, q, k, rope.cos_cache, rope.sin_cache, neox
    )
    for out, x in ((q_out, q), (k_out, k)):
        once = rope_fp32_once(positions, x, rope.cos_cache, rope.sin_cache, neox)
        # Same rounding as the kernel, up to fused multiply-adds: at most one ulp apart.
        torch.testing.assert_close(out.float(), once.float(), atol=1e-2, rtol=8e-3)
        assert (out != once).float().mean() < 0.01
    want_q, want_k = rotary_embedding_ref(positions, q, k, rope.cos_cache, rope.sin_cache, neox)
    torch.testing.assert_close(q_out, want_q, atol=3e-2, rtol=2e-2)
    torch.testing.assert_close(k_out, want_k, atol=3e-2, rtol=2e-2)


@pytest.mark.gpu
def test_gpu_cuda_graph_replay_follows_new_positions():
    rope, positions, q, k = _gpu_case(4, *LLAMA3_8B, True, torch.bfloat16, seed=9)
    rope(positions, q, k)  # compile the kernel outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        q_out, k_out = rope(positions, q, k)
    positions.copy_(random_positions(4, seed=10))
    q.copy_(torch.randn_like(q))
    graph.replay()
    want_q, want_k = rotary_embedding_ref(positions, q, k, rope.cos_cache, rope.sin_cache, True)
    torch.testing.assert_close(q_out, want_q, atol=3e-2, rtol=2e-2)
    torch.testing.assert_close(k_out, want_k, atol=3e-2, rtol=2e-2)


@pytest.mark.gpu
def test_gpu_compiled_layer_runs_one_rope_kernel():
    """Under torch.compile the attention layer's QKV GEMM, split and rotary leave one kernel
    for the rotary: no Inductor gathers and no copies of the strided query/key views."""
    hq, hkv, head_size = LLAMA3_8B
    rope = make_rope(head_size, True)
    gen = torch.Generator().manual_seed(12)
    weight = (torch.randn((hq + 2 * hkv) * head_size, 256, generator=gen) / 16).to(DEVICE)
    weight = weight.to(torch.bfloat16)

    def layer(positions, x):
        t = x.shape[0]
        q, k, _ = (x @ weight.t()).split([hq * head_size, hkv * head_size, hkv * head_size], -1)
        return rope(positions, q.view(t, hq, head_size), k.view(t, hkv, head_size))

    x = torch.randn(3, 256, generator=gen).to(DEVICE, torch.bfloat16)
    positions = random_positions(3, seed=13)
    compiled = torch.compile(layer, fullgraph=True)
    compiled(positions, x)
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        q_out, k_out = compiled(positions, x)
        torch.cuda.synchronize()
    names = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    assert sum("_rope_kernel" in n for n in names) == 1, names
    assert not any("triton_" in n for n in names), names
    want_q, want_k = layer(positions, x)  # eager: the same op, so the same kernel
    assert torch.equal(q_out, want_q) and torch.equal(k_out, want_k)
