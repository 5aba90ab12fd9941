"""Rules the scheduler applies to a step's output: when a request stops, which prompt-logprob
rows are new."""

from __future__ import annotations

from v1_engine.core.request import Request, RequestStatus
from v1_engine.protocol import LogprobsLists


def check_stop(request: Request, max_model_len: int) -> bool:
    """Decide whether the request's newest output token ends it; if so, set its status.

    Checked in order: stop tokens (stop_token_ids, then EOS unless ignore_eos), max_tokens,
    max_model_len. Stop tokens only count once `min_tokens` tokens were generated before them,
    the same rule the sampler uses to mask them.
    """
    params = request.sampling_params
    last_token_id = request.output_token_ids[-1]
    num_generated_before = request.num_output_tokens - 1
    if num_generated_before >= params.min_tokens:
        if params.stop_token_ids and last_token_id in params.stop_token_ids:
            request.status = RequestStatus.FINISHED_STOPPED
            request.stop_reason = last_token_id
            return True
        if not params.ignore_eos and last_token_id == request.eos_token_id:
            request.status = RequestStatus.FINISHED_STOPPED
            return True
    if params.max_tokens is not None and request.num_output_tokens >= params.max_tokens:
        request.status = RequestStatus.FINISHED_LENGTH_CAPPED
        return True
    if request.num_tokens >= max_model_len:
        request.status = RequestStatus.FINISHED_LENGTH_CAPPED
        return True
    return False


def take_new_prompt_logprobs(
    request: Request, rows: LogprobsLists | None, chunk_start: int
) -> LogprobsLists | None:
    """The step's prompt-logprob rows that were not already returned.

    Row k of a step scores the prompt position after `chunk_start + k`, where chunk_start is the
    request's computed count before the step. A request preempted mid-prompt recomputes its
    prompt from the start; the rows it already returned are dropped here instead of sent twice.
    """
    if rows is None:
        return None
    num_rows = len(rows.ranks)
    skip = max(0, request.num_prompt_logprob_rows - chunk_start)
    request.num_prompt_logprob_rows = max(request.num_prompt_logprob_rows, chunk_start + num_rows)
    if skip >= num_rows:
        return None
    if skip == 0:
        return rows
    return LogprobsLists(rows.token_ids[skip:], rows.logprobs[skip:], rows.ranks[skip:])
