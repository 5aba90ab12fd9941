"""The engine-core process: an EngineCore driven by a busy loop behind two ZeroMQ sockets.

Three threads, so serialization never blocks a step:
- the input thread receives and decodes messages into a queue (and watches the parent process);
- the main thread drains that queue (add / abort / utility), steps while requests are
  unfinished, and blocks on the queue when idle;
- the output thread encodes and sends every EngineCoreOutputs the main thread produces.

The front-end (core_client.py) binds both sockets and starts this module's `run_engine_core`
with the spawn method. Everything on the wire is a typed Struct of protocol.py; nothing is pickled.
"""

from __future__ import annotations

import importlib
import logging
import os
import queue
import shutil
import signal
import threading
import traceback
from collections.abc import Callable
from typing import Any

import msgspec
import zmq

from v1_engine.config import LOG_FORMAT, EngineConfig
from v1_engine.protocol import (
    AbortRequests,
    AddRequest,
    EngineCoreFailed,
    EngineCoreInput,
    EngineCoreOutputMessage,
    EngineCoreReady,
    EngineCoreStartupFailed,
    OutputsBatch,
    ShutdownRequest,
    UtilityCall,
    UtilityResult,
)

logger = logging.getLogger(__name__)

DEFAULT_CORE_FACTORY = "v1_engine.engine.core:EngineCore"
CORE_IDENTITY = b"engine-core-0"
"""The DEALER's identity, which the front-end's ROUTER uses to address the core."""
PARENT_POLL_INTERVAL_S = 0.2
"""How often the input thread checks that the front-end process is still alive."""
OUTPUT_LINGER_MS = 2000
"""How long closing the output socket may wait for unsent outputs (a live front-end reads fast)."""

UTILITY_METHODS: dict[str, Callable[..., Any]] = {
    "get_num_free_blocks": lambda core: core.scheduler.kv_cache_manager.num_free_blocks,
    "get_num_kv_blocks": lambda core: core.num_kv_blocks,
    "has_unfinished_requests": lambda core: core.has_unfinished_requests(),
    "get_num_unfinished_requests": lambda core: core.scheduler.get_num_unfinished_requests(),
    "reset_prefix_cache": lambda core: core.scheduler.reset_prefix_cache(),
}
"""The facts a front-end may ask the core for, by name: a fixed set, never arbitrary calls."""


class _ShutdownSignal(BaseException):
    """Raised in the main thread by SIGINT / SIGTERM, so the busy loop unwinds and cleans up."""


def encode_config(config: EngineConfig) -> bytes:
    """The resolved config as msgpack (dataclasses encode natively), for the spawned process."""
    return msgspec.msgpack.encode(config)


def decode_config(data: bytes) -> EngineConfig:
    return msgspec.msgpack.decode(data, type=EngineConfig)


def run_engine_core(
    config_bytes: bytes,
    input_address: str,
    output_address: str,
    ipc_dir: str,
    parent_pid: int,
    core_factory: str = DEFAULT_CORE_FACTORY,
    log_level: int = logging.INFO,
) -> None:
    """Entry point of the spawned process: connect, build the core, handshake, serve, exit.

    A startup failure is reported over the handshake and the process exits with code 1; a
    failure of the busy loop is reported as EngineCoreFailed and also exits with code 1.
    """
    logging.basicConfig(level=log_level, format=LOG_FORMAT.replace("%(name)s", "%(name)s [core]"))
    _install_signal_handlers()
    context = zmq.Context()
    input_socket = context.socket(zmq.DEALER)
    input_socket.setsockopt(zmq.IDENTITY, CORE_IDENTITY)
    input_socket.setsockopt(zmq.LINGER, OUTPUT_LINGER_MS)
    input_socket.connect(input_address)
    output_socket = context.socket(zmq.PUSH)
    output_socket.setsockopt(zmq.LINGER, OUTPUT_LINGER_MS)
    output_socket.connect(output_address)
    exit_code = 0
    try:
        proc = _start(config_bytes, core_factory, input_socket, output_socket, parent_pid, ipc_dir)
        if proc is None:
            exit_code = 1
        else:
            exit_code = proc.run()
    except _ShutdownSignal:
        logger.info("engine core interrupted during startup; exiting")
    finally:
        input_socket.close()
        output_socket.close()
        context.term()
    if exit_code:
        raise SystemExit(exit_code)


def _start(
    config_bytes: bytes,
    core_factory: str,
    input_socket: zmq.Socket,
    output_socket: zmq.Socket,
    parent_pid: int,
    ipc_dir: str,
) -> EngineCoreProc | None:
    """Build the core and send the handshake; None (after reporting why) if it failed."""
    encoder = msgspec.msgpack.Encoder()
    try:
        config = decode_config(config_bytes)
        core = _import_factory(core_factory)(config)
    except _ShutdownSignal:
        raise
    except BaseException as e:  # any startup failure must reach the front-end
        logger.exception("engine core failed to start")
        failed = EngineCoreStartupFailed(
            error=f"{type(e).__name__}: {e}", traceback=traceback.format_exc()
        )
        input_socket.send(encoder.encode(failed))
        return None
    ready = EngineCoreReady(
        num_kv_blocks=int(core.num_kv_blocks),
        max_model_len=int(config.model_config.max_model_len),
        block_size=int(config.cache_config.block_size),
        pid=os.getpid(),
    )
    input_socket.send(encoder.encode(ready))
    return EngineCoreProc(core, input_socket, output_socket, parent_pid, ipc_dir)


def _import_factory(spec: str) -> Callable[[EngineConfig], Any]:
    module_name, _, attr = spec.partition(":")
    return getattr(importlib.import_module(module_name), attr)


def _install_signal_handlers() -> None:
    def handler(signum: int, frame: Any) -> None:
        # Only the first signal unwinds; a second one must not interrupt the cleanup.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        raise _ShutdownSignal(signal.Signals(signum).name)

    signal.signal(signal.SIGINT, handler)
    signal.signal(signal.SIGTERM, handler)


class EngineCoreProc:
    """Runs one EngineCore behind the sockets until shutdown, a signal, or the parent's death."""

    def __init__(
        self,
        core: Any,
        input_socket: zmq.Socket,
        output_socket: zmq.Socket,
        parent_pid: int,
        ipc_dir: str,
    ) -> None:
        self.core = core
        self.input_socket = input_socket
        self.output_socket = output_socket
        self.parent_pid = parent_pid
        self.ipc_dir = ipc_dir
        self.input_queue: queue.Queue[Any] = queue.Queue()
        self.output_queue: queue.Queue[Any] = queue.Queue()
        self._stop_input = threading.Event()
        self._parent_died = False
        self._input_thread = threading.Thread(
            target=self._input_loop, name="core-input", daemon=True
        )
        self._output_thread = threading.Thread(
            target=self._output_loop, name="core-output", daemon=True
        )

    def run(self) -> int:
        """Serve until told to stop; returns the process exit code."""
        self._input_thread.start()
        self._output_thread.start()
        exit_code = 0
        try:
            self._busy_loop()
        except _ShutdownSignal as e:
            logger.info("engine core received %s; shutting down", e)
        except Exception as e:
            logger.exception("engine core busy loop failed")
            failed = EngineCoreFailed(
                error=f"{type(e).__name__}: {e}", traceback=traceback.format_exc()
            )
            self.output_queue.put(failed)
            exit_code = 1
        finally:
            self._stop_threads()
        if self._parent_died:
            # Nobody else is left to remove the front-end's socket directory.
            shutil.rmtree(self.ipc_dir, ignore_errors=True)
        return exit_code

    def _busy_loop(self) -> None:
        while True:
            idle = not self.core.has_unfinished_requests()
            if not self._handle_inputs(block=idle):
                return
            if self.core.has_unfinished_requests():
                self.output_queue.put(OutputsBatch(self.core.step()))

    def _handle_inputs(self, block: bool) -> bool:
        """Apply every queued message (waiting for one if `block`); False means shut down."""
        try:
            message = self.input_queue.get(block=block)
        except queue.Empty:
            return True
        while True:
            if isinstance(message, ShutdownRequest):
                return False
            self._handle(message)
            try:
                message = self.input_queue.get_nowait()
            except queue.Empty:
                return True

    def _handle(self, message: Any) -> None:
        if isinstance(message, AddRequest):
            self.core.add_request(message.request)
        elif isinstance(message, AbortRequests):
            self.core.abort_requests(message.request_ids)
            if not self.core.has_unfinished_requests():
                # Idle now: still publish the outputs and stats the abort produced.
                self.output_queue.put(OutputsBatch(self.core.step()))
        elif isinstance(message, UtilityCall):
            self.output_queue.put(self._call_utility(message))
        else:
            raise TypeError(f"unexpected input message {type(message).__name__}")

    def _call_utility(self, call: UtilityCall) -> UtilityResult:
        method = UTILITY_METHODS.get(call.method)
        if method is None:
            allowed = ", ".join(sorted(UTILITY_METHODS))
            error = f"ValueError: utility method must be one of {allowed}, got {call.method!r}"
            return UtilityResult(call_id=call.call_id, error=error)
        try:
            return UtilityResult(call_id=call.call_id, result=method(self.core, *call.args))
        except Exception as e:  # noqa: BLE001 - a failed query must not kill the core
            return UtilityResult(call_id=call.call_id, error=f"{type(e).__name__}: {e}")

    def _input_loop(self) -> None:
        decoder = msgspec.msgpack.Decoder(EngineCoreInput)
        poller = zmq.Poller()
        poller.register(self.input_socket, zmq.POLLIN)
        timeout_ms = int(PARENT_POLL_INTERVAL_S * 1000)
        while not self._stop_input.is_set():
            if os.getppid() != self.parent_pid:
                logger.warning("front-end process %d is gone; shutting down", self.parent_pid)
                self._parent_died = True
                self.input_queue.put(ShutdownRequest())
                return
            if not poller.poll(timeout_ms):
                continue
            frame = self.input_socket.recv(copy=False)
            try:
                message = decoder.decode(frame.buffer)
            except msgspec.DecodeError:
                logger.exception("dropping an undecodable input message")
                continue
            self.input_queue.put(message)
            if isinstance(message, ShutdownRequest):
                return

    def _output_loop(self) -> None:
        encoder = msgspec.msgpack.Encoder()
        while True:
            message: EngineCoreOutputMessage | None = self.output_queue.get()
            if message is None:
                return
            self.output_socket.send(encoder.encode(message), copy=False)

    def _stop_threads(self) -> None:
        self._stop_input.set()
        self.output_queue.put(None)
        self._output_thread.join()
        self._input_thread.join(timeout=2 * PARENT_POLL_INTERVAL_S + 1.0)
