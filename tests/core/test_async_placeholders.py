"""Async scheduling in the scheduler: placeholders let step N+1 be planned before step N's token
is known; a request that stops on step N's token has its surplus step-N+1 token dropped."""

from __future__ import annotations

from v1_engine.config import CacheConfig, SchedulerConfig
from v1_engine.core.request import Request
from v1_engine.core.sched_output import ModelRunnerOutput, SchedulerOutput
from v1_engine.core.scheduler import Scheduler
from v1_engine.protocol import FinishReason
from v1_engine.sampling_params import SamplingParams

EOS = 2


def _scheduler() -> Scheduler:
    return Scheduler(
        SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=8),
        CacheConfig(block_size=16),
        max_model_len=256,
        num_kv_blocks=16,
        async_scheduling=True,
    )


def _output(so: SchedulerOutput, tokens: dict[str, int]) -> ModelRunnerOutput:
    req_ids = list(so.num_scheduled_tokens)
    return ModelRunnerOutput(
        req_ids=req_ids, sampled_token_ids=[[tokens[r]] if r in tokens else [] for r in req_ids]
    )


def test_decode_is_scheduled_before_the_previous_token_is_known():
    scheduler = _scheduler()
    request = Request("a", list(range(3, 23)), SamplingParams(max_tokens=3), EOS)
    scheduler.add_request(request)

    first = scheduler.schedule()
    assert first.num_scheduled_tokens == {"a": 20}
    assert request.num_output_placeholders == 1
    second = scheduler.schedule()  # step 1 still in flight
    assert second.num_scheduled_tokens == {"a": 1}
    assert request.num_output_placeholders == 2

    out = scheduler.update_from_output(first, _output(first, {"a": 500}))
    assert out.outputs[0].new_token_ids == [500]
    assert request.num_output_placeholders == 1
    third = scheduler.schedule()
    assert third.num_scheduled_tokens == {"a": 1}

    scheduler.update_from_output(second, _output(second, {"a": 501}))
    # Output 2 known + 1 in flight reaches max_tokens=3: nothing more is scheduled.
    fourth = scheduler.schedule()
    assert fourth.is_empty
    out = scheduler.update_from_output(third, _output(third, {"a": 502}))
    assert out.outputs[0].finish_reason == FinishReason.LENGTH
    assert request.output_token_ids == [500, 501, 502]
    assert scheduler.kv_cache_manager.num_free_blocks == 16


def test_stop_drops_the_surplus_token_and_frees_blocks():
    scheduler = _scheduler()
    request = Request("a", list(range(3, 23)), SamplingParams(max_tokens=50), EOS)
    other = Request("b", list(range(30, 40)), SamplingParams(max_tokens=50), EOS)
    scheduler.add_request(request)
    scheduler.add_request(other)
    first = scheduler.schedule()
    second = scheduler.schedule()
    assert second.num_scheduled_tokens == {"a": 1, "b": 1}

    out = scheduler.update_from_output(first, _output(first, {"a": EOS, "b": 7}))
    finished = {o.request_id: o.finish_reason for o in out.outputs}
    assert finished == {"a": FinishReason.STOP, "b": None}
    third = scheduler.schedule()
    assert "a" in third.finished_req_ids
    assert third.num_scheduled_tokens == {"b": 1}

    out = scheduler.update_from_output(second, _output(second, {"a": 999, "b": 8}))
    assert [o.request_id for o in out.outputs] == ["b"]
    assert request.output_token_ids == [EOS]
    assert other.output_token_ids == [7, 8]
    scheduler.finish_requests("b", type(request.status).FINISHED_ABORTED)
    assert scheduler.kv_cache_manager.num_free_blocks == 16
