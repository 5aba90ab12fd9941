"""AsyncEngine end to end: the default model in a real engine-core process.

One engine serves most tests (module scope); the in-process `LLM` on the same model is the
reference for greedy outputs. The kill / shutdown tests start their own small engines.
"""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time

import pytest

from v1_engine import LLM, AsyncEngine, EngineDeadError, SamplingParams
from v1_engine.metrics.base import StatLoggerBase

NUM_STREAMS = 64
MAX_TOKENS = 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
LONG = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)
ENGINE_KWARGS = {"max_model_len": 512, "num_kv_blocks": 512}


class RecordingStatLogger(StatLoggerBase):
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.max_running = 0
        self.finished = []
        self.num_calls = 0

    def record(self, scheduler_stats, outputs, now) -> None:
        with self.lock:
            self.num_calls += 1
            if scheduler_stats is not None:
                self.max_running = max(self.max_running, scheduler_stats.num_running_reqs)
            self.finished.extend(o for o in outputs if o.finished)


@pytest.fixture(scope="module")
def stat_logger():
    return RecordingStatLogger()


@pytest.fixture(scope="module")
def engine(stat_logger):
    engine = AsyncEngine(stat_loggers=[stat_logger], **ENGINE_KWARGS)
    yield engine
    engine.shutdown()
    assert_nothing_left(engine)
    assert engine.engine_core.process.exitcode == 0  # it was asked to stop, not killed


@pytest.fixture(scope="module")
def llm():
    return LLM(**ENGINE_KWARGS)


def prompts() -> list[str | list[int]]:
    texts = [f"Write one sentence about the number {i}." for i in range(NUM_STREAMS - 8)]
    token_prompts = [[1, 504, 3458, 282, 253, 1167, 314, 100 + i] for i in range(8)]
    return texts + token_prompts


def assert_nothing_left(engine: AsyncEngine) -> None:
    client = engine.engine_core
    assert not client.process.is_alive()
    assert not os.path.exists(client.ipc_dir)


async def collect(engine, prompt, params, request_id):
    """Concatenate a stream's deltas; also return the outputs, to check how they streamed."""
    outputs = [out async for out in engine.generate(prompt, params, request_id)]
    text = "".join(o.outputs[0].text for o in outputs)
    token_ids = [t for o in outputs for t in o.outputs[0].token_ids]
    return text, token_ids, outputs


async def wait_for_tokens(stream, count: int) -> list:
    received = []
    async for out in stream:
        received.append(out)
        if sum(len(o.outputs[0].token_ids) for o in received) >= count:
            return received
    raise AssertionError("stream ended early")


def test_many_concurrent_streams_match_llm_generate(engine, llm, stat_logger):
    expected = llm.generate(prompts(), GREEDY, use_tqdm=False)

    async def run():
        return await asyncio.gather(
            *(collect(engine, p, GREEDY, f"stream-{i}") for i, p in enumerate(prompts()))
        )

    results = asyncio.run(run())
    for i, ((text, token_ids, outputs), reference) in enumerate(zip(results, expected)):
        assert token_ids == reference.outputs[0].token_ids, f"stream {i}"
        assert text == reference.outputs[0].text, f"stream {i}"
        assert [o.finished for o in outputs] == [False] * (len(outputs) - 1) + [True]
        assert outputs[-1].outputs[0].finish_reason == reference.outputs[0].finish_reason
        assert all(o.request_id == f"stream-{i}" for o in outputs)
    # Streamed token by token (one step, one token), not delivered in one piece at the end.
    assert all(len(outputs) == len(token_ids) for _, token_ids, outputs in results)
    assert max(len(token_ids) for _, token_ids, _ in results) == MAX_TOKENS
    assert stat_logger.max_running >= NUM_STREAMS // 2
    # Stats are recorded by the client's output thread right after it hands the outputs to the
    # streams, so the last few may land just after the streams end.
    expected_ids = {f"stream-{i}" for i in range(NUM_STREAMS)}
    deadline = time.monotonic() + 2.0
    while True:
        with stat_logger.lock:
            finished_ids = {o.request_id for o in stat_logger.finished}
        if expected_ids <= finished_ids or time.monotonic() > deadline:
            break
        time.sleep(0.01)
    assert expected_ids <= finished_ids
    assert all(o.metrics.first_token_time is not None for o in stat_logger.finished)


def test_chat_and_n_greater_than_one_match_llm(engine, llm):
    messages = [{"role": "user", "content": "Name a color."}]
    sampled = SamplingParams(n=2, temperature=0.8, seed=7, max_tokens=8)
    expected_chat = llm.chat(messages, GREEDY, use_tqdm=False)[0]
    expected_n = llm.generate("A short poem:", sampled, use_tqdm=False)[0]

    async def run():
        chat = [out async for out in engine.chat(messages, GREEDY, "chat")]
        fan_out = [out async for out in engine.generate("A short poem:", sampled, "poem")]
        return chat, fan_out

    chat, fan_out = asyncio.run(run())
    assert [t for o in chat for t in o.outputs[0].token_ids] == expected_chat.outputs[0].token_ids
    assert "".join(o.outputs[0].text for o in chat) == expected_chat.outputs[0].text
    for completion in expected_n.outputs:
        deltas = [o.outputs[0] for o in fan_out if o.outputs[0].index == completion.index]
        assert [t for d in deltas for t in d.token_ids] == completion.token_ids
        assert deltas[-1].finish_reason == completion.finish_reason
    assert all(o.request_id == "poem" for o in fan_out)
    assert [o.finished for o in fan_out] == [False] * (len(fan_out) - 1) + [True]


def test_abort_mid_stream_ends_the_stream_and_frees_every_block(engine):
    async def run():
        free_before = await engine.get_num_free_blocks()
        stream = engine.generate("Count to a thousand:", LONG, "to-abort")
        received = await wait_for_tokens(stream, 3)
        assert await engine.get_num_free_blocks() < free_before
        await engine.abort("to-abort")
        rest = [out async for out in stream]
        return free_before, received, rest, await engine.get_num_free_blocks()

    free_before, received, rest, free_after = asyncio.run(run())
    assert rest[-1].finished
    assert rest[-1].outputs[0].finish_reason == "abort"
    assert sum(len(o.outputs[0].token_ids) for o in received + rest) < LONG.max_tokens
    assert free_after == free_before


def test_cancelling_the_consumer_aborts_the_request(engine):
    async def run():
        free_before = await engine.get_num_free_blocks()
        started = asyncio.Event()

        async def consume(request_id):
            async for _ in engine.generate("Tell me a long story.", LONG, request_id):
                started.set()

        tasks = [asyncio.create_task(consume(f"cancel-{i}")) for i in range(4)]
        await started.wait()
        await asyncio.sleep(0.05)
        for task in tasks:
            task.cancel()
        results = await asyncio.gather(*tasks, return_exceptions=True)
        assert all(isinstance(r, asyncio.CancelledError) for r in results)
        closed = engine.generate("Another long story.", LONG, "closed")
        await wait_for_tokens(closed, 2)
        await closed.aclose()
        return free_before, await engine.get_num_free_blocks()

    free_before, free_after = asyncio.run(run())
    assert free_after == free_before
    assert not engine.output_processor.has_unfinished_requests()
    assert engine._streams == {}


def test_invalid_request_fails_alone(engine):
    async def run():
        good = asyncio.create_task(collect(engine, "Hello", GREEDY, "good"))
        with pytest.raises(ValueError, match="max_tokens"):
            await collect(engine, "Hello", SamplingParams(max_tokens=0), "bad-params")
        with pytest.raises(ValueError, match="max_model_len"):
            await collect(engine, [1] * 600, GREEDY, "too-long")
        with pytest.raises(ValueError, match="prompt"):
            await collect(engine, "", GREEDY, "empty")
        bad_stop = SamplingParams(stop_token_ids=[10**7], min_tokens=2)
        with pytest.raises(ValueError, match="stop_token_ids"):
            await collect(engine, "Hello", bad_stop, "stop-id-past-vocab")
        return await good

    _text, token_ids, outputs = asyncio.run(run())
    assert outputs[-1].finished and len(token_ids) > 0
    assert engine.is_healthy()


def test_logit_bias_crosses_to_the_core_process(engine):
    """logit_bias (int keys) and allowed_token_ids survive the msgspec trip to the core."""
    forced = SamplingParams(temperature=0.0, max_tokens=4, logit_bias={1167: 100.0})
    allowed = SamplingParams(temperature=1.0, max_tokens=6, seed=1, allowed_token_ids=[504, 3458])

    async def run():
        return await asyncio.gather(
            collect(engine, "Hello", forced, "bias"), collect(engine, "Hi", allowed, "allowed")
        )

    (_, forced_ids, _), (_, allowed_ids, _) = asyncio.run(run())
    assert forced_ids == [1167] * 4
    assert len(allowed_ids) == 6 and set(allowed_ids) <= {504, 3458}


def test_duplicate_request_id_is_rejected(engine):
    async def run():
        first = engine.generate("Hello", LONG, "same-id")
        await wait_for_tokens(first, 1)
        with pytest.raises(ValueError, match="already in use"):
            await collect(engine, "Hi", GREEDY, "same-id")
        await first.aclose()

    asyncio.run(run())


def test_kill_9_fails_pending_and_new_requests_within_a_second():
    async def run():
        async with AsyncEngine(**ENGINE_KWARGS) as engine:
            assert engine.is_healthy()

            async def consume(request_id):
                async for _ in engine.generate("Tell me a story.", LONG, request_id):
                    pass

            tasks = [asyncio.create_task(consume(f"pending-{i}")) for i in range(3)]
            await asyncio.sleep(0.5)
            os.kill(engine.engine_core.process.pid, signal.SIGKILL)
            start = time.monotonic()
            results = await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 5)
            elapsed = time.monotonic() - start
            new_start = time.monotonic()
            with pytest.raises(EngineDeadError, match="died unexpectedly"):
                await collect(engine, "Hello", GREEDY, "after-death")
            with pytest.raises(EngineDeadError):
                await engine.get_num_free_blocks()
            assert not engine.is_healthy()
        return engine, results, elapsed, time.monotonic() - new_start

    engine, results, elapsed, new_elapsed = asyncio.run(run())
    assert all(isinstance(r, EngineDeadError) for r in results), results
    assert elapsed < 1.0
    assert new_elapsed < 0.1
    assert_nothing_left(engine)  # `async with` shut it down: no process, no socket directory
