"""Every message that crosses the front-end / engine-core boundary, as typed msgspec Structs.

Nothing else travels between the processes, and nothing is ever pickled. The in-process core
uses exactly the same types, so the process boundary can move without touching the engine.
"""

from __future__ import annotations

import enum

import msgspec

from v1_engine.sampling_params import SamplingParams


class FinishReason(enum.IntEnum):
    STOP = 0
    LENGTH = 1
    ABORT = 2

    def __str__(self) -> str:
        return self.name.lower()


class EngineCoreRequest(msgspec.Struct, omit_defaults=True, kw_only=True):
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_id: int | None = None
    arrival_time: float = 0.0
    priority: int = 0
    """With the priority scheduling policy: lower runs sooner (ties by arrival)."""


class LogprobsLists(msgspec.Struct, array_like=True):
    """Log-probabilities of a run of positions.

    Row i describes position i: `token_ids[i][0]` is the sampled (or prompt) token and
    `token_ids[i][1:]` are the top-N tokens; `logprobs[i]` aligns with `token_ids[i]`;
    `ranks[i]` is the rank of `token_ids[i][0]` in the full distribution (1 = most likely).
    """

    token_ids: list[list[int]]
    logprobs: list[list[float]]
    ranks: list[int]


class EngineCoreOutput(msgspec.Struct, omit_defaults=True, kw_only=True):
    request_id: str
    new_token_ids: list[int]
    new_logprobs: LogprobsLists | None = None
    new_prompt_logprobs: LogprobsLists | None = None
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    """The stop token id (or stop string, set by the front-end) that ended the request."""
    num_cached_tokens: int = 0
    """Prompt tokens served from the prefix cache when the request was first scheduled."""
    first_scheduled_time: float | None = None
    """Wall time (time.time()) the request was first scheduled; sent with its first output."""

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class SchedulerStats(msgspec.Struct, omit_defaults=True, kw_only=True):
    num_running_reqs: int = 0
    num_waiting_reqs: int = 0
    kv_cache_usage: float = 0.0
    prefix_cache_queries: int = 0
    """Prompt tokens looked up in the prefix cache since the last stats message."""
    prefix_cache_hits: int = 0
    num_preempted_reqs: int = 0
    spec_num_drafts: int = 0
    """Speculative decoding, since the last stats message: requests' verify steps with drafts,"""
    spec_num_draft_tokens: int = 0
    """the draft tokens they verified,"""
    spec_num_accepted_tokens: int = 0
    """and how many of those were accepted."""


class EngineCoreOutputs(msgspec.Struct, omit_defaults=True, kw_only=True):
    outputs: list[EngineCoreOutput] = []
    scheduler_stats: SchedulerStats | None = None
    timestamp: float = 0.0


# --- Front-end → engine core, on the input socket (ROUTER → DEALER). -------------------------
# Each message is tagged, so one decoder of `EngineCoreInput` tells them apart; EngineCoreRequest
# travels wrapped in AddRequest and keeps its own encoding for the in-process core.


class AddRequest(msgspec.Struct, tag="add"):
    request: EngineCoreRequest


class AbortRequests(msgspec.Struct, tag="abort"):
    request_ids: list[str]


class UtilityCall(msgspec.Struct, tag="utility", kw_only=True):
    """Ask the core for one of a fixed set of facts (see core_proc.UTILITY_METHODS)."""

    call_id: int
    method: str
    args: list[int | float | str | bool | None] = []


class ShutdownRequest(msgspec.Struct, tag="shutdown"):
    pass


EngineCoreInput = AddRequest | AbortRequests | UtilityCall | ShutdownRequest


# --- Engine core → front-end handshake, on the input socket (DEALER → ROUTER). ---------------
# Sent on the input socket so the ROUTER learns the core's identity before it routes anything.


class EngineCoreReady(msgspec.Struct, tag="ready", kw_only=True):
    """The facts the core fixed while starting, which the front-end needs."""

    num_kv_blocks: int
    max_model_len: int
    block_size: int
    pid: int


class EngineCoreStartupFailed(msgspec.Struct, tag="startup_failed", kw_only=True):
    error: str
    """`ExceptionType: message` of what went wrong."""
    traceback: str = ""


EngineCoreHandshake = EngineCoreReady | EngineCoreStartupFailed


# --- Engine core → front-end, on the output socket (PUSH → PULL). ----------------------------


class OutputsBatch(msgspec.Struct, tag="outputs"):
    """One step's EngineCoreOutputs (or the last ones of aborted requests)."""

    outputs: EngineCoreOutputs


class UtilityResult(msgspec.Struct, tag="utility_result", kw_only=True):
    call_id: int
    result: int | float | str | bool | None = None
    error: str | None = None


class EngineCoreFailed(msgspec.Struct, tag="failed", kw_only=True):
    """The busy loop raised; the core exits right after sending this."""

    error: str
    traceback: str = ""


EngineCoreOutputMessage = OutputsBatch | UtilityResult | EngineCoreFailed
