"""Scheduler: decides which requests compute how many tokens each step.

One rule, no phases: every request is granted up to `num_tokens - num_computed_tokens` tokens
within the step's token budget, `max_num_seqs` and the free KV blocks. Running requests go
first, in order; then waiting requests, first come first served. A running request that cannot
get blocks preempts the last running request (recompute: its KV is dropped, it waits again at
the front of the queue). With the "priority" policy both queues are kept in (priority, arrival)
order instead, so the most urgent requests are admitted first and the least urgent running one
is preempted first.

`num_computed_tokens` advances in `schedule()`, when tokens are granted, not when the step's
output arrives: the next step can then be scheduled before this one finishes.

Async scheduling: with `async_scheduling`, a request granted the tokens that make it sample
counts one placeholder output token at once, so step N+1 can schedule its decode before step N's
token is known (the runner feeds it on the device). The token replaces the placeholder in
`update_from_output`; a request that stops there has its in-flight surplus token dropped.

Speculative decoding: a decoding request with drafts (`Request.spec_token_ids`, proposed by the
runner with the previous step's output) is granted its last token plus the drafts that fit the
budget, max_tokens and max_model_len. When the step's output arrives, the rejected drafts leave
`num_computed_tokens` again: their K/V slots are simply written over later.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterable
from concurrent.futures import Future
from dataclasses import dataclass, field

from v1_engine.config import CacheConfig, SchedulerConfig
from v1_engine.core.kv_cache_manager import KVCacheManager
from v1_engine.core.kv_cache_utils import KVCacheBlock
from v1_engine.core.output_rules import check_stop, take_new_prompt_logprobs
from v1_engine.core.request import Request, RequestStatus
from v1_engine.core.sched_output import (
    CachedRequestData,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
)
from v1_engine.protocol import EngineCoreOutput, EngineCoreOutputs, SchedulerStats


class Scheduler:
    def __init__(
        self,
        scheduler_config: SchedulerConfig,
        cache_config: CacheConfig,
        max_model_len: int,
        num_kv_blocks: int,
        async_scheduling: bool = False,
    ) -> None:
        assert scheduler_config.max_num_batched_tokens is not None, "resolve the config first"
        assert scheduler_config.max_num_seqs is not None, "resolve the config first"
        self.max_num_batched_tokens = scheduler_config.max_num_batched_tokens
        self.max_num_seqs = scheduler_config.max_num_seqs
        self.enable_chunked_prefill = scheduler_config.enable_chunked_prefill
        self.max_model_len = max_model_len
        self.async_scheduling = async_scheduling
        self.by_priority = scheduler_config.scheduling_policy == "priority"
        self.kv_cache_manager = KVCacheManager(
            num_blocks=num_kv_blocks,
            block_size=cache_config.block_size,
            enable_caching=cache_config.enable_prefix_caching,
        )
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.finished_req_ids: set[str] = set()
        """Requests the runner holds state for that ended since the last schedule()."""
        self._num_preempted_since_stats = 0
        self._spec_stats = [0, 0, 0]
        """Since the last stats: verify steps with drafts, draft tokens, accepted tokens."""

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request_id {request.request_id!r} is already in the scheduler")
        if request.num_prompt_tokens == 0:
            raise ValueError("prompt_token_ids must contain at least one token")
        if request.num_prompt_tokens > self.max_model_len:
            raise ValueError(
                f"prompt length must be <= max_model_len ({self.max_model_len}), "
                f"got {request.num_prompt_tokens}"
            )
        self.requests[request.request_id] = request
        if self.by_priority:
            _insert_in_order(self.waiting, request)
        else:
            self.waiting.append(request)

    def schedule(self) -> SchedulerOutput:
        """Grant tokens for one step; requests preempted here are in its finished_req_ids."""
        plan = _StepPlan(budget=self.max_num_batched_tokens)
        self._schedule_running(plan)
        # A step that had to preempt is short of blocks: admitting more requests would thrash.
        if plan.num_preempted == 0:
            self._schedule_waiting(plan)

        for req_id, num_tokens in plan.num_scheduled_tokens.items():
            request = self.requests[req_id]
            request.num_computed_tokens += num_tokens
            if self.async_scheduling and request.num_computed_tokens >= (
                request.num_tokens + request.num_output_placeholders
            ):
                request.num_output_placeholders += 1  # this step samples its next token
        output = SchedulerOutput(
            scheduled_new_reqs=plan.new_reqs,
            scheduled_cached_reqs=plan.cached_reqs,
            num_scheduled_tokens=plan.num_scheduled_tokens,
            total_num_scheduled_tokens=self.max_num_batched_tokens - plan.budget,
            finished_req_ids=self.finished_req_ids,
            scheduled_spec_token_ids=plan.spec_token_ids,
        )
        self.finished_req_ids = set()
        return output

    def update_from_output(
        self, scheduler_output: SchedulerOutput, model_runner_output: ModelRunnerOutput
    ) -> EngineCoreOutputs:
        """Append the sampled tokens, apply the stop rules and free finished requests."""
        mro = model_runner_output
        outputs: list[EngineCoreOutput] = []
        for req_id, sampled in zip(mro.req_ids, mro.sampled_token_ids, strict=True):
            request = self.requests.get(req_id)
            if request is None or request.is_finished:
                continue  # Aborted after the step was scheduled.
            if sampled:
                request.num_output_placeholders = max(0, request.num_output_placeholders - 1)
            num_scheduled = scheduler_output.num_scheduled_tokens.get(req_id, 0)
            chunk_start = request.num_computed_tokens - num_scheduled  # schedule() advanced it
            drafts = scheduler_output.scheduled_spec_token_ids.get(req_id)
            if drafts:
                self._settle_drafts(request, len(drafts), len(sampled))
            new_token_ids = self._append_new_tokens(request, sampled)
            if not request.is_finished:
                request.spec_token_ids = mro.spec_token_ids.get(req_id, [])
            prompt_logprobs = take_new_prompt_logprobs(
                request, mro.prompt_logprobs.get(req_id), chunk_start
            )
            if new_token_ids or prompt_logprobs is not None:
                outputs.append(
                    EngineCoreOutput(
                        request_id=req_id,
                        new_token_ids=new_token_ids,
                        new_logprobs=mro.logprobs.get(req_id) if new_token_ids else None,
                        new_prompt_logprobs=prompt_logprobs,
                        finish_reason=request.get_finished_reason(),
                        stop_reason=request.stop_reason,
                        num_cached_tokens=max(request.num_cached_tokens, 0),
                        first_scheduled_time=request.unsent_scheduled_time,
                    )
                )
                request.unsent_scheduled_time = None
        self._remove_finished_running()
        self._remove_finished_waiting()
        return EngineCoreOutputs(
            outputs=outputs, scheduler_stats=self.make_stats(), timestamp=time.monotonic()
        )

    def finish_requests(
        self, request_ids: str | Iterable[str], finished_status: RequestStatus
    ) -> None:
        """End waiting or running requests from outside (client abort, front-end stop string).

        Unknown or already finished ids are ignored: the request may have ended on its own.
        """
        if not RequestStatus.is_finished(finished_status):
            allowed = [s.name for s in RequestStatus if RequestStatus.is_finished(s)]
            raise ValueError(f"finished_status must be one of {allowed}, got {finished_status!r}")
        if isinstance(request_ids, str):
            request_ids = (request_ids,)
        for req_id in request_ids:
            request = self.requests.get(req_id)
            if request is None:
                continue
            if request.status == RequestStatus.RUNNING:
                self.running.remove(request)
                self.finished_req_ids.add(req_id)
            else:
                self.waiting.remove(request)
            request.status = finished_status
            self._free_request(request)

    def pending_grammars(self) -> list[Future]:
        """Compiles that hold waiting requests back (structured outputs)."""
        return [r.grammar for r in self.waiting if r.grammar_pending]  # type: ignore[misc]

    def has_unfinished_requests(self) -> bool:
        return self.get_num_unfinished_requests() > 0

    def get_num_unfinished_requests(self) -> int:
        return len(self.waiting) + len(self.running)

    def reset_prefix_cache(self) -> bool:
        return self.kv_cache_manager.reset_prefix_cache()

    def make_stats(self) -> SchedulerStats:
        """Current occupancy, plus prefix-cache and preemption counts since the last call."""
        prefix_stats = self.kv_cache_manager.make_prefix_cache_stats()
        stats = SchedulerStats(
            num_running_reqs=len(self.running),
            num_waiting_reqs=len(self.waiting),
            kv_cache_usage=self.kv_cache_manager.usage,
            prefix_cache_queries=prefix_stats.queries,
            prefix_cache_hits=prefix_stats.hits,
            num_preempted_reqs=self._num_preempted_since_stats,
            spec_num_drafts=self._spec_stats[0],
            spec_num_draft_tokens=self._spec_stats[1],
            spec_num_accepted_tokens=self._spec_stats[2],
        )
        self._num_preempted_since_stats = 0
        self._spec_stats = [0, 0, 0]
        return stats

    def _schedule_running(self, plan: _StepPlan) -> None:
        index = 0
        while index < len(self.running) and plan.budget > 0:
            request = self.running[index]
            num_new_tokens = min(
                self._num_remaining_tokens(request, request.num_computed_tokens), plan.budget
            )
            drafts = self._drafts_that_fit(request, num_new_tokens, plan.budget)
            num_new_tokens += len(drafts)
            if num_new_tokens > 0:
                new_blocks = self._allocate_or_preempt(request, num_new_tokens, plan)
                if new_blocks is None:
                    return  # It preempted itself, being the last running request.
                plan.cached_reqs.append(
                    CachedRequestData(
                        req_id=request.request_id,
                        new_block_ids=[block.block_id for block in new_blocks],
                        num_computed_tokens=request.num_computed_tokens,
                    )
                )
                plan.grant(request, num_new_tokens)
                if drafts:
                    plan.spec_token_ids[request.request_id] = drafts
                request.spec_token_ids = []
            index += 1

    def _drafts_that_fit(self, request: Request, num_new_tokens: int, budget: int) -> list[int]:
        """The request's drafts to verify this step: only after its one last known token (a
        decode), and no more than the budget, max_tokens and max_model_len leave room for (all
        drafts accepted, the step yields drafts + 1 tokens)."""
        drafts = request.spec_token_ids
        if not drafts or num_new_tokens != 1:
            return []
        room = min(budget - 1, self.max_model_len - request.num_tokens - 1)
        max_tokens = request.sampling_params.max_tokens
        if max_tokens is not None:
            room = min(room, max_tokens - request.num_output_tokens - 1)
        return drafts[: max(room, 0)]

    def _settle_drafts(self, request: Request, num_drafts: int, num_sampled: int) -> None:
        """A verify step's outcome: `num_sampled - 1` drafts were accepted (the last sampled
        token is the one after them); the rejected ones' K/V no longer counts as computed."""
        assert 1 <= num_sampled <= num_drafts + 1, (request.request_id, num_drafts, num_sampled)
        request.num_computed_tokens -= num_drafts + 1 - num_sampled
        self._spec_stats[0] += 1
        self._spec_stats[1] += num_drafts
        self._spec_stats[2] += num_sampled - 1

    def _allocate_or_preempt(
        self, request: Request, num_new_tokens: int, plan: _StepPlan
    ) -> list[KVCacheBlock] | None:
        """Blocks for the request, preempting from the end of `running` until they fit.

        The requests after `request` in `running` have not been scheduled this step, so the
        victims are never requests this step already granted tokens to.
        """
        while True:
            new_blocks = self.kv_cache_manager.allocate_slots(request, num_new_tokens)
            if new_blocks is not None:
                return new_blocks
            victim = self.running.pop()
            self._preempt(victim)
            plan.num_preempted += 1
            if victim is request:
                return None

    def _preempt(self, request: Request) -> None:
        """Recompute-style preemption: drop the KV, keep the tokens, wait at the front."""
        self.kv_cache_manager.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_output_placeholders = 0
        request.spec_token_ids = []
        if self.by_priority:
            _insert_in_order(self.waiting, request)
        else:
            self.waiting.appendleft(request)
        self.finished_req_ids.add(request.request_id)
        self._num_preempted_since_stats += 1

    def _schedule_waiting(self, plan: _StepPlan) -> None:
        """Admit waiting requests in order; stop at the first one that does not fit (FCFS).
        A request whose grammar is still compiling is passed over, keeping its place."""
        passed_over: list[Request] = []
        try:
            self._admit_waiting(plan, passed_over)
        finally:
            self.waiting.extendleft(reversed(passed_over))

    def _admit_waiting(self, plan: _StepPlan, passed_over: list[Request]) -> None:
        kv = self.kv_cache_manager
        while self.waiting and plan.budget > 0 and len(self.running) < self.max_num_seqs:
            request = self.waiting[0]
            if request.grammar_pending:
                passed_over.append(self.waiting.popleft())
                continue
            hit_blocks, num_hit_tokens = kv.get_computed_blocks(request)
            num_new_tokens = self._num_remaining_tokens(request, num_hit_tokens)
            if num_new_tokens > plan.budget:
                if not self.enable_chunked_prefill:
                    return
                num_new_tokens = plan.budget
            if kv.allocate_slots(request, num_new_tokens, hit_blocks, num_hit_tokens) is None:
                return
            self.waiting.popleft()
            if self.by_priority:
                _insert_in_order(self.running, request)
            else:
                self.running.append(request)
            request.status = RequestStatus.RUNNING
            request.num_computed_tokens = num_hit_tokens
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = num_hit_tokens
                request.unsent_scheduled_time = time.time()
            plan.new_reqs.append(
                NewRequestData(
                    req_id=request.request_id,
                    prompt_token_ids=request.prompt_token_ids,
                    output_token_ids=list(request.output_token_ids),
                    sampling_params=request.sampling_params,
                    block_ids=kv.get_block_ids(request.request_id),
                    num_computed_tokens=num_hit_tokens,
                    eos_token_id=request.eos_token_id,
                )
            )
            plan.grant(request, num_new_tokens)

    def _num_remaining_tokens(self, request: Request, num_computed_tokens: int) -> int:
        """Tokens (known or placeholder) not yet computed, never past max_model_len.

        A request whose placeholders already reach max_tokens is certain to stop when they
        resolve: it gets nothing more.
        """
        placeholders = request.num_output_placeholders
        if placeholders:
            max_tokens = request.sampling_params.max_tokens
            if max_tokens is not None and request.num_output_tokens + placeholders >= max_tokens:
                return 0
        num_tokens = min(request.num_tokens + placeholders, self.max_model_len)
        return num_tokens - num_computed_tokens

    def _append_new_tokens(self, request: Request, sampled: list[int]) -> list[int]:
        """Append sampled tokens up to (and including) the first one that stops the request."""
        appended = []
        for token_id in sampled:
            request.append_output_token_ids(token_id)
            appended.append(token_id)
            if check_stop(request, self.max_model_len):
                break
        return appended

    def _remove_finished_running(self) -> None:
        finished = [request for request in self.running if request.is_finished]
        if not finished:
            return
        self.running = [request for request in self.running if not request.is_finished]
        for request in finished:
            self.finished_req_ids.add(request.request_id)
            self._free_request(request)

    def _remove_finished_waiting(self) -> None:
        """A request preempted while its step was in flight can stop on that step's token."""
        if not self.async_scheduling:
            return
        finished = [request for request in self.waiting if request.is_finished]
        for request in finished:
            self.waiting.remove(request)
            self._free_request(request)

    def _free_request(self, request: Request) -> None:
        self.kv_cache_manager.free(request)
        del self.requests[request.request_id]


def _insert_in_order(queue: deque[Request] | list[Request], request: Request) -> None:
    """Insert `request` after every request of the same or a more urgent (priority, arrival)."""
    key = (request.priority, request.arrival_time)
    index = len(queue)
    while index > 0 and (queue[index - 1].priority, queue[index - 1].arrival_time) > key:
        index -= 1
    queue.insert(index, request)


@dataclass
class _StepPlan:
    """What one schedule() call has granted so far."""

    budget: int
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    new_reqs: list[NewRequestData] = field(default_factory=list)
    cached_reqs: list[CachedRequestData] = field(default_factory=list)
    num_preempted: int = 0
    spec_token_ids: dict[str, list[int]] = field(default_factory=dict)

    def grant(self, request: Request, num_tokens: int) -> None:
        self.num_scheduled_tokens[request.request_id] = num_tokens
        self.budget -= num_tokens
