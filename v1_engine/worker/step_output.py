"""What a launched step leaves behind: its sampled tokens on the device, their copy to the host in
flight, and the runner output built once they land (the seam async scheduling works through)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from v1_engine.core.sched_output import ModelRunnerOutput
from v1_engine.protocol import LogprobsLists
from v1_engine.sample.logprobs import LogprobsTensors


def copy_to_host(tensor: torch.Tensor) -> torch.Tensor:
    """A non-blocking device-to-host copy into pinned memory (a plain tensor on CPU)."""
    if tensor.device.type == "cpu":
        return tensor
    host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    host.copy_(tensor, non_blocking=True)
    return host


@dataclass
class PendingTokens:
    """Tokens one step sampled: on the device at once, on the host after the copy lands."""

    req_ids: list[str]
    positions: list[int]
    """Where each token sits in its request's sequence."""
    device_ids: torch.Tensor
    host_ids: torch.Tensor
    copy_done: torch.cuda.Event | None = None

    def __post_init__(self) -> None:
        if self.device_ids.device.type == "cuda":
            self.copy_done = torch.cuda.Event()
            self.copy_done.record()

    def host_tokens(self) -> list[int]:
        if self.copy_done is not None:
            self.copy_done.synchronize()
        return self.host_ids.tolist()


@dataclass
class StepOutput:
    """A launched step. `get_output()` waits for its tokens and builds the runner output."""

    req_ids: list[str]
    sampled: PendingTokens | None
    logprobs: LogprobsTensors | None = None
    num_logprobs: list[int | None] = field(default_factory=list)
    """Logprobs each sampling request asked for, in sampling order."""
    prompt_logprobs: dict[str, LogprobsLists] = field(default_factory=dict)
    accepted: dict[str, list[int]] | None = None
    """Speculative decoding: each sampling request's kept tokens, already on the host (the
    step is settled at launch), in sampling order; `sampled` is None then."""
    first_rows: list[int] = field(default_factory=list)
    """With `accepted`: each sampling request's first row of the logprobs."""
    spec_token_ids: dict[str, list[int]] = field(default_factory=dict)
    """Speculative decoding: drafts proposed for the next step."""

    def get_output(self) -> ModelRunnerOutput:
        sampled_lists: dict[str, list[int]] = {}
        first_rows: list[int] = self.first_rows
        if self.accepted is not None:
            sampled_lists = self.accepted
        elif self.sampled is not None:
            tokens = self.sampled.host_tokens()
            sampled_lists = {r: [t] for r, t in zip(self.sampled.req_ids, tokens)}
            first_rows = list(range(len(tokens)))
        logprobs: dict[str, LogprobsLists] = {}
        if self.logprobs is not None:
            lists = self.logprobs.to_lists()
            for (req_id, kept), start, want in zip(
                sampled_lists.items(), first_rows, self.num_logprobs, strict=True
            ):
                if want is not None:
                    logprobs[req_id] = _take_rows(lists, start, len(kept), want)
        return ModelRunnerOutput(
            req_ids=self.req_ids,
            sampled_token_ids=[sampled_lists.get(r, []) for r in self.req_ids],
            logprobs=logprobs,
            prompt_logprobs=self.prompt_logprobs,
            spec_token_ids=self.spec_token_ids,
        )


def _take_rows(lists: LogprobsLists, start: int, count: int, num_logprobs: int) -> LogprobsLists:
    rows = range(start, start + count)
    return LogprobsLists(
        token_ids=[lists.token_ids[r][: num_logprobs + 1] for r in rows],
        logprobs=[lists.logprobs[r][: num_logprobs + 1] for r in rows],
        ranks=[lists.ranks[r] for r in rows],
    )
