"""The server's network flags on one real server: HTTPS (--ssl-keyfile / --ssl-certfile, a
self-signed certificate the openai client trusts), CORS (--allowed-origins: preflights
answered before the API key check, other origins refused) and --root-path (a proxy's
prefix in the OpenAPI document and the startup banner)."""

from __future__ import annotations

import shutil
import ssl
import subprocess

import httpx
import openai
import pytest
from server_helpers import API_KEY, running_server

ORIGIN = "http://app.example"


def _trusting(cert) -> ssl.SSLContext:
    return ssl.create_default_context(cafile=str(cert))


@pytest.fixture(scope="module")
def tls_server(tmp_path_factory):
    if shutil.which("openssl") is None:
        pytest.fail("openssl is needed to make the test certificate")
    folder = tmp_path_factory.mktemp("tls")
    key, cert = folder / "key.pem", folder / "cert.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key),
         "-out", str(cert), "-days", "1", "-subj", "/CN=127.0.0.1",
         "-addext", "subjectAltName=IP:127.0.0.1"],
        check=True, capture_output=True,
    )  # fmt: skip
    with running_server("--ssl-keyfile", str(key), "--ssl-certfile", str(cert),
                        "--allowed-origins", f'["{ORIGIN}"]', "--root-path", "/llm") as s:  # fmt: skip
        yield s, cert


def test_https_with_the_openai_client(tls_server):
    server, cert = tls_server
    assert server.url.startswith("https://")
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0,
                           http_client=httpx.Client(verify=_trusting(cert)))  # fmt: skip
    model = client.models.list().data[0].id
    reply = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Hi"}], max_tokens=3
    )
    assert reply.usage.completion_tokens == 3
    with pytest.raises(httpx.TransportError):  # plain HTTP on the TLS port is not served
        httpx.get(server.url.replace("https", "http") + "/health", timeout=5)
    assert f"v1serve ready at {server.url}/llm" in server.log()


def test_cors_for_the_allowed_origin_only(tls_server):
    server, cert = tls_server
    preflight = {"Origin": ORIGIN, "Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "authorization,content-type"}  # fmt: skip
    with httpx.Client(verify=_trusting(cert), base_url=server.url, timeout=30) as http:
        ok = http.options("/v1/chat/completions", headers=preflight)  # no key: answered first
        assert ok.status_code == 200 and ok.headers["access-control-allow-origin"] == ORIGIN
        refused = http.options(
            "/v1/chat/completions", headers={**preflight, "Origin": "http://evil.example"}
        )
        assert refused.status_code == 400 and "access-control-allow-origin" not in refused.headers
        body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
        auth = {"Authorization": f"Bearer {API_KEY}", "Origin": ORIGIN}
        post = http.post("/v1/chat/completions", json=body, headers=auth)
        assert post.status_code == 200 and post.headers["access-control-allow-origin"] == ORIGIN
        assert "x-request-id" in post.headers["access-control-expose-headers"].lower()
        unauthorized = http.post("/v1/chat/completions", json=body, headers={"Origin": ORIGIN})
        assert unauthorized.status_code == 401  # the key is still required
        assert unauthorized.headers["access-control-allow-origin"] == ORIGIN


def test_the_root_path_reaches_the_openapi_document(tls_server):
    server, _ = tls_server
    spec = server.get("/openapi.json", timeout=30).json()
    assert spec["servers"] == [{"url": "/llm"}]
