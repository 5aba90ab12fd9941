"""Scheduler behaviour on CPU with a fake model runner (see conftest.py)."""

from __future__ import annotations

import pytest

from v1_engine.core.request import Request, RequestStatus
from v1_engine.protocol import EngineCoreRequest, FinishReason
from v1_engine.sampling_params import SamplingParams


def scripted(prompt_len: int, script: list[int]):
    """next_token that returns script[i] for the i-th output token, then 100, 101, ..."""

    def next_token(req_id: str, tokens: list[int]) -> int:
        index = len(tokens) - prompt_len
        return script[index] if index < len(script) else 100 + index

    return next_token


def scheduled(sched_output) -> dict[str, int]:
    return dict(sched_output.num_scheduled_tokens)


# --- token budget, chunked prefill, max_num_seqs ---------------------------------------------


def test_long_prompt_is_chunked_and_later_requests_share_the_budget(core):
    scheduler = core.make_scheduler(max_num_batched_tokens=64)
    runner, transcript = core.FakeRunner(), core.Transcript()
    scheduler.add_request(core.make_request("long", 150))
    scheduler.add_request(core.make_request("short", 10))

    steps = [scheduled(core.step(scheduler, runner, transcript)) for _ in range(4)]
    assert steps == [
        {"long": 64},
        {"long": 64},
        {"long": 22, "short": 10},
        {"long": 1, "short": 1},
    ]
    # Nothing is sampled for a chunk that stops short of the prompt's end.
    assert [len(out.outputs) for _, out in transcript.steps] == [0, 0, 2, 2]
    assert transcript.steps[0][0].total_num_scheduled_tokens == 64
    long_request = scheduler.requests["long"]
    assert long_request.num_computed_tokens == 151
    assert long_request.num_output_tokens == 2


def test_only_new_block_ids_travel_for_running_requests(core):
    scheduler = core.make_scheduler(max_num_batched_tokens=20, block_size=16)
    runner, transcript = core.FakeRunner(), core.Transcript()
    scheduler.add_request(core.make_request("a", 40))
    first = core.step(scheduler, runner, transcript)
    assert first.scheduled_new_reqs[0].block_ids == [0, 1]
    second = core.step(scheduler, runner, transcript)
    (cached,) = second.scheduled_cached_reqs
    assert (cached.new_block_ids, cached.num_computed_tokens) == ([2], 20)
    assert scheduler.kv_cache_manager.get_block_ids("a") == [0, 1, 2]


def test_without_chunked_prefill_a_prompt_that_does_not_fit_waits(core):
    scheduler = core.make_scheduler(
        max_num_batched_tokens=64, max_model_len=64, enable_chunked_prefill=False
    )
    runner, transcript = core.FakeRunner(), core.Transcript()
    scheduler.add_request(core.make_request("a", 40))
    scheduler.add_request(core.make_request("b", 40, first_token=3000))
    scheduler.add_request(core.make_request("c", 5, first_token=5000))
    assert scheduled(core.step(scheduler, runner, transcript)) == {"a": 40}
    # c would fit, but admission is first come first served: it waits behind b.
    assert [r.request_id for r in scheduler.waiting] == ["b", "c"]
    assert scheduled(core.step(scheduler, runner, transcript)) == {"a": 1, "b": 40, "c": 5}


def test_max_num_seqs_caps_running_requests(core):
    scheduler = core.make_scheduler(max_num_seqs=2, max_num_batched_tokens=100)
    runner = core.FakeRunner()
    for req_id, max_tokens in (("a", 2), ("b", 5), ("c", 3)):
        scheduler.add_request(core.make_request(req_id, 8, max_tokens=max_tokens))
    transcript = core.Transcript()
    assert scheduled(core.step(scheduler, runner, transcript)) == {"a": 8, "b": 8}
    assert scheduled(core.step(scheduler, runner, transcript)) == {"a": 1, "b": 1}
    assert transcript.finish_reasons == {"a": FinishReason.LENGTH}
    # a finished, so c takes its seat.
    assert scheduled(core.step(scheduler, runner, transcript)) == {"b": 1, "c": 8}
    assert scheduler.make_stats().num_running_reqs == 2


def test_scheduling_never_passes_max_model_len(core):
    scheduler = core.make_scheduler(max_model_len=14, max_num_batched_tokens=64)
    scheduler.add_request(core.make_request("a", 10, max_tokens=None))
    transcript = core.run_to_completion(scheduler, core.FakeRunner())
    assert len(transcript.tokens["a"]) == 4
    assert transcript.finish_reasons["a"] == FinishReason.LENGTH
    computed = sum(s.num_scheduled_tokens.get("a", 0) for s, _ in transcript.steps)
    assert computed == 13  # the last token is sampled, never computed


def test_add_request_rejects_bad_input(core):
    scheduler = core.make_scheduler(max_model_len=16)
    scheduler.add_request(core.make_request("a", 4))
    with pytest.raises(ValueError, match="already"):
        scheduler.add_request(core.make_request("a", 4))
    with pytest.raises(ValueError, match="max_model_len"):
        scheduler.add_request(core.make_request("b", 17))
    with pytest.raises(ValueError, match="at least one token"):
        scheduler.add_request(core.make_request("c", []))


def test_request_from_engine_core_request():
    params = SamplingParams(max_tokens=3)
    request = Request.from_engine_core_request(
        EngineCoreRequest(
            request_id="r", prompt_token_ids=[5, 6], sampling_params=params, eos_token_id=9
        )
    )
    assert (request.request_id, request.prompt_token_ids, request.eos_token_id) == ("r", [5, 6], 9)
    assert request.status == RequestStatus.WAITING and request.num_cached_tokens == -1
    request.append_output_token_ids(7)
    assert request.all_token_ids == [5, 6, 7] and request.num_tokens == 3
    assert request.get_finished_reason() is None


# --- prefix caching ---------------------------------------------------------------------------


def test_second_request_reuses_a_three_block_prefix(core):
    scheduler = core.make_scheduler(block_size=16, max_num_batched_tokens=256)
    runner, transcript = core.FakeRunner(), core.Transcript()
    shared = list(range(2000, 2048))
    scheduler.add_request(core.make_request("a", shared + [1, 2, 3]))
    core.step(scheduler, runner, transcript)
    scheduler.add_request(core.make_request("b", shared + [7, 8]))
    sched_output = core.step(scheduler, runner, transcript)

    (new,) = sched_output.scheduled_new_reqs
    assert (new.req_id, new.num_computed_tokens) == ("b", 48)
    assert sched_output.num_scheduled_tokens["b"] == 2
    assert scheduler.requests["b"].num_cached_tokens == 48
    (out_b,) = [o for o in transcript.steps[-1][1].outputs if o.request_id == "b"]
    assert out_b.num_cached_tokens == 48
    stats = transcript.steps[-1][1].scheduler_stats
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (50, 48)

    kv = scheduler.kv_cache_manager
    assert kv.get_block_ids("a")[:3] == kv.get_block_ids("b")[:3]
    assert [block.ref_cnt for block in kv.get_blocks("b")[:3]] == [2, 2, 2]


def test_identical_prompt_recomputes_its_last_token(core):
    scheduler = core.make_scheduler(block_size=16, max_num_batched_tokens=256)
    runner = core.FakeRunner()
    scheduler.add_request(core.make_request("a", 48, max_tokens=1))
    core.run_to_completion(scheduler, runner)
    scheduler.add_request(core.make_request("b", 48, max_tokens=1))
    sched_output = scheduler.schedule()
    assert sched_output.scheduled_new_reqs[0].num_computed_tokens == 32
    assert sched_output.num_scheduled_tokens == {"b": 16}


def test_prefix_caching_disabled(core):
    scheduler = core.make_scheduler(enable_prefix_caching=False, max_num_batched_tokens=256)
    runner = core.FakeRunner()
    scheduler.add_request(core.make_request("a", 48, max_tokens=1))
    core.run_to_completion(scheduler, runner)
    scheduler.add_request(core.make_request("b", 49, max_tokens=1))
    assert scheduler.schedule().num_scheduled_tokens == {"b": 49}
    assert scheduler.requests["b"].num_cached_tokens == 0


# --- priority policy -------------------------------------------------------------------------


def _prioritized(core, req_id, priority, arrival, prompt=8, **params):
    request = core.make_request(req_id, prompt, first_token=1000 + 100 * arrival, **params)
    request.priority, request.arrival_time = priority, float(arrival)
    return request


def test_priority_orders_admission_ties_by_arrival(core):
    scheduler = core.make_scheduler(max_num_seqs=1, scheduling_policy="priority")
    for req_id, priority, arrival in (("late", 5, 0), ("urgent", -1, 1), ("b", 0, 3), ("a", 0, 2)):
        scheduler.add_request(_prioritized(core, req_id, priority, arrival, max_tokens=2))
    assert [r.request_id for r in scheduler.waiting] == ["urgent", "a", "b", "late"]
    transcript = core.run_to_completion(scheduler, core.FakeRunner())
    admitted = [new.req_id for s, _ in transcript.steps for new in s.scheduled_new_reqs]
    assert admitted == ["urgent", "a", "b", "late"]
    fcfs = core.make_scheduler(max_num_seqs=1)
    for req_id, priority, arrival in (("late", 5, 0), ("urgent", -1, 1)):
        fcfs.add_request(_prioritized(core, req_id, priority, arrival, max_tokens=2))
    assert [r.request_id for r in fcfs.waiting] == ["late", "urgent"]  # fcfs ignores it


def test_priority_preempts_the_least_urgent_running_request(core):
    # 6 blocks of 4 tokens; each request grows to 4 blocks: one must give way.
    def victims(policy):
        scheduler = core.make_scheduler(num_blocks=6, block_size=4, scheduling_policy=policy)
        scheduler.add_request(_prioritized(core, "early_low", 9, 0, max_tokens=8))
        scheduler.add_request(_prioritized(core, "late_high", 0, 1, max_tokens=8))
        transcript = core.run_to_completion(scheduler, core.FakeRunner(block_size=4))
        assert all(len(t) == 8 for t in transcript.tokens.values())
        assert scheduler.kv_cache_manager.num_free_blocks == 6
        sent_as_new = [new.req_id for s, _ in transcript.steps for new in s.scheduled_new_reqs]
        return {r for r in sent_as_new if sent_as_new.count(r) > 1}  # preempted, then resumed

    assert victims("priority") == {"early_low"}
    assert victims("fcfs") == {"late_high"}  # the last one to arrive


# --- preemption -------------------------------------------------------------------------------


def test_preemption_recomputes_the_last_request_which_still_finishes_whole(core):
    # 5 blocks of 4 tokens; each request needs up to ceil((8 + 8 - 1) / 4) = 4 blocks.
    def new_scheduler(num_blocks):
        scheduler = core.make_scheduler(
            num_blocks=num_blocks, block_size=4, max_num_batched_tokens=64
        )
        for req_id, first_token in (("first", 1000), ("second", 2000)):
            scheduler.add_request(
                core.make_request(req_id, 8, first_token=first_token, max_tokens=8)
            )
        return scheduler

    scheduler = new_scheduler(num_blocks=5)
    transcript = core.run_to_completion(scheduler, core.FakeRunner(block_size=4))

    preempted_at = [
        i for i, (s, _) in enumerate(transcript.steps) if "second" in s.finished_req_ids
    ]
    assert preempted_at, "the pool is too small for both: second must be preempted"
    sent_as_new = [new.req_id for s, _ in transcript.steps for new in s.scheduled_new_reqs]
    assert sent_as_new.count("first") == 1, "the earlier request is never the victim"
    assert sent_as_new.count("second") == 1 + len(preempted_at)
    preempting_steps = [s for s, o in transcript.steps if o.scheduler_stats.num_preempted_reqs]
    assert preempting_steps
    # A step short of blocks admits nobody, not even the request it just preempted.
    assert all(not s.scheduled_new_reqs for s in preempting_steps)
    resumed = [
        new
        for s, _ in transcript.steps[preempted_at[0] + 1 :]
        for new in s.scheduled_new_reqs
        if new.req_id == "second"
    ]
    assert resumed and resumed[0].output_token_ids, "resumed with the tokens generated so far"

    # The same two requests with room for both: identical tokens, no preemption.
    roomy = new_scheduler(num_blocks=64)
    reference = core.run_to_completion(roomy, core.FakeRunner(block_size=4))
    assert transcript.tokens == reference.tokens
    assert all(len(tokens) == 8 for tokens in transcript.tokens.values())
    assert scheduler.kv_cache_manager.num_free_blocks == 5


def test_prompt_logprobs_are_not_repeated_after_a_preemption(core):
    scheduler = core.make_scheduler(num_blocks=6, block_size=4, max_num_batched_tokens=8)
    scheduler.add_request(core.make_request("decoder", 4, max_tokens=20))
    scheduler.add_request(
        core.make_request("scored", 20, first_token=3000, max_tokens=1, prompt_logprobs=1)
    )
    transcript = core.run_to_completion(scheduler, core.FakeRunner(block_size=4))

    # Find the preemption: "scored" is dropped by the runner after some rows were returned.
    rows_before_preemption = 0
    for sched_output, outputs in transcript.steps:
        if "scored" in sched_output.finished_req_ids:
            break
        for out in outputs.outputs:
            if out.request_id == "scored" and out.new_prompt_logprobs is not None:
                rows_before_preemption += len(out.new_prompt_logprobs.ranks)
    assert 0 < rows_before_preemption < 19, "the scenario must preempt mid-prompt"
    # Every prompt position after the first is scored exactly once, in order.
    assert transcript.prompt_logprob_positions["scored"] == list(range(1, 20))
    assert len(transcript.tokens["scored"]) == 1


# --- stopping ---------------------------------------------------------------------------------


def run_one(core, prompt_len: int, script: list[int], max_model_len: int = 1024, **params):
    scheduler = core.make_scheduler(max_model_len=max_model_len)
    scheduler.add_request(core.make_request("r", prompt_len, **params))
    transcript = core.run_to_completion(
        scheduler, core.FakeRunner(next_token=scripted(prompt_len, script))
    )
    assert not scheduler.requests and scheduler.kv_cache_manager.usage == 0.0
    return transcript.tokens["r"], transcript.finish_reasons["r"], transcript.stop_reasons["r"]


def test_eos_stops_with_the_eos_token_included(core):
    tokens, reason, stop_reason = run_one(core, 5, [10, 11, core.EOS, 12], max_tokens=10)
    assert (tokens, reason, stop_reason) == ([10, 11, core.EOS], FinishReason.STOP, None)


def test_ignore_eos_runs_to_max_tokens(core):
    tokens, reason, _ = run_one(core, 5, [core.EOS, core.EOS], max_tokens=4, ignore_eos=True)
    assert (tokens, reason) == ([core.EOS, core.EOS, 102, 103], FinishReason.LENGTH)


def test_stop_token_ids_report_the_token(core):
    tokens, reason, stop_reason = run_one(
        core, 5, [10, 42, 11], max_tokens=10, stop_token_ids=[42, 43]
    )
    assert (tokens, reason, stop_reason) == ([10, 42], FinishReason.STOP, 42)


def test_min_tokens_suppresses_stop_tokens_and_eos(core):
    script = [core.EOS, 42, core.EOS]
    tokens, reason, _ = run_one(core, 5, script, max_tokens=10, min_tokens=2, stop_token_ids=[42])
    assert (tokens, reason) == (script, FinishReason.STOP)
    script = [42, core.EOS, 42]
    tokens, _, stop_reason = run_one(
        core, 5, script, max_tokens=10, min_tokens=2, stop_token_ids=[42]
    )
    assert (tokens, stop_reason) == (script, 42)


def test_max_tokens(core):
    tokens, reason, stop_reason = run_one(core, 5, [], max_tokens=3)
    assert (tokens, reason, stop_reason) == ([100, 101, 102], FinishReason.LENGTH, None)


def test_stop_token_wins_over_max_tokens_on_the_same_token(core):
    tokens, reason, _ = run_one(core, 5, [10, core.EOS], max_tokens=2)
    assert (tokens, reason) == ([10, core.EOS], FinishReason.STOP)


def test_max_model_len_caps_the_output(core):
    tokens, reason, _ = run_one(core, 5, [], max_model_len=8, max_tokens=100)
    assert (tokens, reason) == ([100, 101, 102], FinishReason.LENGTH)


def test_logprobs_are_passed_through(core):
    scheduler = core.make_scheduler()
    scheduler.add_request(core.make_request("r", 5, max_tokens=2, logprobs=1))
    transcript = core.run_to_completion(scheduler, core.FakeRunner())
    outputs = [out for _, step_out in transcript.steps for out in step_out.outputs]
    assert [out.new_logprobs.token_ids for out in outputs] == [
        [[t]] for t in transcript.tokens["r"]
    ]


# --- aborts -----------------------------------------------------------------------------------


def test_abort_running_and_waiting_requests(core):
    scheduler = core.make_scheduler(max_num_seqs=1)
    runner, transcript = core.FakeRunner(), core.Transcript()
    scheduler.add_request(core.make_request("running", 20, max_tokens=50))
    scheduler.add_request(core.make_request("waiting", 20, max_tokens=50))
    scheduler.add_request(core.make_request("other", 20, first_token=3000, max_tokens=50))
    core.step(scheduler, runner, transcript)
    assert scheduler.kv_cache_manager.num_free_blocks == 62

    scheduler.finish_requests(["running", "waiting", "unknown"], RequestStatus.FINISHED_ABORTED)
    assert scheduler.kv_cache_manager.num_free_blocks == 64
    assert set(scheduler.requests) == {"other"}
    assert [r.request_id for r in scheduler.waiting] == ["other"] and scheduler.running == []
    sched_output = core.step(scheduler, runner, transcript)
    assert sched_output.finished_req_ids == {"running"}
    assert scheduled(sched_output) == {"other": 20}
    assert scheduler.get_num_unfinished_requests() == 1

    scheduler.finish_requests("other", RequestStatus.FINISHED_STOPPED)
    assert not scheduler.has_unfinished_requests()
    assert scheduler.schedule().is_empty


def test_abort_between_schedule_and_output_drops_the_tokens(core):
    scheduler = core.make_scheduler()
    runner = core.FakeRunner()
    scheduler.add_request(core.make_request("r", 5))
    sched_output = scheduler.schedule()
    runner_output = runner.execute(sched_output)
    scheduler.finish_requests("r", RequestStatus.FINISHED_ABORTED)
    assert scheduler.update_from_output(sched_output, runner_output).outputs == []


def test_finish_requests_needs_a_finished_status(core):
    scheduler = core.make_scheduler()
    with pytest.raises(ValueError, match="finished_status"):
        scheduler.finish_requests("r", RequestStatus.RUNNING)


# --- structured outputs: a request waits for its grammar, and only it -----------------------


def test_a_request_compiling_its_grammar_is_passed_over_and_keeps_its_place(core):
    from concurrent.futures import Future

    scheduler = core.make_scheduler(max_num_batched_tokens=64)
    runner, transcript = core.FakeRunner(), core.Transcript()
    compiling: Future = Future()
    first = core.make_request("grammar", 8)
    first.grammar = compiling
    scheduler.add_request(first)
    scheduler.add_request(core.make_request("plain", 8))
    assert scheduler.pending_grammars() == [compiling]

    assert scheduled(core.step(scheduler, runner, transcript)) == {"plain": 8}
    assert [r.request_id for r in scheduler.waiting] == ["grammar"]
    assert first.status == RequestStatus.WAITING and first.num_computed_tokens == 0
    scheduler.add_request(core.make_request("later", 8))
    assert scheduled(core.step(scheduler, runner, transcript)) == {"plain": 1, "later": 8}
    assert [r.request_id for r in scheduler.waiting] == ["grammar"]

    compiling.set_result("compiled")
    assert scheduler.pending_grammars() == []
    step = core.step(scheduler, runner, transcript)
    assert scheduled(step) == {"plain": 1, "later": 1, "grammar": 8}
    assert [r.req_id for r in step.scheduled_new_reqs] == ["grammar"]
    assert not scheduler.waiting


def test_an_aborted_request_waiting_for_its_grammar_leaves(core):
    from concurrent.futures import Future

    scheduler = core.make_scheduler()
    request = core.make_request("grammar", 8)
    request.grammar = Future()
    scheduler.add_request(request)
    scheduler.finish_requests(["grammar"], RequestStatus.FINISHED_ABORTED)
    assert not scheduler.has_unfinished_requests() and scheduler.pending_grammars() == []
