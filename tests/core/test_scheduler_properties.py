"""Property tests: random add / step / finish / abort sequences on a small KV pool.

After every operation the block bookkeeping must be exact: each block's ref_cnt is its number
of owners, only cached prefix blocks of equal hash are shared, free blocks are queued exactly
once, and when everything has finished every block is free again.
"""

from __future__ import annotations

import random
from collections import Counter

from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from v1_engine.core.request import Request, RequestStatus
from v1_engine.core.scheduler import Scheduler
from v1_engine.protocol import FinishReason

BLOCK_SIZE = 4
MAX_MODEL_LEN = 32
EOS = 2
STOP_TOKEN = 3
PREFIXES = (list(range(10, 30)), list(range(40, 60)), [7] * 20)
FINISHED_STATUSES = (RequestStatus.FINISHED_ABORTED, RequestStatus.FINISHED_STOPPED)

add_op = st.tuples(
    st.just("add"),
    st.sampled_from(range(len(PREFIXES))),
    st.integers(0, 20),  # tokens of the shared prefix
    st.lists(st.integers(100, 103), max_size=10),  # own tail
    st.integers(1, 12),  # max_tokens
    st.sampled_from([False, False, False, True]),  # prompt logprobs: no prefix-cache lookup
)
step_op = st.tuples(st.just("step"))
finish_op = st.tuples(st.just("finish"), st.integers(0, 30), st.sampled_from(FINISHED_STATUSES))
operation_kind = st.sampled_from(["add"] * 3 + ["step"] * 4 + ["finish"])
operation = operation_kind.flatmap(
    lambda kind: {"add": add_op, "step": step_op, "finish": finish_op}[kind]
)
operations = st.lists(operation, min_size=15, max_size=60)


def check_block_invariants(scheduler: Scheduler) -> None:
    kv = scheduler.kv_cache_manager
    pool = kv.block_pool
    owners: Counter[int] = Counter()
    for req_id, blocks in kv.req_to_blocks.items():
        request = scheduler.requests[req_id]
        assert request.status == RequestStatus.RUNNING, "only running requests hold blocks"
        assert len({block.block_id for block in blocks}) == len(blocks)
        assert len(blocks) * BLOCK_SIZE >= request.num_computed_tokens
        owners.update(block.block_id for block in blocks)
        for index, block in enumerate(blocks):
            if block.block_hash is not None:
                assert request.block_hashes[index] == block.block_hash, "cached content differs"
    for block in pool.blocks:
        assert block.ref_cnt == owners[block.block_id]
        if block.ref_cnt > 1:
            assert block.block_hash is not None, "only cached prefix blocks are shared"
    free_ids = [block.block_id for block in pool.free_block_queue]
    assert len(free_ids) == len(set(free_ids)) == kv.num_free_blocks
    assert set(free_ids) == {block.block_id for block in pool.blocks if block.ref_cnt == 0}
    assert kv.num_free_blocks + len(owners) == pool.num_blocks
    for block_hash, block in pool.cached_block_hash_to_block.items():
        assert block.block_hash == block_hash


def check_scheduler_invariants(scheduler: Scheduler) -> None:
    running = {request.request_id for request in scheduler.running}
    waiting = {request.request_id for request in scheduler.waiting}
    assert not running & waiting
    assert running | waiting == set(scheduler.requests)
    assert len(scheduler.running) <= scheduler.max_num_seqs
    for request in scheduler.waiting:
        assert request.num_computed_tokens == 0
        assert request.request_id not in scheduler.kv_cache_manager.req_to_blocks
    for request in scheduler.running:
        assert request.num_computed_tokens <= min(request.num_tokens, MAX_MODEL_LEN)


def check_runner_view(scheduler: Scheduler, runner) -> None:
    """After a step, the runner's block tables (built from diffs) match the scheduler's."""
    for request in scheduler.running:
        state = runner.states[request.request_id]
        assert state.block_ids == scheduler.kv_cache_manager.get_block_ids(request.request_id)
        assert state.num_computed_tokens == request.num_computed_tokens


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    ops=operations,
    num_blocks=st.integers(MAX_MODEL_LEN // BLOCK_SIZE, 12),
    budget=st.integers(1, 24),
    max_num_seqs=st.integers(1, 4),
    enable_prefix_caching=st.booleans(),
    by_priority=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_random_operations_keep_block_bookkeeping_exact(
    core, ops, num_blocks, budget, max_num_seqs, enable_prefix_caching, by_priority, seed
):
    scheduler = core.make_scheduler(
        num_blocks=num_blocks,
        block_size=BLOCK_SIZE,
        max_num_batched_tokens=budget,
        max_num_seqs=max_num_seqs,
        max_model_len=MAX_MODEL_LEN,
        enable_prefix_caching=enable_prefix_caching,
        scheduling_policy="priority" if by_priority else "fcfs",
    )
    rng = random.Random(seed)
    vocab = [EOS, STOP_TOKEN] + list(range(100, 108))
    runner = core.FakeRunner(block_size=BLOCK_SIZE, next_token=lambda _r, _t: rng.choice(vocab))
    transcript = core.Transcript()
    added: dict[str, Request] = {}
    finished_from_outside: set[str] = set()

    def do_step() -> None:
        sched_output = core.step(scheduler, runner, transcript)
        assert 0 < sched_output.total_num_scheduled_tokens <= budget or sched_output.is_empty
        check_runner_view(scheduler, runner)
        stats = transcript.steps[-1][1].scheduler_stats
        if stats.num_preempted_reqs:
            event("a step preempted")
            assert not sched_output.scheduled_new_reqs, "a step short of blocks admits nobody"
        if stats.prefix_cache_hits:
            event("a step hit the prefix cache")

    for op in ops:
        if op[0] == "add":
            _, prefix_index, prefix_len, tail, max_tokens, prompt_logprobs = op
            prompt = PREFIXES[prefix_index][:prefix_len] + tail or [5]
            req_id = f"r{len(added)}"
            request = core.make_request(
                req_id,
                prompt,
                max_tokens=max_tokens,
                stop_token_ids=[STOP_TOKEN],
                prompt_logprobs=1 if prompt_logprobs else None,
            )
            request.arrival_time = float(len(added))
            if by_priority:
                request.priority = rng.randint(-2, 2)
            scheduler.add_request(request)
            added[req_id] = request
        elif op[0] == "step":
            do_step()
        else:
            _, index, status = op
            if f"r{index}" in scheduler.requests:
                finished_from_outside.add(f"r{index}")
            scheduler.finish_requests(f"r{index}", status)
        check_block_invariants(scheduler)
        check_scheduler_invariants(scheduler)
        if by_priority:  # both queues in (priority, arrival) order
            for queue in (list(scheduler.waiting), scheduler.running):
                keys = [(r.priority, r.arrival_time) for r in queue]
                assert keys == sorted(keys), keys

    # Every token is computed at least once, one budget a step; preemptions recompute some.
    work = sum(r.num_prompt_tokens + r.sampling_params.max_tokens for r in added.values())
    for _ in range(3 * work // budget + 100):
        if not scheduler.has_unfinished_requests():
            break
        do_step()
        check_block_invariants(scheduler)
        check_scheduler_invariants(scheduler)
    assert not scheduler.has_unfinished_requests()

    pool = scheduler.kv_cache_manager.block_pool
    assert all(block.ref_cnt == 0 for block in pool.blocks)
    assert len(pool.free_block_queue) == num_blocks and scheduler.kv_cache_manager.usage == 0.0
    assert set(transcript.finish_reasons) == set(added) - finished_from_outside
    for req_id, reason in transcript.finish_reasons.items():
        check_finish(
            added[req_id], transcript.tokens[req_id], reason, transcript.stop_reasons[req_id]
        )


def check_finish(request: Request, tokens: list[int], reason: FinishReason, stop_reason) -> None:
    """The client saw exactly the request's outputs, ending for the reason it reports."""
    assert tokens == request.output_token_ids
    assert 1 <= len(tokens) <= request.sampling_params.max_tokens
    if reason == FinishReason.STOP:
        assert tokens[-1] == (STOP_TOKEN if stop_reason == STOP_TOKEN else EOS)
        assert EOS not in tokens[:-1] and STOP_TOKEN not in tokens[:-1]
    else:
        assert reason == FinishReason.LENGTH and stop_reason is None
        at_max_tokens = len(tokens) == request.sampling_params.max_tokens
        assert at_max_tokens or request.num_tokens >= MAX_MODEL_LEN
