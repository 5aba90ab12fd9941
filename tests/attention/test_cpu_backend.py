"""The CPU reference backend against naive dense causal attention on random inputs."""

from __future__ import annotations

import random

import pytest
import torch

from v1_engine.attention.backend import AttentionMetadata
from v1_engine.attention.cpu import CPUAttentionBackend
from v1_engine.attention.selector import get_attn_backend

HEAD_SIZE = 16
NUM_BLOCKS = 48


def dense_causal_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
) -> torch.Tensor:
    """q [Lq, Hq, D] are the last Lq positions of k/v [Lk, Hkv, D]; one head at a time."""
    q_len, num_heads, _ = q.shape
    k_len, num_kv_heads, _ = k.shape
    group = num_heads // num_kv_heads
    out = torch.empty_like(q)
    for h in range(num_heads):
        kh, vh = k[:, h // group].double(), v[:, h // group].double()
        scores = q[:, h].double() @ kh.T * scale
        allowed = torch.ones(q_len, k_len, dtype=torch.bool).tril(diagonal=k_len - q_len)
        scores[~allowed] = float("-inf")
        out[:, h] = (scores.softmax(-1) @ vh).to(q.dtype)
    return out


class PagedCase:
    """Random K/V for several requests, in a NaN-poisoned paged cache with shuffled blocks."""

    def __init__(self, seq_lens: list[int], num_heads: int, num_kv_heads: int, block_size: int):
        gen = torch.Generator().manual_seed(sum(seq_lens) + block_size)
        self.block_size = block_size
        self.seq_lens = seq_lens
        self.q = [torch.randn(n, num_heads, HEAD_SIZE, generator=gen) for n in seq_lens]
        self.k = [torch.randn(n, num_kv_heads, HEAD_SIZE, generator=gen) for n in seq_lens]
        self.v = [torch.randn(n, num_kv_heads, HEAD_SIZE, generator=gen) for n in seq_lens]
        free = list(range(NUM_BLOCKS))
        random.Random(block_size).shuffle(free)
        self.tables = [[free.pop() for _ in range(-(-n // block_size))] for n in seq_lens]
        shape = (2, NUM_BLOCKS, block_size, num_kv_heads, HEAD_SIZE)
        self.kv_cache = torch.full(shape, float("nan"))

    def metadata(self, reqs: list[int], starts: list[int], ends: list[int]) -> AttentionMetadata:
        """A step where request reqs[i] computes positions starts[i]:ends[i] (earlier ones are
        cached)."""
        query_lens = [e - s for s, e in zip(starts, ends)]
        tables = [self.tables[r] for r in reqs]
        max_blocks = max(len(t) for t in tables)
        block_table = torch.zeros(len(reqs), max_blocks, dtype=torch.int32)
        slots = []
        for i, (table, s, e) in enumerate(zip(tables, starts, ends)):
            block_table[i, : len(table)] = torch.tensor(table, dtype=torch.int32)
            bs = self.block_size
            slots += [table[p // bs] * bs + p % bs for p in range(s, e)]
        qsl = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
        seq_lens = torch.tensor(ends, dtype=torch.int32)
        return AttentionMetadata(
            num_actual_tokens=sum(query_lens),
            query_start_loc=qsl,
            seq_lens=seq_lens,
            block_table=block_table,
            slot_mapping=torch.tensor(slots, dtype=torch.int64),
            max_query_len=max(query_lens),
            max_seq_len=max(ends),
            query_start_loc_cpu=qsl.clone(),
            seq_lens_cpu=seq_lens.clone(),
        )

    def run(
        self, reqs: list[int], starts: list[int], ends: list[int], pad: int = 0
    ) -> torch.Tensor:
        """Run the backend for one step (see metadata) into a NaN-filled output; `pad` extra
        garbage rows mimic a batch padded for a captured graph."""
        q, k, v = (
            torch.cat([xs[r][s:e] for r, s, e in zip(reqs, starts, ends)])
            for xs in (self.q, self.k, self.v)
        )
        if pad:
            q = torch.cat([q, torch.randn(pad, *q.shape[1:])])
            k = torch.cat([k, torch.randn(pad, *k.shape[1:])])
            v = torch.cat([v, torch.randn(pad, *v.shape[1:])])
        output = torch.full_like(q, float("nan"))
        metadata = self.metadata(reqs, starts, ends)
        CPUAttentionBackend().forward(q, k, v, self.kv_cache, metadata, HEAD_SIZE**-0.5, output)
        return output

    def expected(self, reqs: list[int], starts: list[int], ends: list[int]) -> torch.Tensor:
        return torch.cat(
            [
                dense_causal_attention(
                    self.q[r][s:e], self.k[r][:e], self.v[r][:e], HEAD_SIZE**-0.5
                )
                for r, s, e in zip(reqs, starts, ends)
            ]
        )


HEADS = [(8, 2), (4, 4), (4, 1)]
SEQ_LENS = [1, 5, 17, 33]


ALL = [0, 1, 2, 3]


@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("num_heads,num_kv_heads", HEADS)
def test_prefill_of_several_requests(block_size, num_heads, num_kv_heads):
    case = PagedCase(SEQ_LENS, num_heads, num_kv_heads, block_size)
    starts = [0] * len(SEQ_LENS)
    out = case.run(ALL, starts, SEQ_LENS)
    torch.testing.assert_close(out, case.expected(ALL, starts, SEQ_LENS), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("num_heads,num_kv_heads", HEADS)
def test_chunk_attends_to_context_written_by_previous_call(block_size, num_heads, num_kv_heads):
    case = PagedCase(SEQ_LENS, num_heads, num_kv_heads, block_size)
    case.run([1, 2, 3], [0, 0, 0], [3, 9, 20])
    # Next call: request 0 starts, 1 and 2 finish their prompts, 3 gains 4 more tokens.
    starts, ends = [0, 3, 9, 20], [1, 5, 17, 24]
    out = case.run(ALL, starts, ends)
    torch.testing.assert_close(out, case.expected(ALL, starts, ends), atol=1e-5, rtol=1e-5)


def test_decode_step_after_prefill():
    case = PagedCase(SEQ_LENS, 8, 2, 4)
    case.run([1, 2, 3], [0, 0, 0], [4, 16, 32])
    starts = [n - 1 for n in SEQ_LENS]
    out = case.run([1, 2, 3], starts[1:], SEQ_LENS[1:])
    expected = case.expected([1, 2, 3], starts[1:], SEQ_LENS[1:])
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def test_new_kv_lands_in_its_slots():
    case = PagedCase([6, 3], 4, 2, 4)
    case.run([0, 1], [0, 0], [6, 3])
    for table, k, v in zip(case.tables, case.k, case.v):
        flat = case.kv_cache[:, table].reshape(2, -1, *case.kv_cache.shape[3:])
        torch.testing.assert_close(flat[0, : k.shape[0]], k, atol=0, rtol=0)
        torch.testing.assert_close(flat[1, : v.shape[0]], v, atol=0, rtol=0)


def test_padding_rows_are_zeroed():
    case = PagedCase([5, 7], 4, 2, 4)
    out = case.run([0, 1], [0, 0], [5, 7], pad=3)
    expected = case.expected([0, 1], [0, 0], [5, 7])
    torch.testing.assert_close(out[:12], expected, atol=1e-5, rtol=1e-5)
    assert torch.equal(out[12:], torch.zeros_like(out[12:]))


def test_selector_returns_reference_backend_on_cpu():
    assert isinstance(get_attn_backend(torch.device("cpu")), CPUAttentionBackend)
    with pytest.raises(ValueError, match="device"):
        get_attn_backend(torch.device("meta"))
