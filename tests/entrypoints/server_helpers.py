"""Start, probe and stop real `v1serve` subprocesses; read their Prometheus metrics.

A server runs on a free port with an API key; its log goes to a temp file that is printed if
it fails to come up.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

API_KEY = "test-key-123"
STARTUP_TIMEOUT_S = 240.0


@dataclass
class Server:
    process: subprocess.Popen
    port: int
    log_path: Path
    api_key: str | None
    scheme: str = "http"
    """"https" for a server started with --ssl-certfile (probed without verifying its cert)."""

    @property
    def url(self) -> str:
        return f"{self.scheme}://127.0.0.1:{self.port}"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def get(self, path: str, **kwargs) -> httpx.Response:
        return httpx.get(f"{self.url}{path}", verify=self.scheme == "http", **kwargs)

    def metrics(self) -> dict[str, float]:
        return parse_metrics(self.get("/metrics", timeout=10).text)


def parse_metrics(text: str) -> dict[str, float]:
    """`name{labels}` -> value, for every sample line of a Prometheus exposition."""
    samples = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.rpartition(" ")
            samples[key] = float(value)
    return samples


def metric(samples: dict[str, float], name: str, **labels: str) -> float:
    """Sum of the samples of `name` whose labels include `labels`."""
    total = 0.0
    for key, value in samples.items():
        base, _, rest = key.partition("{")
        if base == name and all(f'{k}="{v}"' in rest for k, v in labels.items()):
            total += value
    return total


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def v1serve_command() -> list[str]:
    script = Path(sys.executable).parent / "v1serve"
    if script.exists():
        return [str(script)]
    found = shutil.which("v1serve")
    if found:
        return [found]
    return [sys.executable, "-c", "from v1_engine.entrypoints.cli import main; main()"]


def start_server(*extra_args: str, api_key: str | None = API_KEY) -> Server:
    port = free_port()
    log = Path(tempfile.mkstemp(prefix="v1serve-", suffix=".log")[1])
    args = [*v1serve_command(), "--port", str(port), "--max-model-len", "2048", *extra_args]
    if api_key:
        args += ["--api-key", api_key]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop("V1ENGINE_API_KEY", None)
    with log.open("wb") as log_file:
        process = subprocess.Popen(
            args, stdout=log_file, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
    scheme = "https" if "--ssl-certfile" in extra_args else "http"
    server = Server(process, port, log, api_key, scheme)
    wait_healthy(server)
    return server


@contextlib.contextmanager
def running_server(*extra_args: str) -> Iterator[Server]:
    """A server for the block: stopped and its log removed afterwards."""
    server = start_server(*extra_args)
    try:
        yield server
    finally:
        stop_server(server)
        server.log_path.unlink(missing_ok=True)


def wait_healthy(server: Server) -> None:
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        if server.process.poll() is not None:
            pytest.fail(f"v1serve exited with {server.process.returncode}:\n{server.log()}")
        try:
            if server.get("/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    stop_server(server)
    pytest.fail(f"v1serve did not become healthy in {STARTUP_TIMEOUT_S}s:\n{server.log()}")


def stop_server(server: Server) -> None:
    if server.process.poll() is None:
        server.process.send_signal(signal.SIGINT)
        try:
            server.process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(server.process.pid, signal.SIGKILL)
            server.process.wait(timeout=10)
