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
    prompt_logprobs: dict[str, LogprobsLists] = field(default_factory=dict)

    def get_output(self) -> ModelRunnerOutput:
        sampled_lists: dict[str, list[int]] = {}
        logprobs: dict[str, LogprobsLists] = {}
        if self.sampled is not None:
            tokens = self.sampled.host_tokens()
            sampled_lists = {r: [t] for r, t in zip(self.sampled.req_ids, tokens)}
            if self.logprobs is not None:
                lists = self.logprobs.to_lists()
                for j, (req_id, want) in enumerate(zip(self.sampled.req_ids, self.num_logprobs)):
                    if want is not None:
                        logprobs[req_id] = _take_row(lists, j, want)
        return ModelRunnerOutput(
            req_ids=self.req_ids,
            sampled_token_ids=[sampled_lists.get(r, []) for r in self.req_ids],
            logprobs=logprobs,
            prompt_logprobs=self.prompt_logprobs,
        )


def _take_row(lists: LogprobsLists, row: int, num_logprobs: int) -> LogprobsLists:
    return LogprobsLists(
        token_ids=[lists.token_ids[row][: num_logprobs + 1]],
        logprobs=[lists.logprobs[row][: num_logprobs + 1]],
        ranks=[lists.ranks[row]],
    )
