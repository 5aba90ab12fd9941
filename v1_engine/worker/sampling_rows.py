"""A step's sampling rows and their metadata: one row per sampling request, or with speculative
decoding one per verify position (its outputs include the drafts before it), plus the
structured-output bitmask of those rows."""

from __future__ import annotations

import torch

from v1_engine.sample.metadata import SamplingMetadata
from v1_engine.sampling_params import SamplingParams
from v1_engine.structured_output import allocate_bitmask
from v1_engine.worker.input_batch import CachedRequestState


def sampling_metadata(
    states: list[CachedRequestState],
    drafts: list[list[int]] | None,
    vocab_size: int,
    device: torch.device,
) -> SamplingMetadata:
    """The metadata of the sampling requests' rows: one per request or, with `drafts` (one
    list per request), one per verify position, whose outputs include the drafts before it
    (penalties and min_tokens read them)."""
    if drafts is None:
        row_states, outputs = states, [s.output_token_ids for s in states]
    else:
        row_states, outputs = [], []
        for state, request_drafts in zip(states, drafts, strict=True):
            # Only penalties and min_tokens read the outputs: other rows share the list.
            reads = _reads_outputs(state.sampling_params, len(state.output_token_ids))
            for i in range(len(request_drafts) + 1):
                row_states.append(state)
                if i and reads:
                    outputs.append(state.output_token_ids + request_drafts[:i])
                else:
                    outputs.append(state.output_token_ids)
    metadata = SamplingMetadata.build(
        params=[s.sampling_params for s in row_states],
        prompt_token_ids=[s.prompt_token_ids for s in row_states],
        output_token_ids=outputs,
        eos_token_ids=[s.eos_token_id for s in row_states],
        generators=[s.generator for s in row_states],
        vocab_size=vocab_size,
        device=device,
    )
    metadata.grammar_bitmask = grammar_bitmask(states, drafts, vocab_size, device)
    return metadata


def grammar_bitmask(
    states: list[CachedRequestState],
    drafts: list[list[int]] | None,
    vocab_size: int,
    device: torch.device,
) -> torch.Tensor | None:
    """The sampling rows' allowed tokens ([rows, ceil(V / 32)] int32 on the device) when any
    request is constrained; their newest tokens are on the host by now (the runner resolved
    them). With drafts, a request's rows are its verify positions (RequestGrammar.fill_bitmasks)."""
    if all(s.grammar is None for s in states):
        return None
    num_rows = len(states) + (sum(map(len, drafts)) if drafts is not None else 0)
    bitmask = allocate_bitmask(num_rows, vocab_size)
    row = 0
    for i, state in enumerate(states):
        request_drafts = drafts[i] if drafts is not None else []
        if state.grammar is not None:
            state.grammar.fill_bitmasks(state.output_token_ids, request_drafts, bitmask, row)
        row += len(request_drafts) + 1
    return bitmask.to(device, non_blocking=True)


def _reads_outputs(params: SamplingParams, num_outputs: int) -> bool:
    """Whether sampling reads a row's output tokens: penalties count them, min_tokens their
    number (until it is reached)."""
    return bool(
        params.presence_penalty
        or params.frequency_penalty
        or params.repetition_penalty != 1.0
        or params.min_tokens > num_outputs
    )
