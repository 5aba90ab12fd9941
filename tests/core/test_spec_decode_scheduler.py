"""Speculative decoding in the scheduler, with the fake runner verifying drafts against its
deterministic model (conftest.py): drafts are granted after a decode's last token within the
budget, max_tokens and max_model_len; rejected drafts leave num_computed_tokens; output is the
output without drafts whatever the drafts are."""

from __future__ import annotations

import random

import pytest

from v1_engine.protocol import FinishReason


def scheduled(sched_output) -> dict[str, int]:
    return dict(sched_output.num_scheduled_tokens)


def oracle(core, right: int | None = None):
    """A drafter that proposes the model's own next tokens (4 of them); with `right`, only the
    first `right` are correct and the rest are off by one."""

    def drafter(req_id: str, tokens: list[int]) -> list[int]:
        drafts: list[int] = []
        for i in range(4):
            token = core.FakeRunner().next_token(req_id, tokens + drafts)
            drafts.append(token if right is None or i < right else token + 1)
        return drafts

    return drafter


def run(core, requests, drafter=None, **scheduler_kwargs):
    scheduler = core.make_scheduler(**scheduler_kwargs)
    for request in requests:
        scheduler.add_request(request)
    transcript = core.run_to_completion(scheduler, core.FakeRunner(drafter=drafter))
    return scheduler, transcript


def test_right_drafts_yield_five_tokens_a_step(core):
    _, transcript = run(core, [core.make_request("a", 10, max_tokens=11)], oracle(core))
    _, plain = run(core, [core.make_request("a", 10, max_tokens=11)])
    assert transcript.tokens == plain.tokens
    steps = [scheduled(so) for so, _ in transcript.steps]
    # Prefill samples token 1; then 1 + 4 drafts verify, each step keeping all 5 tokens.
    assert steps == [{"a": 10}, {"a": 5}, {"a": 5}]
    assert [len(out.outputs[0].new_token_ids) for _, out in transcript.steps] == [1, 5, 5]
    second = transcript.steps[1][0]
    assert second.scheduled_spec_token_ids == {"a": plain.tokens["a"][1:5]}
    assert transcript.finish_reasons["a"] == FinishReason.LENGTH


@pytest.mark.parametrize("right", [0, 2])
def test_rejected_drafts_leave_the_computed_tokens(core, right):
    scheduler = core.make_scheduler()
    runner, transcript = core.FakeRunner(drafter=oracle(core, right)), core.Transcript()
    scheduler.add_request(core.make_request("a", 10, max_tokens=50))
    core.step(scheduler, runner, transcript)
    request = scheduler.requests["a"]
    assert (request.num_tokens, request.num_computed_tokens) == (11, 10)
    so = core.step(scheduler, runner, transcript)
    assert scheduled(so) == {"a": 5}
    # right drafts kept, plus the model's own token after them; the rest is not computed.
    assert request.num_tokens == 11 + right + 1
    assert request.num_computed_tokens == request.num_tokens - 1
    stats = transcript.steps[-1][1].scheduler_stats
    assert (stats.spec_num_drafts, stats.spec_num_draft_tokens) == (1, 4)
    assert stats.spec_num_accepted_tokens == right


def test_drafts_fit_max_tokens_max_model_len_and_the_budget(core):
    # max_tokens 3: after the first token at most 1 draft (both kept makes 3 outputs).
    _, transcript = run(core, [core.make_request("a", 10, max_tokens=3)], oracle(core))
    assert [scheduled(so) for so, _ in transcript.steps] == [{"a": 10}, {"a": 2}]
    assert len(transcript.tokens["a"]) == 3
    # max_model_len 14: 11 known tokens leave room for 2 drafts (14 tokens when all are kept).
    _, transcript = run(
        core, [core.make_request("b", 10, max_tokens=100)], oracle(core), max_model_len=14
    )
    assert [scheduled(so) for so, _ in transcript.steps] == [{"b": 10}, {"b": 3}]
    assert len(transcript.tokens["b"]) == 4
    assert transcript.finish_reasons["b"] == FinishReason.LENGTH
    # A budget of 3 tokens: two decodes share it, the first takes 1 + 2 drafts, the second waits.
    requests = [
        core.make_request(r, 2, max_tokens=20, first_token=f) for r, f in (("c", 5), ("d", 9))
    ]
    scheduler = core.make_scheduler(max_num_batched_tokens=4)
    runner, transcript = core.FakeRunner(drafter=oracle(core)), core.Transcript()
    for request in requests:
        scheduler.add_request(request)
    core.step(scheduler, runner, transcript)
    so = core.step(scheduler, runner, transcript)
    assert scheduled(so) == {"c": 4}
    assert len(so.scheduled_spec_token_ids["c"]) == 3
    so = core.step(scheduler, runner, transcript)
    assert scheduled(so) == {"c": 4}  # "d" still has its drafts from step 1, nothing more
    assert scheduler.requests["d"].spec_token_ids


def test_a_stop_token_among_the_kept_ones_ends_the_request_there(core):
    def model(req_id: str, tokens: list[int]) -> int:
        return core.EOS if len(tokens) == 14 else 300 + len(tokens)

    def drafter(req_id: str, tokens: list[int]) -> list[int]:  # the model's next 4 tokens
        drafts: list[int] = []
        for _ in range(4):
            drafts.append(model(req_id, tokens + drafts))
        return drafts

    scheduler = core.make_scheduler()
    runner = core.FakeRunner(next_token=model, drafter=drafter)
    scheduler.add_request(core.make_request("a", 10, max_tokens=50))
    transcript = core.run_to_completion(scheduler, runner)
    # 310 from the prefill, then one verify keeps 311, 312, 313, EOS and the token after it,
    # which is dropped with the request's end.
    assert transcript.tokens["a"] == [310, 311, 312, 313, core.EOS]
    assert len(transcript.steps) == 2
    assert transcript.finish_reasons["a"] == FinishReason.STOP
    assert scheduler.kv_cache_manager.num_free_blocks == 64


def test_random_drafts_and_preemption_never_change_the_output(core):
    rng = random.Random(0)

    def drafter(req_id: str, tokens: list[int]) -> list[int]:
        # Right for a random prefix, then noise; sometimes nothing.
        drafts: list[int] = []
        right = rng.randint(0, 4)
        for i in range(rng.choice([0, 1, 3, 4])):
            token = core.FakeRunner().next_token(req_id, tokens + drafts)
            drafts.append(token if i < right else rng.randint(0, 2000))
        return drafts

    def requests():
        gen = random.Random(1)
        return [
            core.make_request(f"r{i}", gen.randint(3, 40), max_tokens=gen.randint(1, 30), first_token=gen.randint(0, 900))
            for i in range(12)
        ]  # fmt: skip

    kwargs = {"num_blocks": 14, "max_num_batched_tokens": 48, "block_size": 8}
    scheduler, transcript = run(core, requests(), drafter, **kwargs)
    _, plain = run(core, requests(), **kwargs)
    assert transcript.tokens == plain.tokens
    assert transcript.finish_reasons == plain.finish_reasons
    assert scheduler.kv_cache_manager.num_free_blocks == 14
    assert any(so.scheduled_spec_token_ids for so, _ in transcript.steps)
    assert (
        sum(
            s.num_preempted_reqs for _, s in ((so, o.scheduler_stats) for so, o in transcript.steps)
        )
        > 0
    )
