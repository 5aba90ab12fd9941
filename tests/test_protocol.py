"""Every message of protocol.py survives msgpack encoding, alone and through its wire union.

The examples set every field to a non-default value, so a field that failed to encode or
decode (or was dropped by omit_defaults) would show up as a difference.
"""

from __future__ import annotations

import inspect

import msgspec
import pytest

from v1_engine import protocol
from v1_engine.protocol import (
    AbortRequests,
    AddRequest,
    EngineCoreFailed,
    EngineCoreHandshake,
    EngineCoreInput,
    EngineCoreOutput,
    EngineCoreOutputMessage,
    EngineCoreOutputs,
    EngineCoreReady,
    EngineCoreRequest,
    EngineCoreStartupFailed,
    FinishReason,
    LogprobsLists,
    OutputsBatch,
    SchedulerStats,
    ShutdownRequest,
    UtilityCall,
    UtilityResult,
)
from v1_engine.sampling_params import SamplingParams

SAMPLING_PARAMS = SamplingParams(
    n=3,
    temperature=0.7,
    top_p=0.9,
    top_k=40,
    min_p=0.05,
    seed=1234,
    presence_penalty=0.5,
    frequency_penalty=-0.5,
    repetition_penalty=1.1,
    max_tokens=None,
    min_tokens=2,
    stop=["\n\n", "END"],
    stop_token_ids=[2, 7],
    ignore_eos=True,
    include_stop_str_in_output=True,
    logprobs=5,
    prompt_logprobs=1,
    skip_special_tokens=False,
)
REQUEST = EngineCoreRequest(
    request_id="req-1",
    prompt_token_ids=[1, 9906, 11, 1917],
    sampling_params=SAMPLING_PARAMS,
    eos_token_id=2,
    arrival_time=1718000000.25,
)
LOGPROBS = LogprobsLists(
    token_ids=[[5, 5, 9], [7, 3, 7]],
    logprobs=[[-0.1, -0.1, -2.5], [-1.5, -0.2, -1.5]],
    ranks=[1, 2],
)
STATS = SchedulerStats(
    num_running_reqs=64,
    num_waiting_reqs=3,
    kv_cache_usage=0.375,
    prefix_cache_queries=1000,
    prefix_cache_hits=640,
    num_preempted_reqs=1,
)
OUTPUT = EngineCoreOutput(
    request_id="req-1",
    new_token_ids=[5, 7],
    new_logprobs=LOGPROBS,
    new_prompt_logprobs=LOGPROBS,
    finish_reason=FinishReason.STOP,
    stop_reason="END",
    num_cached_tokens=16,
)
OUTPUTS = EngineCoreOutputs(
    outputs=[OUTPUT, EngineCoreOutput(request_id="req-2", new_token_ids=[3])],
    scheduler_stats=STATS,
    timestamp=12345.5,
)

EXAMPLES = [
    SAMPLING_PARAMS,
    REQUEST,
    LOGPROBS,
    OUTPUT,
    STATS,
    OUTPUTS,
    AddRequest(REQUEST),
    AbortRequests(["req-1", "req-2_0"]),
    UtilityCall(call_id=7, method="get_num_free_blocks", args=[1, 2.5, "x", True, None]),
    ShutdownRequest(),
    EngineCoreReady(num_kv_blocks=4096, max_model_len=8192, block_size=16, pid=4242),
    EngineCoreStartupFailed(error="ValueError: bad model", traceback="Traceback ..."),
    OutputsBatch(OUTPUTS),
    UtilityResult(call_id=7, result=123),
    UtilityResult(call_id=8, error="RuntimeError: nope"),
    EngineCoreFailed(error="RuntimeError: boom", traceback="Traceback ..."),
]

WIRE_UNIONS = {
    "input": (EngineCoreInput, (AddRequest, AbortRequests, UtilityCall, ShutdownRequest)),
    "handshake": (EngineCoreHandshake, (EngineCoreReady, EngineCoreStartupFailed)),
    "output": (EngineCoreOutputMessage, (OutputsBatch, UtilityResult, EngineCoreFailed)),
}


def _protocol_structs() -> set[type]:
    return {
        obj
        for _, obj in inspect.getmembers(protocol, inspect.isclass)
        if issubclass(obj, msgspec.Struct) and obj.__module__ == protocol.__name__
    }


def test_every_protocol_struct_has_an_example():
    assert _protocol_structs() <= {type(example) for example in EXAMPLES}


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda e: type(e).__name__)
def test_msgpack_round_trip(example):
    encoded = msgspec.msgpack.encode(example)
    decoded = msgspec.msgpack.decode(encoded, type=type(example))
    assert decoded == example
    assert type(decoded) is type(example)


@pytest.mark.parametrize("union_name", sorted(WIRE_UNIONS))
def test_wire_unions_tell_their_members_apart(union_name):
    union, members = WIRE_UNIONS[union_name]
    decoder = msgspec.msgpack.Decoder(union)
    for example in EXAMPLES:
        if type(example) in members:
            decoded = decoder.decode(msgspec.msgpack.encode(example))
            assert type(decoded) is type(example)
            assert decoded == example


def test_finish_reason_survives_as_the_enum():
    decoded = msgspec.msgpack.decode(msgspec.msgpack.encode(OUTPUT), type=EngineCoreOutput)
    assert decoded.finish_reason is FinishReason.STOP
    assert decoded.finished
    assert str(decoded.finish_reason) == "stop"


def test_a_message_of_the_wrong_union_is_rejected():
    with pytest.raises(msgspec.ValidationError):
        msgspec.msgpack.Decoder(EngineCoreInput).decode(
            msgspec.msgpack.encode(OutputsBatch(OUTPUTS))
        )
