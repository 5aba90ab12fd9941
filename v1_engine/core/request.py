"""Request: the scheduler's per-request state. It only holds data; policy lives in Scheduler."""

from __future__ import annotations

import enum
from concurrent.futures import Future

from v1_engine.protocol import EngineCoreRequest, FinishReason
from v1_engine.sampling_params import SamplingParams


class RequestStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    # Everything from here on is a finished state (see `is_finished`).
    FINISHED_STOPPED = 3
    FINISHED_LENGTH_CAPPED = 4
    FINISHED_ABORTED = 5

    @staticmethod
    def is_finished(status: RequestStatus) -> bool:
        return status >= RequestStatus.FINISHED_STOPPED


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: FinishReason.STOP,
    RequestStatus.FINISHED_LENGTH_CAPPED: FinishReason.LENGTH,
    RequestStatus.FINISHED_ABORTED: FinishReason.ABORT,
}


class Request:
    """One generation request as the engine core tracks it.

    The one scheduling rule reads two counters: `num_tokens` (prompt + known outputs) and
    `num_computed_tokens` (tokens whose KV is in the cache). Every step grants the difference.
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        eos_token_id: int | None = None,
        arrival_time: float = 0.0,
        priority: int = 0,
    ) -> None:
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.eos_token_id = eos_token_id
        self.arrival_time = arrival_time
        self.priority = priority
        """Lower runs sooner under the priority policy (ties by arrival)."""

        self.status = RequestStatus.WAITING
        self.stop_reason: int | str | None = None
        self.output_token_ids: list[int] = []
        self._all_token_ids: list[int] = list(prompt_token_ids)
        self.num_computed_tokens = 0
        self.num_cached_tokens = -1
        """Prefix-cache hits (tokens) at the first schedule; -1 until then."""
        self.block_hashes: list[int] = []
        """Chained hashes of the request's full blocks, extended as blocks fill up."""
        self.unsent_scheduled_time: float | None = None
        """When the request was first scheduled, until an output has carried it out."""
        self.num_output_placeholders = 0
        """Async scheduling: tokens sampled by a step still in flight, counted before known."""
        self.num_prompt_logprob_rows = 0
        """Prompt-logprob rows already returned, so a recompute after preemption sends none twice."""
        self.spec_token_ids: list[int] = []
        """Speculative decoding: drafts proposed for the request's next step."""
        self.grammar: Future | None = None
        """Structured outputs: the compile of the request's grammar, started on arrival; the
        scheduler admits the request once it is done (the runner never waits on a compile)."""

    @property
    def grammar_pending(self) -> bool:
        return self.grammar is not None and not self.grammar.done()

    @classmethod
    def from_engine_core_request(cls, request: EngineCoreRequest) -> Request:
        return cls(
            request_id=request.request_id,
            prompt_token_ids=request.prompt_token_ids,
            sampling_params=request.sampling_params,
            eos_token_id=request.eos_token_id,
            arrival_time=request.arrival_time,
            priority=request.priority,
        )

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        """Known tokens: prompt plus generated outputs."""
        return len(self._all_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        """Prompt followed by outputs. Read-only view: grow it through `append_output_token_ids`."""
        return self._all_token_ids

    @property
    def is_finished(self) -> bool:
        return RequestStatus.is_finished(self.status)

    def append_output_token_ids(self, token_ids: int | list[int]) -> None:
        if isinstance(token_ids, int):
            token_ids = [token_ids]
        self.output_token_ids.extend(token_ids)
        self._all_token_ids.extend(token_ids)

    def get_finished_reason(self) -> FinishReason | None:
        return _FINISH_REASONS.get(self.status)

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, status={self.status.name}, "
            f"num_tokens={self.num_tokens}, num_computed_tokens={self.num_computed_tokens})"
        )
