"""The persistent input batch: per-request state the runner keeps across steps.

A request occupies one row of preallocated CPU arrays (token ids, block table, computed count)
from its first step until it finishes or is preempted. Each step only the diff from the
SchedulerOutput is applied, and the flat model inputs are gathered from the rows with vectorized
numpy, never rebuilt per request in Python.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from v1_engine.sampling_params import SamplingParams
from v1_engine.spec_decode.ngram import DraftBackoff
from v1_engine.structured_output import RequestGrammar


@dataclass
class CachedRequestState:
    req_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    sampling_params: SamplingParams
    generator: torch.Generator | None
    eos_token_id: int | None
    grammar: RequestGrammar | None = None
    """The structured-output matcher of a request with `structured_outputs`."""
    backoff: DraftBackoff | None = None
    """With speculative decoding: when this request skips its drafts."""

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)


class InputBatch:
    def __init__(self, max_num_reqs: int, max_model_len: int, block_size: int) -> None:
        self.max_num_reqs = max_num_reqs
        self.block_size = block_size
        max_blocks_per_req = -(-max_model_len // block_size)
        self.token_ids = np.zeros((max_num_reqs, max_model_len), dtype=np.int64)
        self.num_tokens = np.zeros(max_num_reqs, dtype=np.int64)
        self.num_computed_tokens = np.zeros(max_num_reqs, dtype=np.int64)
        self.block_table = np.zeros((max_num_reqs, max_blocks_per_req), dtype=np.int32)
        self.num_blocks = np.zeros(max_num_reqs, dtype=np.int64)
        self.req_ids: list[str | None] = [None] * max_num_reqs
        self.req_id_to_row: dict[str, int] = {}
        self.states: dict[str, CachedRequestState] = {}

    @property
    def num_reqs(self) -> int:
        return len(self.req_id_to_row)

    def add_request(
        self, state: CachedRequestState, block_ids: list[int], num_computed_tokens: int
    ) -> None:
        row = len(self.req_id_to_row)
        assert row < self.max_num_reqs, "scheduler exceeded max_num_seqs"
        tokens = state.prompt_token_ids + state.output_token_ids
        self.token_ids[row, : len(tokens)] = tokens
        self.num_tokens[row] = len(tokens)
        self.num_computed_tokens[row] = num_computed_tokens
        self.num_blocks[row] = 0
        self.append_blocks(row, block_ids)
        self.req_ids[row] = state.req_id
        self.req_id_to_row[state.req_id] = row
        self.states[state.req_id] = state

    def append_blocks(self, row: int, block_ids: list[int]) -> None:
        start = self.num_blocks[row]
        self.block_table[row, start : start + len(block_ids)] = block_ids
        self.num_blocks[row] = start + len(block_ids)

    def remove_request(self, req_id: str) -> None:
        """Drop a request; the last row moves into the hole so rows stay dense."""
        row = self.req_id_to_row.pop(req_id, None)
        if row is None:
            return
        del self.states[req_id]
        last = len(self.req_id_to_row)
        if row != last:
            moved = self.req_ids[last]
            assert moved is not None
            n = self.num_tokens[last]
            self.token_ids[row, :n] = self.token_ids[last, :n]
            self.num_tokens[row] = n
            self.num_computed_tokens[row] = self.num_computed_tokens[last]
            nb = self.num_blocks[last]
            self.block_table[row, :nb] = self.block_table[last, :nb]
            self.num_blocks[row] = nb
            self.req_ids[row] = moved
            self.req_id_to_row[moved] = row
        self.req_ids[last] = None

    def add_placeholder(self, row: int) -> int:
        """Count a sampled token whose value is still on the device; returns its position."""
        position = int(self.num_tokens[row])
        self.num_tokens[row] = position + 1
        return position

    def write_drafts(self, req_id: str, drafts: list[int]) -> None:
        """Speculative decoding: a step's drafts after the request's known tokens (not counted
        in num_tokens: `append_tokens` writes over them with what is accepted)."""
        row = self.req_id_to_row[req_id]
        n = int(self.num_tokens[row])
        self.token_ids[row, n : n + len(drafts)] = drafts

    def append_tokens(self, req_id: str, token_ids: list[int]) -> None:
        """Append tokens known on the host (a verify step's accepted ones)."""
        row = self.req_id_to_row[req_id]
        n = int(self.num_tokens[row])
        self.token_ids[row, n : n + len(token_ids)] = token_ids
        self.num_tokens[row] = n + len(token_ids)
        self.states[req_id].output_token_ids.extend(token_ids)

    def set_token(self, req_id: str, position: int, token_id: int) -> None:
        """Fill in a placeholder once its value reached the host (no-op if the request left)."""
        row = self.req_id_to_row.get(req_id)
        if row is None:
            return
        self.token_ids[row, position] = token_id
        self.states[req_id].output_token_ids.append(token_id)
