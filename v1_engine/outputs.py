"""What users get back: RequestOutput with one CompletionOutput per sample (n), and logprobs.

Plain dataclasses on the front-end side of the process boundary; the engine core sends
`EngineCoreOutput` messages and the output processor turns them into these.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None
    """1 = the most likely token of the distribution."""
    decoded_token: str | None = None


SampleLogprobs = list[dict[int, Logprob]]
"""One dict per generated token: the sampled token and the top-N tokens, by token id."""
PromptLogprobs = list[dict[int, Logprob] | None]
"""One entry per prompt token; the first is None (nothing predicts it)."""


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: SampleLogprobs | None
    finish_reason: str | None = None
    """"stop", "length" or "abort"; None while the request runs."""
    stop_reason: int | str | None = None
    """The stop token id or stop string that ended the completion, if one did."""

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    """Wall-clock timestamps (time.time()) of a request's milestones; None until reached."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: PromptLogprobs | None
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    metrics: RequestMetrics | None = None
