"""A real `v1serve` subprocess on the default model, and clients for it.

The server is started once per session, with an API key (so the 401 path is tested against the
same process), and stopped at the end.
"""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest
from server_helpers import API_KEY, Server, start_server, stop_server


@pytest.fixture(scope="session")
def server() -> Iterator[Server]:
    srv = start_server()
    try:
        yield srv
    finally:
        stop_server(srv)
        srv.log_path.unlink(missing_ok=True)


@pytest.fixture(scope="session")
def model_name(server: Server) -> str:
    headers = {"Authorization": f"Bearer {API_KEY}"}
    return httpx.get(f"{server.url}/v1/models", headers=headers, timeout=10).json()["data"][0]["id"]


@pytest.fixture(scope="session")
def client(server: Server):
    import openai

    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="session")
def async_client_factory(server: Server):
    import openai

    def make():
        return openai.AsyncOpenAI(
            base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=180
        )

    return make


@pytest.fixture(scope="session")
def auth_headers() -> dict[str, str]:
    return {"Authorization": f"Bearer {API_KEY}"}
