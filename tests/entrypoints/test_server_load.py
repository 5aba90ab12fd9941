"""Streaming behaviour under load: prefix-cache TTFT, disconnects, 64 concurrent clients, metrics."""

from __future__ import annotations

import asyncio
import json
import time
import uuid

import httpx
from server_helpers import metric

NS = "v1engine:"


def wait_for(predicate, timeout: float = 15.0, interval: float = 0.2) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()


def streamed_ttft(client, model_name: str, messages: list[dict]) -> float:
    start = time.perf_counter()
    stream = client.chat.completions.create(
        model=model_name, messages=messages, max_tokens=4, temperature=0.0, stream=True
    )
    ttft = None
    for chunk in stream:
        if ttft is None and chunk.choices and chunk.choices[0].delta.content:
            ttft = time.perf_counter() - start
    assert ttft is not None
    return ttft


def test_prefix_cache_hit_lowers_ttft(server, client, model_name):
    # A unique first sentence makes sure no earlier test warmed this prefix.
    facts = " ".join(f"Fact {i}: the number {i} is written as {i * 7}." for i in range(36))
    system = f"Session {uuid.uuid4().hex}. You answer briefly. {facts}"
    before = server.metrics()
    first = streamed_ttft(
        client,
        model_name,
        [{"role": "system", "content": system}, {"role": "user", "content": "What is fact 3?"}],
    )
    middle = server.metrics()
    second = streamed_ttft(
        client,
        model_name,
        [{"role": "system", "content": system}, {"role": "user", "content": "What is fact 9?"}],
    )
    after = server.metrics()
    hits_first = metric(middle, NS + "prefix_cache_hits_total") - metric(
        before, NS + "prefix_cache_hits_total"
    )
    hits_second = metric(after, NS + "prefix_cache_hits_total") - metric(
        middle, NS + "prefix_cache_hits_total"
    )
    assert hits_second >= 512, (hits_first, hits_second)
    assert hits_second > hits_first
    assert second < 0.6 * first, (first, second)


def test_disconnect_mid_stream_aborts_and_frees_blocks(server, auth_headers):
    body = {
        "prompt": "Write a very long story about a dragon.",
        "max_tokens": 1500,
        "ignore_eos": True,
        "stream": True,
    }
    before = server.metrics()
    with httpx.stream(
        "POST", f"{server.url}/v1/completions", json=body, headers=auth_headers, timeout=60
    ) as response:
        assert response.status_code == 200
        events = 0
        for line in response.iter_lines():
            if line.startswith("data: "):
                events += 1
            if events >= 3:
                break
    # The connection is closed here, long before 1500 tokens could be generated.
    assert wait_for(lambda: metric(server.metrics(), NS + "num_requests_running") == 0)
    settled = server.metrics()
    assert metric(settled, NS + "kv_cache_usage_perc") == 0.0
    generated = metric(settled, NS + "generation_tokens_total") - metric(
        before, NS + "generation_tokens_total"
    )
    assert generated < 1500
    time.sleep(1.0)
    later = metric(server.metrics(), NS + "generation_tokens_total")
    assert later == metric(settled, NS + "generation_tokens_total")


def test_64_concurrent_streaming_clients_complete(async_client_factory, model_name, server):
    async def one(client, i: int) -> tuple[str, int]:
        stream = await client.completions.create(
            model=model_name,
            prompt=f"Request {i}: count to ten.",
            max_tokens=8,
            temperature=0.0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        text, usage = "", None
        async for chunk in stream:
            if chunk.choices:
                text += chunk.choices[0].text
            if chunk.usage is not None:
                usage = chunk.usage.completion_tokens
        return text, usage

    async def run_all():
        client = async_client_factory()
        async with client:
            return await asyncio.gather(*(one(client, i) for i in range(64)))

    results = asyncio.run(run_all())
    assert len(results) == 64
    assert all(usage == 8 and text for text, usage in results)
    assert wait_for(lambda: metric(server.metrics(), NS + "num_requests_running") == 0)


def test_metrics_exposition(server, client, model_name):
    before = server.metrics()
    client.completions.create(
        model=model_name,
        prompt="Metrics test",
        max_tokens=5,
        temperature=0.0,
        extra_body={"ignore_eos": True},
    )
    after = server.metrics()

    def delta(name: str, **labels: str) -> float:
        return metric(after, NS + name, **labels) - metric(before, NS + name, **labels)

    assert delta("generation_tokens_total") == 5
    assert delta("prompt_tokens_total") > 0
    assert delta("request_success_total", finished_reason="length") == 1
    assert delta("time_to_first_token_seconds_count") == 1
    assert delta("e2e_request_latency_seconds_count") == 1
    assert delta("inter_token_latency_seconds_count") >= 1
    text = httpx.get(f"{server.url}/metrics").text
    for name in (
        "num_requests_running",
        "num_requests_waiting",
        "kv_cache_usage_perc",
        "prefix_cache_queries_total",
        "prefix_cache_hits_total",
        "request_queue_time_seconds",
    ):
        assert NS + name in text
    assert 'model_name="SmolLM2-135M-Instruct"' in text


def test_sse_wire_format(server, auth_headers):
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "stream": True}
    with httpx.stream(
        "POST", f"{server.url}/v1/chat/completions", json=body, headers=auth_headers, timeout=60
    ) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        raw = response.read().decode()
    events = [e for e in raw.split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events)
    assert events[-1] == "data: [DONE]"
    chunks = [json.loads(e[6:]) for e in events[:-1]]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length")
