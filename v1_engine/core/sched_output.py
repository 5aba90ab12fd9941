"""The only contract between the scheduler and the model runner, in both directions.

New requests carry their full data once; running requests travel as diffs. The runner keeps its
own persistent per-request state (tokens, block table, sampling state) and never sees a Request.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from v1_engine.protocol import LogprobsLists
from v1_engine.sampling_params import SamplingParams


@dataclass
class NewRequestData:
    """A request the runner has not seen (or has forgotten, after a preemption)."""

    req_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    """Tokens generated before a preemption; empty for a fresh request."""
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int
    """Tokens whose KV is already in the cache (prefix-cache hits); the step computes from here."""
    eos_token_id: int | None = None
    """Suppressed by the sampler until min_tokens are generated (unless ignore_eos)."""


@dataclass
class CachedRequestData:
    """A request the runner already holds: only what changed since the last step."""

    req_id: str
    new_block_ids: list[int]
    """Blocks appended to the request's block table this step."""
    num_computed_tokens: int
    """Tokens with KV in the cache before this step (the runner checks it against its own count)."""


@dataclass
class SchedulerOutput:
    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: list[CachedRequestData]
    num_scheduled_tokens: dict[str, int]
    """Tokens each scheduled request computes this step."""
    total_num_scheduled_tokens: int
    finished_req_ids: set[str] = field(default_factory=set)
    """Requests finished, aborted or preempted since the last step: the runner drops their state."""
    scheduled_spec_token_ids: dict[str, list[int]] = field(default_factory=dict)
    """Speculative decoding: the draft tokens each request verifies this step, after its last
    known token (counted in its num_scheduled_tokens)."""

    @property
    def is_empty(self) -> bool:
        return self.total_num_scheduled_tokens == 0


@dataclass
class ModelRunnerOutput:
    req_ids: list[str]
    """The requests of the step, in the order of the rows below."""
    sampled_token_ids: list[list[int]]
    """Tokens sampled for each request: empty for a prefill chunk that does not reach the end of
    the known tokens (its sample would be meaningless), one token otherwise, or with drafts the
    accepted ones and the token after them (1 to drafts + 1)."""
    logprobs: dict[str, LogprobsLists] = field(default_factory=dict)
    """Log-probabilities of the sampled tokens (one row each), for each request that asked for
    them and sampled this step."""
    prompt_logprobs: dict[str, LogprobsLists] = field(default_factory=dict)
    """Prompt log-probabilities computed this step, per request (one row per prompt position
    scored, for the positions covered by this step's chunk)."""
    spec_token_ids: dict[str, list[int]] = field(default_factory=dict)
    """Speculative decoding: drafts proposed for each request's next step."""
