"""OutputProcessor: EngineCoreOutputs → RequestOutputs, in the front-end process.

Incremental detokenization, stop strings (which finish a request here and abort it in the core),
logprob decoding, n > 1 fan-in and per-request timing all live here, off the core's hot loop.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

from v1_engine.engine.detokenizer import IncrementalDetokenizer
from v1_engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from v1_engine.protocol import EngineCoreOutput, EngineCoreOutputs, EngineCoreRequest, FinishReason
from v1_engine.sample.logprobs import decode_logprobs


class OutputKind(enum.Enum):
    DELTA = "delta"
    """Each RequestOutput carries only what is new since the last one (streaming)."""
    FINAL_ONLY = "final_only"
    """One RequestOutput per request, when it finishes, with everything (offline)."""


@dataclass
class ParentRequest:
    """Fans n completions of one prompt back in; children are `{request_id}_{index}`."""

    request_id: str
    n: int
    completions: dict[int, CompletionOutput] = field(default_factory=dict)
    num_finished: int = 0

    @property
    def finished(self) -> bool:
        return self.num_finished == self.n


@dataclass
class RequestState:
    request_id: str
    index: int
    parent: ParentRequest | None
    prompt: str | None
    prompt_token_ids: list[int]
    detokenizer: IncrementalDetokenizer
    output_kind: OutputKind
    want_logprobs: bool
    want_prompt_logprobs: bool
    metrics: RequestMetrics
    token_ids: list[int] = field(default_factory=list)
    num_sent_tokens: int = 0
    logprobs: list = field(default_factory=list)
    num_sent_logprobs: int = 0
    cumulative_logprob: float = 0.0
    prompt_logprobs: list = field(default_factory=list)
    queue: Any = None
    """Where AsyncEngine delivers this request's outputs (an asyncio queue), or None."""


@dataclass
class ProcessedOutputs:
    request_outputs: list[RequestOutput]
    reqs_to_abort: list[str]
    """Requests finished by a stop string here, which the core must stop computing."""


class OutputProcessor:
    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.states: dict[str, RequestState] = {}

    def has_unfinished_requests(self) -> bool:
        return bool(self.states)

    def add_request(
        self,
        request: EngineCoreRequest,
        prompt: str | None,
        output_kind: OutputKind,
        parent: ParentRequest | None = None,
        index: int = 0,
        queue: Any = None,
    ) -> None:
        if request.request_id in self.states:
            raise ValueError(f"request_id {request.request_id!r} is already in use")
        params = request.sampling_params
        self.states[request.request_id] = RequestState(
            request_id=request.request_id,
            index=index,
            parent=parent,
            prompt=prompt,
            prompt_token_ids=request.prompt_token_ids,
            detokenizer=IncrementalDetokenizer(self.tokenizer, request.prompt_token_ids, params),
            output_kind=output_kind,
            want_logprobs=params.logprobs is not None,
            want_prompt_logprobs=params.prompt_logprobs is not None,
            metrics=RequestMetrics(arrival_time=request.arrival_time),
            queue=queue,
        )

    def abort_requests(self, request_ids: list[str]) -> list[str]:
        """Forget the requests; returns those that were still known."""
        return [r for r in request_ids if self.states.pop(r, None) is not None]

    def process_outputs(self, outputs: EngineCoreOutputs) -> ProcessedOutputs:
        request_outputs: list[RequestOutput] = []
        reqs_to_abort: list[str] = []
        now = time.time()
        for out in outputs.outputs:
            state = self.states.get(out.request_id)
            if state is None:
                continue  # aborted while the core was still producing
            finish_reason, stop_reason = self._update(state, out, now)
            if finish_reason is not None and out.finish_reason is None:
                reqs_to_abort.append(out.request_id)
            if finish_reason is not None:
                del self.states[out.request_id]
                state.metrics.finished_time = now
            request_output = self._make_output(state, out, finish_reason, stop_reason)
            if request_output is not None:
                if state.queue is not None:
                    state.queue.put_nowait(request_output)
                request_outputs.append(request_output)
        return ProcessedOutputs(request_outputs, reqs_to_abort)

    def _update(
        self, state: RequestState, out: EngineCoreOutput, now: float
    ) -> tuple[str | None, int | str | None]:
        if out.first_scheduled_time is not None:
            state.metrics.first_scheduled_time = out.first_scheduled_time
        if state.metrics.first_token_time is None and out.new_token_ids:
            state.metrics.first_token_time = now
        state.token_ids.extend(out.new_token_ids)
        if out.new_prompt_logprobs is not None:
            decoded = decode_logprobs(out.new_prompt_logprobs, self.tokenizer)
            if not state.prompt_logprobs:
                state.prompt_logprobs.append(None)
            state.prompt_logprobs.extend(decoded)
        if out.new_logprobs is not None:
            decoded = decode_logprobs(out.new_logprobs, self.tokenizer)
            for row, token_id in zip(decoded, out.new_token_ids):
                state.cumulative_logprob += row[token_id].logprob
            state.logprobs.extend(decoded)
        stop_terminated = out.finish_reason == FinishReason.STOP
        stop_str = state.detokenizer.update(out.new_token_ids, stop_terminated)
        if stop_str is not None:
            return str(FinishReason.STOP), stop_str
        if out.finish_reason is not None:
            return str(out.finish_reason), out.stop_reason
        return None, None

    def _make_output(
        self,
        state: RequestState,
        out: EngineCoreOutput,
        finish_reason: str | None,
        stop_reason: int | str | None,
    ) -> RequestOutput | None:
        finished = finish_reason is not None
        delta = state.output_kind == OutputKind.DELTA
        if not delta and not finished:
            return None
        text = state.detokenizer.get_next_output_text(finished, delta)
        start_tok = state.num_sent_tokens if delta else 0
        start_lp = state.num_sent_logprobs if delta else 0
        state.num_sent_tokens = len(state.token_ids)
        state.num_sent_logprobs = len(state.logprobs)
        completion = CompletionOutput(
            index=state.index,
            text=text,
            token_ids=state.token_ids[start_tok:],
            cumulative_logprob=state.cumulative_logprob if state.want_logprobs else None,
            logprobs=state.logprobs[start_lp:] if state.want_logprobs else None,
            finish_reason=finish_reason,
            stop_reason=stop_reason,
        )
        parent = state.parent
        if parent is not None:
            parent.num_finished += finished
            if not delta:
                parent.completions[state.index] = completion
                if not parent.finished:
                    return None
                completions = [parent.completions[i] for i in sorted(parent.completions)]
            else:
                completions = [completion]
            request_id, finished = parent.request_id, parent.finished
        else:
            completions, request_id = [completion], state.request_id
        send_prompt_logprobs = state.want_prompt_logprobs and (finished or delta)
        return RequestOutput(
            request_id=request_id,
            prompt=state.prompt,
            prompt_token_ids=state.prompt_token_ids,
            prompt_logprobs=list(state.prompt_logprobs) if send_prompt_logprobs else None,
            outputs=completions,
            finished=finished,
            num_cached_tokens=out.num_cached_tokens,
            metrics=state.metrics,
        )
