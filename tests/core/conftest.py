"""Helpers for scheduler tests: a fake model runner that keeps its own per-request state.

The fake runner follows the SchedulerOutput contract the way the real runner does (full data
for new requests, diffs for cached ones, state dropped on finished_req_ids) and asserts that the
diffs agree with its own bookkeeping, so every scheduler test also checks the contract.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from types import SimpleNamespace

import pytest

from v1_engine.config import CacheConfig, SchedulerConfig
from v1_engine.core.request import Request
from v1_engine.core.sched_output import ModelRunnerOutput, SchedulerOutput
from v1_engine.core.scheduler import Scheduler
from v1_engine.protocol import EngineCoreOutputs, FinishReason, LogprobsLists
from v1_engine.sampling_params import SamplingParams
from v1_engine.spec_decode.verify import accept_drafts

EOS = 2
"""EOS id of every test request."""

NextToken = Callable[[str, list[int]], int]
Drafter = Callable[[str, list[int]], list[int]]
"""Speculative decoding: the drafts proposed after a request's known tokens."""


def default_next_token(req_id: str, tokens: list[int]) -> int:
    """A deterministic token that depends on the request and its length, never EOS."""
    return 100 + (len(tokens) * 7 + sum(map(ord, req_id))) % 500


def make_scheduler(
    num_blocks: int = 64,
    block_size: int = 16,
    max_num_batched_tokens: int = 64,
    max_num_seqs: int = 16,
    max_model_len: int = 1024,
    enable_prefix_caching: bool = True,
    enable_chunked_prefill: bool = True,
    scheduling_policy: str = "fcfs",
) -> Scheduler:
    return Scheduler(
        SchedulerConfig(
            max_num_batched_tokens=max_num_batched_tokens,
            max_num_seqs=max_num_seqs,
            enable_chunked_prefill=enable_chunked_prefill,
            scheduling_policy=scheduling_policy,
        ),
        CacheConfig(block_size=block_size, enable_prefix_caching=enable_prefix_caching),
        max_model_len=max_model_len,
        num_kv_blocks=num_blocks,
    )


def make_request(
    req_id: str,
    prompt: list[int] | int,
    eos_token_id: int | None = EOS,
    first_token: int = 1000,
    **params: object,
) -> Request:
    """`prompt` is a token list, or a length: tokens first_token, first_token + 1, ...

    Prompts given as equal lengths share their tokens (and so their prefix-cache blocks)."""
    tokens = list(range(first_token, first_token + prompt)) if isinstance(prompt, int) else prompt
    params.setdefault("max_tokens", 4)
    return Request(req_id, tokens, SamplingParams(**params), eos_token_id=eos_token_id)


@dataclass
class _RunnerState:
    token_ids: list[int]
    block_ids: list[int]
    num_computed_tokens: int
    num_prompt_tokens: int
    sampling_params: SamplingParams


@dataclass
class FakeRunner:
    block_size: int = 16
    next_token: NextToken = default_next_token
    drafter: Drafter | None = None
    """With a drafter the runner verifies the scheduled drafts the way the real one does (the
    model being `next_token`) and proposes the next ones."""
    states: dict[str, _RunnerState] = field(default_factory=dict)

    def execute(self, output: SchedulerOutput) -> ModelRunnerOutput:
        for req_id in output.finished_req_ids:
            self.states.pop(req_id, None)
        for new in output.scheduled_new_reqs:
            assert new.req_id not in self.states, f"{new.req_id} sent as new twice"
            self.states[new.req_id] = _RunnerState(
                new.prompt_token_ids + new.output_token_ids,
                list(new.block_ids),
                new.num_computed_tokens,
                len(new.prompt_token_ids),
                new.sampling_params,
            )
        for cached in output.scheduled_cached_reqs:
            state = self.states[cached.req_id]
            assert state.num_computed_tokens == cached.num_computed_tokens
            state.block_ids.extend(cached.new_block_ids)
        assert output.total_num_scheduled_tokens == sum(output.num_scheduled_tokens.values())
        mro = ModelRunnerOutput(req_ids=[], sampled_token_ids=[])
        for req_id, num_tokens in output.num_scheduled_tokens.items():
            state = self.states[req_id]
            if state.sampling_params.prompt_logprobs is not None:
                rows = self._prompt_logprob_rows(state, num_tokens)
                if rows is not None:
                    mro.prompt_logprobs[req_id] = rows
            drafts = output.scheduled_spec_token_ids.get(req_id, [])
            sampled = self._compute(req_id, state, num_tokens, drafts)
            if sampled and state.sampling_params.logprobs is not None:
                n = len(sampled)
                mro.logprobs[req_id] = LogprobsLists([[t] for t in sampled], [[-0.25]] * n, [1] * n)
            if sampled and self.drafter is not None:
                mro.spec_token_ids[req_id] = self.drafter(req_id, list(state.token_ids))
            mro.req_ids.append(req_id)
            mro.sampled_token_ids.append(sampled)
        return mro

    @staticmethod
    def _prompt_logprob_rows(state: _RunnerState, num_tokens: int) -> LogprobsLists | None:
        """Row k scores prompt token start + 1 + k; `ranks` carries that position for tests."""
        start = state.num_computed_tokens
        end = min(start + num_tokens, state.num_prompt_tokens - 1)
        positions = list(range(start + 1, end + 1))
        if not positions:
            return None
        return LogprobsLists(
            [[state.token_ids[p]] for p in positions], [[-1.0] for _ in positions], positions
        )

    def _compute(
        self, req_id: str, state: _RunnerState, num_tokens: int, drafts: list[int]
    ) -> list[int]:
        assert num_tokens > 0
        assert not drafts or self.drafter is not None, "drafts scheduled without a drafter"
        state.num_computed_tokens += num_tokens
        known = len(state.token_ids)
        assert state.num_computed_tokens <= known + len(drafts), "computed an unknown token"
        assert not drafts or state.num_computed_tokens == known + len(drafts), "drafts mid-prefill"
        assert len(state.block_ids) * self.block_size >= state.num_computed_tokens, "no slot"
        if state.num_computed_tokens < known:
            return []  # A prefill chunk short of the end: nothing to sample.
        sampled = [
            self.next_token(req_id, state.token_ids + drafts[:i]) for i in range(len(drafts) + 1)
        ]
        kept = accept_drafts(sampled, drafts)
        state.num_computed_tokens -= len(drafts) + 1 - len(kept)
        state.token_ids.extend(kept)
        return kept


@dataclass
class Transcript:
    """What the client saw: tokens and finish reason per request, and every step's outputs."""

    tokens: dict[str, list[int]] = field(default_factory=dict)
    finish_reasons: dict[str, FinishReason] = field(default_factory=dict)
    stop_reasons: dict[str, int | str | None] = field(default_factory=dict)
    prompt_logprob_positions: dict[str, list[int]] = field(default_factory=dict)
    """Prompt positions scored, in the order returned (the fake runner puts them in `ranks`)."""
    steps: list[tuple[SchedulerOutput, EngineCoreOutputs]] = field(default_factory=list)

    def record(self, sched_output: SchedulerOutput, outputs: EngineCoreOutputs) -> None:
        self.steps.append((sched_output, outputs))
        for out in outputs.outputs:
            assert out.request_id not in self.finish_reasons, "output after finish"
            self.tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
            if out.new_prompt_logprobs is not None:
                positions = self.prompt_logprob_positions.setdefault(out.request_id, [])
                positions.extend(out.new_prompt_logprobs.ranks)
            if out.finished:
                self.finish_reasons[out.request_id] = out.finish_reason
                self.stop_reasons[out.request_id] = out.stop_reason


def step(scheduler: Scheduler, runner: FakeRunner, transcript: Transcript) -> SchedulerOutput:
    sched_output = scheduler.schedule()
    outputs = scheduler.update_from_output(sched_output, runner.execute(sched_output))
    transcript.record(sched_output, outputs)
    return sched_output


def run_to_completion(
    scheduler: Scheduler, runner: FakeRunner, max_steps: int = 1000
) -> Transcript:
    transcript = Transcript()
    for _ in range(max_steps):
        if not scheduler.has_unfinished_requests():
            return transcript
        step(scheduler, runner, transcript)
    raise AssertionError(f"requests still unfinished after {max_steps} steps")


@pytest.fixture(scope="session")
def core() -> SimpleNamespace:
    """The helpers above, as a fixture so tests need no import path tricks."""
    return SimpleNamespace(
        EOS=EOS,
        make_scheduler=make_scheduler,
        make_request=make_request,
        FakeRunner=FakeRunner,
        Transcript=Transcript,
        step=step,
        run_to_completion=run_to_completion,
    )
