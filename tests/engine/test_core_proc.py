"""The engine-core process and its client, with a fake core so each test starts in ~1 s.

The fake core speaks the real EngineCore interface (add / abort / step / has_unfinished) and
produces deterministic tokens, so these tests pin down the process layer alone: handshake,
startup failures, the busy loop, aborts, utility calls, crashes, signals and cleanup.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from types import SimpleNamespace

import pytest

from v1_engine.config import EngineConfig
from v1_engine.engine.core_client import EngineCoreProcClient
from v1_engine.engine.core_proc import decode_config, encode_config
from v1_engine.engine.exceptions import EngineDeadError, EngineStartupError
from v1_engine.protocol import (
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    FinishReason,
    SchedulerStats,
)
from v1_engine.sampling_params import SamplingParams

FAKE_CORE = f"{__name__}:FakeEngineCore"
NUM_BLOCKS = 32


class FakeEngineCore:
    """Emits token `last + 1` per step; one KV block per request while it runs.

    `model="fail-startup"` raises in the constructor and `model="fail-step"` raises in step(),
    to exercise the failure paths.
    """

    def __init__(self, config: EngineConfig) -> None:
        if config.model_config.model == "fail-startup":
            raise ValueError("fake model cannot be loaded")
        self.fail_step = config.model_config.model == "fail-step"
        self.num_kv_blocks = NUM_BLOCKS
        self.requests: dict[str, tuple[EngineCoreRequest, list[int]]] = {}
        self.aborted: list[str] = []
        self.scheduler = SimpleNamespace(kv_cache_manager=SimpleNamespace(num_free_blocks=0))
        self._update_free_blocks()

    def _update_free_blocks(self) -> None:
        self.scheduler.kv_cache_manager.num_free_blocks = NUM_BLOCKS - len(self.requests)

    def add_request(self, request: EngineCoreRequest) -> None:
        self.requests[request.request_id] = (request, [])
        self._update_free_blocks()

    def abort_requests(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            if self.requests.pop(request_id, None) is not None:
                self.aborted.append(request_id)
        self._update_free_blocks()

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def step(self) -> EngineCoreOutputs:
        if self.fail_step and self.requests:
            raise RuntimeError("fake step exploded")
        outputs = [
            EngineCoreOutput(request_id=r, new_token_ids=[], finish_reason=FinishReason.ABORT)
            for r in self.aborted
        ]
        self.aborted = []
        for request_id, (request, tokens) in list(self.requests.items()):
            tokens.append((request.prompt_token_ids + tokens)[-1] + 1)
            done = len(tokens) == request.sampling_params.max_tokens
            outputs.append(
                EngineCoreOutput(
                    request_id=request_id,
                    new_token_ids=tokens[-1:],
                    finish_reason=FinishReason.LENGTH if done else None,
                )
            )
            if done:
                del self.requests[request_id]
        self._update_free_blocks()
        time.sleep(0.002)  # a step takes time, so aborts can land mid-request
        stats = SchedulerStats(num_running_reqs=len(self.requests))
        return EngineCoreOutputs(outputs=outputs, scheduler_stats=stats, timestamp=time.monotonic())


class Collector:
    """Records what the client's output thread delivers."""

    def __init__(self) -> None:
        self.outputs: dict[str, list[EngineCoreOutput]] = {}
        self.batches = 0
        self.dead: list[str] = []
        self.dead_event = threading.Event()
        self.finished = threading.Condition()

    def on_outputs(self, outputs: EngineCoreOutputs) -> None:
        with self.finished:
            self.batches += 1
            for out in outputs.outputs:
                self.outputs.setdefault(out.request_id, []).append(out)
            self.finished.notify_all()

    def on_dead(self, reason: str) -> None:
        self.dead.append(reason)
        self.dead_event.set()

    def wait_finished(self, request_ids: list[str], timeout: float = 10.0) -> None:
        def done() -> bool:
            return all(self.outputs.get(r) and self.outputs[r][-1].finished for r in request_ids)

        with self.finished:
            assert self.finished.wait_for(done, timeout), "requests did not finish"


def make_client(model: str = "fake", **kwargs) -> tuple[EngineCoreProcClient, Collector]:
    collector = Collector()
    # As the front-end sends it: resolved (prepare_engine_config), so with a block size.
    config = EngineConfig.from_kwargs(model=model, max_model_len=128, block_size=16)
    client = EngineCoreProcClient(
        config, collector.on_outputs, collector.on_dead, core_factory=FAKE_CORE, **kwargs
    )
    return client, collector


def make_request(request_id: str, first_token: int, max_tokens: int) -> EngineCoreRequest:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    return EngineCoreRequest(
        request_id=request_id, prompt_token_ids=[first_token], sampling_params=params
    )


def assert_cleaned_up(client: EngineCoreProcClient) -> None:
    assert not client.process.is_alive()
    assert not os.path.exists(client.ipc_dir), os.listdir(client.ipc_dir)


@pytest.fixture
def client_and_collector():
    client, collector = make_client()
    yield client, collector
    client.shutdown()
    assert_cleaned_up(client)


def test_handshake_reports_core_facts_and_private_dir(client_and_collector):
    client, _ = client_and_collector
    assert client.ready.num_kv_blocks == NUM_BLOCKS
    assert client.ready.max_model_len == 128
    assert client.ready.block_size == 16
    assert client.ready.pid == client.process.pid
    assert os.stat(client.ipc_dir).st_mode & 0o777 == 0o700
    assert sorted(os.listdir(client.ipc_dir)) == ["input.sock", "output.sock"]


def test_requests_stream_every_token_in_order(client_and_collector):
    client, collector = client_and_collector
    requests = [make_request(f"r{i}", first_token=100 * i, max_tokens=5 + i) for i in range(8)]
    client.add_requests(requests)
    collector.wait_finished([r.request_id for r in requests])
    for i in range(8):
        outs = collector.outputs[f"r{i}"]
        tokens = [t for out in outs for t in out.new_token_ids]
        assert tokens == list(range(100 * i + 1, 100 * i + 6 + i))
        assert [o.finish_reason for o in outs] == [None] * (4 + i) + [FinishReason.LENGTH]
    assert client.call_utility("get_num_free_blocks").result(5) == NUM_BLOCKS


def test_abort_mid_stream_sends_last_output_and_frees_blocks(client_and_collector):
    client, collector = client_and_collector
    client.add_requests([make_request("long", 0, 10_000), make_request("short", 50, 3)])
    deadline = time.monotonic() + 5
    while len(collector.outputs.get("long", [])) < 5 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert client.call_utility("get_num_free_blocks").result(5) == NUM_BLOCKS - 1
    client.abort_requests(["long"])
    collector.wait_finished(["long", "short"])
    assert collector.outputs["long"][-1].finish_reason == FinishReason.ABORT
    assert client.call_utility("get_num_free_blocks").result(5) == NUM_BLOCKS
    assert client.call_utility("has_unfinished_requests").result(5) is False


def test_unknown_utility_method_fails_that_call_only(client_and_collector):
    client, _ = client_and_collector
    with pytest.raises(RuntimeError, match="utility method must be one of"):
        client.call_utility("os.system", "true").result(5)
    assert client.call_utility("get_num_kv_blocks").result(5) == NUM_BLOCKS


@pytest.fixture
def created_dirs(monkeypatch) -> list[str]:
    """The socket directories clients make during the test."""
    import tempfile

    created = []

    def mkdtemp(*args, **kwargs):
        created.append(tempfile.mkdtemp(*args, **kwargs))
        return created[-1]

    monkeypatch.setattr("v1_engine.engine.core_client.tempfile", SimpleNamespace(mkdtemp=mkdtemp))
    return created


def test_startup_failure_raises_clearly_and_cleans_up(created_dirs):
    start = time.monotonic()
    with pytest.raises(EngineStartupError, match="ValueError: fake model cannot be loaded"):
        make_client(model="fail-startup")
    assert time.monotonic() - start < 30
    assert len(created_dirs) == 1 and not os.path.exists(created_dirs[0])


def test_startup_timeout_raises_instead_of_hanging(created_dirs):
    with pytest.raises(EngineStartupError, match="did not start within"):
        make_client(startup_timeout_s=0.01)
    assert len(created_dirs) == 1 and not os.path.exists(created_dirs[0])


def test_step_failure_marks_client_dead_with_the_cause():
    client, collector = make_client(model="fail-step")
    try:
        client.add_requests([make_request("r", 0, 4)])
        assert collector.dead_event.wait(10)
        assert "RuntimeError: fake step exploded" in collector.dead[0]
        assert not client.is_alive
        with pytest.raises(EngineDeadError):
            client.add_requests([make_request("again", 0, 4)])
    finally:
        client.shutdown()
    assert_cleaned_up(client)


def test_kill_9_is_detected_within_a_second():
    client, collector = make_client()
    try:
        client.add_requests([make_request("pending", 0, 10_000)])
        pending = client.call_utility("get_num_free_blocks")
        pending.result(5)
        os.kill(client.process.pid, signal.SIGKILL)
        start = time.monotonic()
        assert collector.dead_event.wait(5)
        assert time.monotonic() - start < 1.0
        assert "died unexpectedly" in collector.dead[0]
        assert "-9" in collector.dead[0]
        with pytest.raises(EngineDeadError):
            client.call_utility("get_num_free_blocks")
    finally:
        client.shutdown()
    assert_cleaned_up(client)


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_signal_stops_the_core_cleanly(signum):
    client, collector = make_client()
    try:
        client.add_requests([make_request("pending", 0, 10_000)])
        os.kill(client.process.pid, signum)
        client.process.join(5)
        assert client.process.exitcode == 0
        assert collector.dead_event.wait(5)
    finally:
        client.shutdown()
    assert_cleaned_up(client)


def test_shutdown_is_idempotent_and_rejects_new_work():
    client, collector = make_client()
    client.add_requests([make_request("pending", 0, 10_000)])
    client.shutdown()
    client.shutdown()
    assert_cleaned_up(client)
    assert client.process.exitcode == 0
    assert collector.dead == []
    with pytest.raises(EngineDeadError, match="shut down"):
        client.add_requests([make_request("late", 0, 4)])


@pytest.mark.parametrize("ending", ["kill -9", "exit without shutdown"])
def test_front_end_ending_leaves_no_core_and_no_sockets(tmp_path, ending):
    """Killed with -9, the front-end leaves the core to exit and remove the socket directory;
    exiting normally without shutdown(), its exit hook does the same."""
    import subprocess
    import sys

    script = tmp_path / "front_end.py"
    script.write_text(
        "import sys, time\n"
        f"sys.path.insert(0, {os.path.dirname(__file__)!r})\n"
        "from test_core_proc import make_client\n"
        "if __name__ == '__main__':\n"
        "    client, _ = make_client()\n"
        "    print(client.process.pid, client.ipc_dir, flush=True)\n"
        "    sys.stdin.readline()\n"
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    front_end = subprocess.Popen(
        [sys.executable, str(script)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        core_pid, ipc_dir = front_end.stdout.readline().split()
        assert os.path.isdir(ipc_dir)
        if ending == "kill -9":
            front_end.kill()
        else:
            front_end.stdin.write("exit\n")
            front_end.stdin.flush()
        front_end.wait(10)
        deadline = time.monotonic() + 5
        while (_pid_alive(int(core_pid)) or os.path.exists(ipc_dir)) and (
            time.monotonic() < deadline
        ):
            time.sleep(0.05)
        assert not _pid_alive(int(core_pid))
        assert not os.path.exists(ipc_dir)
    finally:
        front_end.kill()


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie (exited, not yet reaped by init) counts as gone.
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split(")")[-1].split()[0] != "Z"


def test_config_travels_to_the_core_as_msgpack_unchanged():
    config = EngineConfig.from_kwargs(
        model="/models/x", max_model_len=256, block_size=32, num_kv_blocks=77, max_num_seqs=5
    )
    config.scheduler_config.async_scheduling = False
    decoded = decode_config(encode_config(config))
    assert decoded == config
    assert decoded.compute_hash() == config.compute_hash()
