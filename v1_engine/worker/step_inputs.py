"""One step's inputs, built on the host from the SchedulerOutput and the persistent input batch:
positions, slots, paging metadata, the rows that sample, and where the previous step's sampled
tokens (still on the device) feed in; every device tensor rides one pinned staging copy."""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from v1_engine.attention.backend import AttentionMetadata
from v1_engine.core.sched_output import SchedulerOutput
from v1_engine.worker.host_staging import HostStaging
from v1_engine.worker.input_batch import InputBatch
from v1_engine.worker.step_output import PendingTokens


@dataclasses.dataclass
class StepInputs:
    """One step's inputs: host-side arrays the runner keeps using, device tensors the forward and
    the sampler read (all copied through the pinned staging, none with a sync)."""

    rows: np.ndarray
    """Input-batch row of each scheduled request."""
    cu: np.ndarray
    """Cumulative scheduled tokens, [num_reqs + 1]."""
    seq_lens: np.ndarray
    sample_idx: np.ndarray
    """Scheduled requests that sample a token this step."""
    input_ids: torch.Tensor
    positions: torch.Tensor
    metadata: AttentionMetadata
    logits_idx: torch.Tensor
    """Rows of the step's hidden states that are sampled: each sampling request's last token
    (with drafts, its last num_sample_rows tokens)."""
    logits_prefix: int | None
    """n when logits_idx is 0..n-1 (a decode step where every request samples): the sampled
    rows are then hidden[:n], a view, and no gather kernel runs. None otherwise."""
    feed_dst: torch.Tensor | None
    """Where the previous step's sampled tokens go in input_ids; None when none do."""
    feed_src: torch.Tensor
    feed_rows: torch.Tensor | None
    """A uniform decode step's feed per token: the previous step's row it consumes, -1 for
    none (what a decode graph's input kernel reads); None for other steps or without a feed."""


def prepare_step_inputs(
    batch: InputBatch,
    so: SchedulerOutput,
    req_ids: list[str],
    block_size: int,
    staging: HostStaging,
    pending: PendingTokens | None,
) -> StepInputs:
    """The inputs of a step scheduling `req_ids` (in that order), whose requests the batch
    already holds; `pending` is the previous step's sampled tokens, not yet on the host."""
    rows = np.array([batch.req_id_to_row[r] for r in req_ids], dtype=np.int64)
    num_sched = np.array([so.num_scheduled_tokens[r] for r in req_ids], dtype=np.int64)
    total = int(num_sched.sum())
    max_query_len = int(num_sched.max())
    cu = np.zeros(len(req_ids) + 1, dtype=np.int64)
    np.cumsum(num_sched, out=cu[1:])
    token_req = np.repeat(np.arange(len(req_ids)), num_sched)
    offsets = np.arange(total) - cu[:-1][token_req]
    computed = batch.num_computed_tokens[rows]
    positions = computed[token_req] + offsets
    token_rows = rows[token_req]
    input_ids = batch.token_ids[token_rows, positions]
    bs = block_size
    slots = batch.block_table[token_rows, positions // bs].astype(np.int64) * bs + positions % bs
    seq_lens = computed + num_sched
    max_blocks = int(-(-seq_lens.max() // bs))
    block_table = batch.block_table[rows, :max_blocks]
    # A request samples only when this step reaches the end of its tokens.
    sample_idx = np.nonzero(seq_lens >= batch.num_tokens[rows])[0]
    feed_dst, feed_src = _pending_feed_indices(batch, pending, req_ids, computed, cu)
    # Logits rows of each sampling request: 1, or with drafts 1 + drafts (its last known
    # token's position, then each draft's).
    num_sample_rows = np.ones(len(sample_idx), dtype=np.int64)
    spec = so.scheduled_spec_token_ids
    if spec:
        num_sample_rows += [len(spec.get(req_ids[i], ())) for i in sample_idx]
    logits_idx = cu[1:][sample_idx] - 1
    if spec and len(sample_idx):  # each sampling request's last num_sample_rows tokens, in order
        ends = np.repeat(logits_idx + 1, num_sample_rows)
        first = np.cumsum(num_sample_rows)
        logits_idx = ends - np.repeat(first, num_sample_rows) + np.arange(int(first[-1]))
    in_order = np.array_equal(logits_idx, np.arange(len(logits_idx)))
    logits_prefix = len(logits_idx) if in_order else None
    feed_rows = {}
    if len(feed_dst) and max_query_len == 1:  # a uniform decode step: the graphs' feed
        feed_rows["feed_rows"] = np.full(total, -1, dtype=np.int64)
        feed_rows["feed_rows"][feed_dst] = feed_src

    cu32, seq_lens32 = cu.astype(np.int32), seq_lens.astype(np.int32)
    # Every index the step needs on the device rides in this one pinned, non-blocking
    # staging: a pageable or blocking copy here would wait for the previous step's kernels
    # and leave the GPU idle while the host prepares the next step.
    staged = staging.stage(
        input_ids=input_ids,
        positions=positions,
        slot_mapping=slots,
        query_start_loc=cu32,
        seq_lens=seq_lens32,
        block_table=block_table,
        logits_idx=logits_idx,
        feed_dst=feed_dst,
        feed_src=feed_src,
        **feed_rows,
    )
    return StepInputs(
        rows=rows,
        cu=cu,
        seq_lens=seq_lens,
        sample_idx=sample_idx,
        input_ids=staged["input_ids"],
        positions=staged["positions"],
        metadata=_attention_metadata(staged, cu32, seq_lens32, max_query_len),
        logits_idx=staged["logits_idx"],
        logits_prefix=logits_prefix,
        feed_dst=staged["feed_dst"] if len(feed_dst) else None,
        feed_src=staged["feed_src"],
        feed_rows=staged.get("feed_rows"),
    )


def _attention_metadata(
    staged: dict[str, torch.Tensor], cu: np.ndarray, seq_lens: np.ndarray, max_query_len: int
) -> AttentionMetadata:
    """The step's paging metadata: the staged device tensors, with host copies of the query
    starts and sequence lengths (int32, the dtype staged)."""
    return AttentionMetadata(
        num_actual_tokens=int(cu[-1]),
        query_start_loc=staged["query_start_loc"],
        seq_lens=staged["seq_lens"],
        block_table=staged["block_table"],
        slot_mapping=staged["slot_mapping"],
        max_query_len=max_query_len,
        max_seq_len=int(seq_lens.max()),
        query_start_loc_cpu=torch.from_numpy(cu),
        seq_lens_cpu=torch.from_numpy(seq_lens),
    )


def _pending_feed_indices(
    batch: InputBatch,
    pending: PendingTokens | None,
    req_ids: list[str],
    computed: np.ndarray,
    cu: np.ndarray,
) -> tuple[np.ndarray, np.ndarray]:
    """(positions in this step's input_ids, rows of the previous step's sampled tokens) for
    each token the previous step sampled that this step consumes; `computed` holds each
    scheduled request's num_computed_tokens before this step."""
    dst: list[int] = []
    src: list[int] = []
    if pending is not None:
        index = {req_id: i for i, req_id in enumerate(req_ids)}
        for j, (req_id, position) in enumerate(zip(pending.req_ids, pending.positions)):
            i = index.get(req_id)
            if i is None or req_id not in batch.req_id_to_row:
                continue
            offset = position - int(computed[i])
            if 0 <= offset < cu[i + 1] - cu[i]:
                dst.append(int(cu[i]) + offset)
                src.append(j)
    return np.array(dst, dtype=np.int64), np.array(src, dtype=np.int64)
