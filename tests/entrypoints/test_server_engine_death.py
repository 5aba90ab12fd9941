"""If the engine-core process dies, requests fail fast, /health turns 503 and v1serve exits 1."""

from __future__ import annotations

import signal
import threading
import time

import httpx
import psutil
from server_helpers import start_server, stop_server


def core_processes(pid: int) -> list[psutil.Process]:
    """The engine-core child (spawned by multiprocessing), not its resource tracker."""
    children = psutil.Process(pid).children(recursive=True)
    return [p for p in children if "resource_tracker" not in " ".join(p.cmdline())]


def test_engine_core_death_fails_requests_and_exits_nonzero():
    server = start_server(api_key=None)
    try:
        cores = core_processes(server.process.pid)
        assert len(cores) == 1, [p.cmdline() for p in cores]
        body = {
            "prompt": "Tell me a long story.",
            "max_tokens": 1500,
            "ignore_eos": True,
            "stream": True,
        }
        events: list[str] = []
        streamed = threading.Event()

        def stream_until_end() -> None:
            with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as r:
                for line in r.iter_lines():
                    if line:
                        events.append(line)
                        streamed.set()

        reader = threading.Thread(target=stream_until_end)
        reader.start()
        assert streamed.wait(60), server.log()
        killed_at = time.monotonic()
        cores[0].send_signal(signal.SIGKILL)

        reader.join(timeout=15)
        assert not reader.is_alive(), "the in-flight stream hung after the core died"
        assert any('"code": "engine_dead"' in e or "engine_dead" in e for e in events), events[-3:]
        assert events[-1] == "data: [DONE]"
        assert time.monotonic() - killed_at < 15

        try:
            health = httpx.get(f"{server.url}/health", timeout=5)
            assert health.status_code == 503
        except (httpx.ConnectError, httpx.RemoteProtocolError):
            # Already gone, or going: the watchdog was faster than us. A connection the server
            # accepted as it shut down is closed without a response.
            pass
        server.process.wait(timeout=30)
        assert server.process.returncode == 1, server.log()
        assert "engine core died" in server.log()
    finally:
        stop_server(server)
        server.log_path.unlink(missing_ok=True)
