"""EngineCoreProcClient: the front-end's side of the engine-core process.

It owns a private 0700 directory for the ipc:// sockets, binds them (input: ROUTER, output:
PULL), starts the core with the spawn method, and waits for its handshake. One output thread
receives and decodes the core's messages and watches the process: when the core dies, the
client's owner hears about it at once through `on_dead`, never through a hang.
"""

from __future__ import annotations

import atexit
import concurrent.futures
import contextlib
import itertools
import logging
import multiprocessing
import os
import shutil
import sys
import tempfile
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import msgspec
import zmq

from v1_engine.config import EngineConfig
from v1_engine.engine.core_proc import (
    CORE_IDENTITY,
    DEFAULT_CORE_FACTORY,
    encode_config,
    run_engine_core,
)
from v1_engine.engine.exceptions import EngineDeadError, EngineStartupError
from v1_engine.protocol import (
    AbortRequests,
    AddRequest,
    EngineCoreFailed,
    EngineCoreHandshake,
    EngineCoreOutputMessage,
    EngineCoreOutputs,
    EngineCoreReady,
    EngineCoreRequest,
    EngineCoreStartupFailed,
    OutputsBatch,
    ShutdownRequest,
    UtilityCall,
    UtilityResult,
)

logger = logging.getLogger(__name__)

DEFAULT_STARTUP_TIMEOUT_S = 600.0
"""Model conversion happens in the front-end, so this only bounds loading and KV sizing."""
SHUTDOWN_TIMEOUT_S = 5.0
"""How long a clean shutdown may take before the core is terminated, then killed."""


class EngineCoreProcClient:
    """Starts the engine-core process and exchanges typed messages with it.

    `on_outputs` and `on_dead` are called from the client's output thread: every batch of the
    core's outputs, in order, and then at most once the reason the core is gone (not called
    after `shutdown()`).
    """

    def __init__(
        self,
        config: EngineConfig,
        on_outputs: Callable[[EngineCoreOutputs], None],
        on_dead: Callable[[str], None],
        startup_timeout_s: float = DEFAULT_STARTUP_TIMEOUT_S,
        core_factory: str = DEFAULT_CORE_FACTORY,
    ) -> None:
        self._on_outputs = on_outputs
        self._on_dead = on_dead
        self._encoder = msgspec.msgpack.Encoder()
        self._send_lock = threading.Lock()
        self._call_ids = itertools.count()
        self._pending_calls: dict[int, concurrent.futures.Future[Any]] = {}
        self._dead_reason: str | None = None
        self._closed = False
        self.ipc_dir = tempfile.mkdtemp(prefix="v1engine-")  # mode 0700: only we can connect
        self._context = zmq.Context()
        self._input_socket = self._bind(zmq.ROUTER, "input.sock")
        self._input_socket.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self._output_socket = self._bind(zmq.PULL, "output.sock")
        self._wake_r, self._wake_w = os.pipe()
        self.process = multiprocessing.get_context("spawn").Process(
            target=run_engine_core,
            name="EngineCore",
            kwargs={
                "config_bytes": encode_config(config),
                "input_address": self._address("input.sock"),
                "output_address": self._address("output.sock"),
                "ipc_dir": self.ipc_dir,
                "parent_pid": os.getpid(),
                "core_factory": core_factory,
                "log_level": logging.getLogger("v1_engine").getEffectiveLevel(),
            },
        )
        self._atexit = _make_atexit_hook(weakref.ref(self))
        try:
            with _main_module_hidden():
                self.process.start()
            # After start(): multiprocessing's own exit hook, which joins children forever, is
            # registered by then, and hooks run last-registered first, so ours stops the core.
            atexit.register(self._atexit)
            self.ready: EngineCoreReady = self._wait_for_handshake(startup_timeout_s)
        except BaseException:
            self.shutdown(timeout_s=0.0)  # a core that is still starting is not listening
            raise
        self._output_thread = threading.Thread(
            target=self._output_loop, name="core-client-output", daemon=True
        )
        self._output_thread.start()

    # -- requests ------------------------------------------------------------------------------

    @property
    def is_alive(self) -> bool:
        return self._dead_reason is None and not self._closed

    def add_requests(self, requests: list[EngineCoreRequest]) -> None:
        for request in requests:
            self._send(AddRequest(request))

    def abort_requests(self, request_ids: list[str]) -> None:
        if request_ids:
            self._send(AbortRequests(list(request_ids)))

    def call_utility(self, method: str, *args: Any) -> concurrent.futures.Future[Any]:
        """Ask the core for a fact (see core_proc.UTILITY_METHODS); resolves with the result."""
        future: concurrent.futures.Future[Any] = concurrent.futures.Future()
        call_id = next(self._call_ids)
        self._pending_calls[call_id] = future
        try:
            self._send(UtilityCall(call_id=call_id, method=method, args=list(args)))
        except EngineDeadError:
            self._pending_calls.pop(call_id, None)
            raise
        return future

    def _send(self, message: Any) -> None:
        payload = self._encoder.encode(message)
        with self._send_lock:
            self._raise_if_dead()
            try:
                self._input_socket.send_multipart([CORE_IDENTITY, payload], copy=False)
            except zmq.ZMQError as e:
                raise EngineDeadError(f"engine core is unreachable: {e}") from e

    def _raise_if_dead(self) -> None:
        if self._closed:
            raise EngineDeadError("the engine has been shut down")
        if self._dead_reason is not None:
            raise EngineDeadError(self._dead_reason)

    # -- startup -------------------------------------------------------------------------------

    def _address(self, name: str) -> str:
        return f"ipc://{os.path.join(self.ipc_dir, name)}"

    def _bind(self, socket_type: int, name: str) -> zmq.Socket:
        sock = self._context.socket(socket_type)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, 0)
        sock.setsockopt(zmq.RCVHWM, 0)
        sock.bind(self._address(name))
        return sock

    def _wait_for_handshake(self, timeout_s: float) -> EngineCoreReady:
        """The core's first message, or a clear error if it fails, dies or stays silent."""
        decoder = msgspec.msgpack.Decoder(EngineCoreHandshake)
        deadline = time.monotonic() + timeout_s
        while not self._input_socket.poll(100, zmq.POLLIN):
            # A core that exits may still have its report in flight: one last look for it.
            if not self.process.is_alive() and not self._input_socket.poll(200, zmq.POLLIN):
                raise EngineStartupError(
                    f"engine core process exited with code {self.process.exitcode} while "
                    "starting; see its log above"
                )
            if time.monotonic() > deadline:
                raise EngineStartupError(f"engine core did not start within {timeout_s:.0f} s")
        identity, payload = self._input_socket.recv_multipart()
        assert identity == CORE_IDENTITY, identity
        message = decoder.decode(payload)
        if isinstance(message, EngineCoreStartupFailed):
            raise EngineStartupError(f"engine core failed to start: {message.error}")
        return message

    # -- output thread -------------------------------------------------------------------------

    def _output_loop(self) -> None:
        decoder = msgspec.msgpack.Decoder(EngineCoreOutputMessage)
        poller = zmq.Poller()
        poller.register(self._output_socket, zmq.POLLIN)
        poller.register(self.process.sentinel, zmq.POLLIN)
        poller.register(self._wake_r, zmq.POLLIN)
        while True:
            events = dict(poller.poll())
            if self._wake_r in events:
                return
            # Read what the core sent before it died: its last outputs or its error.
            if not self._drain(decoder):
                return
            if self.process.sentinel in events:
                # The core's last messages may still be on their way through the socket.
                while self._output_socket.poll(100, zmq.POLLIN):
                    if not self._drain(decoder):
                        return
                self._mark_dead(
                    f"engine core process died unexpectedly (exit code {self._exitcode()})"
                )
                return

    def _drain(self, decoder: msgspec.msgpack.Decoder) -> bool:
        """Dispatch every queued message; False once the core has reported its own failure."""
        while True:
            try:
                frame = self._output_socket.recv(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return True
            message = decoder.decode(frame.buffer)
            if isinstance(message, OutputsBatch):
                if not self._dispatch_outputs(message.outputs):
                    return False
            elif isinstance(message, UtilityResult):
                self._resolve_call(message)
            elif isinstance(message, EngineCoreFailed):
                self._mark_dead(f"engine core failed: {message.error}\n{message.traceback}")
                return False

    def _dispatch_outputs(self, outputs: EngineCoreOutputs) -> bool:
        try:
            self._on_outputs(outputs)
        except Exception as e:  # requests would hang if this went unnoticed
            logger.exception("processing the engine core's outputs failed")
            self._mark_dead(f"processing the engine core's outputs failed: {e!r}")
            self.process.kill()
            return False
        return True

    def _resolve_call(self, result: UtilityResult) -> None:
        future = self._pending_calls.pop(result.call_id, None)
        if future is None:
            return
        if result.error is not None:
            future.set_exception(RuntimeError(result.error))
        else:
            future.set_result(result.result)

    def _exitcode(self) -> int | None:
        self.process.join(timeout=1.0)
        return self.process.exitcode

    def _mark_dead(self, reason: str) -> None:
        with self._send_lock:
            if self._dead_reason is not None or self._closed:
                return
            self._dead_reason = reason
        logger.error("%s", reason)
        self._fail_pending_calls(EngineDeadError(reason))
        self._on_dead(reason)

    def _fail_pending_calls(self, error: Exception) -> None:
        calls, self._pending_calls = self._pending_calls, {}
        for future in calls.values():
            if not future.done():
                future.set_exception(error)

    # -- shutdown ------------------------------------------------------------------------------

    def shutdown(self, timeout_s: float = SHUTDOWN_TIMEOUT_S) -> None:
        """Stop the core (asking first, then terminate, then kill) and remove the sockets."""
        with self._send_lock:
            if self._closed:
                return
            closing_live_core = self._dead_reason is None and self.process.is_alive()
            self._closed = True
            if closing_live_core:
                try:
                    payload = self._encoder.encode(ShutdownRequest())
                    self._input_socket.send_multipart([CORE_IDENTITY, payload])
                except zmq.ZMQError:
                    pass
        atexit.unregister(self._atexit)
        self._stop_process(timeout_s)
        os.write(self._wake_w, b"x")
        output_thread = getattr(self, "_output_thread", None)
        if output_thread is not None and output_thread is not threading.current_thread():
            output_thread.join()
        self._input_socket.close(linger=0)
        self._output_socket.close(linger=0)
        self._context.term()
        os.close(self._wake_r)
        os.close(self._wake_w)
        shutil.rmtree(self.ipc_dir, ignore_errors=True)
        self._fail_pending_calls(EngineDeadError("the engine has been shut down"))

    def _stop_process(self, timeout_s: float) -> None:
        if self.process.pid is None:
            return  # never started
        self.process.join(timeout_s)
        if self.process.is_alive():
            logger.warning("engine core did not exit in %.0f s; terminating it", timeout_s)
            self.process.terminate()
            self.process.join(2.0)
        if self.process.is_alive():
            self.process.kill()
            self.process.join()


def _make_atexit_hook(client_ref: weakref.ref[EngineCoreProcClient]) -> Callable[[], None]:
    """Shut the core down at interpreter exit if the owner forgot to (no orphan, no socket)."""

    def hook() -> None:
        client = client_ref()
        if client is not None:
            client.shutdown()

    return hook


@contextlib.contextmanager
def _main_module_hidden() -> Iterator[None]:
    """Start the core without re-running the user's script in it.

    A spawned child normally re-imports the parent's `__main__` (by path or module name), which
    runs a script's top level again (a second engine, a fork bomb without an
    `if __name__ == "__main__":` guard). The core needs nothing from `__main__`: its target and
    config come from this package, so the child is told there is no main module to import.
    """
    main = sys.modules.get("__main__")
    saved = {name: getattr(main, name) for name in ("__file__", "__spec__") if hasattr(main, name)}
    try:
        for name in saved:
            if name == "__spec__":
                main.__spec__ = None
            else:
                delattr(main, name)
        yield
    finally:
        for name, value in saved.items():
            setattr(main, name, value)
