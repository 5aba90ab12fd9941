"""Logprobs of sampled and prompt tokens, and their conversion to user-facing dicts."""

from __future__ import annotations

from collections.abc import Callable

import torch

from v1_engine.outputs import Logprob
from v1_engine.protocol import LogprobsLists
from v1_engine.sample.logprobs import compute_prompt_logprobs, decode_logprobs
from v1_engine.sample.metadata import SamplingMetadata
from v1_engine.sample.sampler import Sampler
from v1_engine.sampling_params import SamplingParams

BuildMetadata = Callable[..., SamplingMetadata]
VOCAB = 50


def expected_rank(logprobs: torch.Tensor, token_id: int) -> int:
    return int((logprobs > logprobs[token_id]).sum()) + 1


def test_sampled_logprobs_are_raw_log_softmax_with_ranks(build_metadata: BuildMetadata) -> None:
    logits = torch.randn(4, VOCAB) * 2
    params = [
        SamplingParams(temperature=0.0, logprobs=3),
        SamplingParams(temperature=2.0, repetition_penalty=1.5, logprobs=1),
        SamplingParams(temperature=0.7, top_k=10, presence_penalty=2.0),
        SamplingParams(temperature=1.0, min_p=0.2, logprobs=0),
    ]
    metadata = build_metadata(params, VOCAB, prompts=[[1], [2, 3], [4], [5]], outputs=[[6]] * 4)
    output = Sampler()(logits, metadata)
    assert output.logprobs is not None
    raw = torch.log_softmax(logits.double(), dim=1)
    lists = output.logprobs.to_lists()
    sampled = output.sampled_token_ids.tolist()
    for row in range(4):
        ids = lists.token_ids[row]
        assert len(ids) == 4 and ids[0] == sampled[row]
        assert ids[1:] == raw[row].topk(3).indices.tolist()
        torch.testing.assert_close(
            torch.tensor(lists.logprobs[row], dtype=torch.float64), raw[row, ids]
        )
        assert lists.ranks[row] == expected_rank(raw[row], sampled[row])
    assert lists.ranks[0] == 1


def test_no_logprobs_requested_gives_none(build_metadata: BuildMetadata) -> None:
    output = Sampler()(torch.randn(2, VOCAB), build_metadata([SamplingParams()] * 2, VOCAB))
    assert output.logprobs is None


def test_prompt_logprobs_score_the_next_token() -> None:
    logits = torch.randn(5, VOCAB)
    targets = torch.tensor([7, 3, 3, 49, 0])
    tensors = compute_prompt_logprobs(logits, targets, num_logprobs=2)
    raw = torch.log_softmax(logits.double(), dim=1)
    assert tensors.token_ids[:, 0].tolist() == targets.tolist()
    assert tensors.token_ids[:, 1:].tolist() == raw.topk(2, dim=1).indices.tolist()
    torch.testing.assert_close(tensors.logprobs.double(), raw.gather(1, tensors.token_ids))
    assert tensors.ranks.tolist() == [expected_rank(raw[i], int(t)) for i, t in enumerate(targets)]
    tail = tensors.slice_rows(3, 5)
    assert tail.num_rows == 2 and torch.equal(tail.token_ids, tensors.token_ids[3:])


class CharTokenizer:
    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(ord("a") + t) for t in token_ids)


def test_logprob_dicts_include_the_sampled_token_outside_the_top_n() -> None:
    lists = LogprobsLists(
        token_ids=[[5, 1, 2], [1, 1, 2]],
        logprobs=[[-3.0, -0.5, -1.0], [-0.5, -0.5, -1.0]],
        ranks=[9, 1],
    )
    dicts = decode_logprobs(lists, CharTokenizer())
    assert dicts[0] == {
        5: Logprob(-3.0, 9, "f"),
        1: Logprob(-0.5, 1, "b"),
        2: Logprob(-1.0, 2, "c"),
    }
    assert list(dicts[0]) == [5, 1, 2]  # the sampled token comes first
    assert dicts[1] == {1: Logprob(-0.5, 1, "b"), 2: Logprob(-1.0, 2, "c")}
    undecoded = decode_logprobs(lists, None)[0]
    assert undecoded[5] == Logprob(-3.0, 9, None) and undecoded[2] == Logprob(-1.0, 2, None)
