"""Engine options through the server: --generation-config (a request's unset sampling fields
take the generation_config.json's values; tests/engine/test_generation_config.py has the engine
side), --scheduling-policy priority (the `priority` field accepted; the fcfs refusal is in
test_server_errors.py) and --enable-log-requests (a line at a request's arrival and end)."""

from __future__ import annotations

import asyncio
import json
import re

import httpx
import openai
import pytest
from server_helpers import API_KEY, running_server

ASK = [{"role": "user", "content": "Name a colour."}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    folder = tmp_path_factory.mktemp("generation")
    (folder / "generation_config.json").write_text(
        json.dumps({"eos_token_id": 2, "temperature": 0.0, "max_new_tokens": 5})
    )
    with running_server("--generation-config", str(folder), "--scheduling-policy", "priority",
                        "--max-num-seqs", "2", "--enable-log-requests") as s:  # fmt: skip
        yield s


def test_the_server_takes_the_files_defaults_for_unset_fields(server):
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0)
    model = client.models.list().data[0].id
    # Unset temperature and max_tokens: the file's greedy decoding and 5 tokens.
    first = client.chat.completions.create(model=model, messages=ASK)
    again = client.chat.completions.create(model=model, messages=ASK)
    assert first.usage.completion_tokens == 5 and first.choices[0].finish_reason == "length"
    assert again.choices[0].message.content == first.choices[0].message.content
    # Set fields keep the client's values.
    longer = client.chat.completions.create(model=model, messages=ASK, max_tokens=7,
                                            temperature=0.0)  # fmt: skip
    assert longer.usage.completion_tokens == 7
    assert longer.choices[0].message.content.startswith(first.choices[0].message.content)


def test_priorities_are_served_under_the_priority_policy(server):
    """Eight concurrent requests of mixed priorities over two slots: all served, greedy output
    the same whatever the priority."""
    client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0)

    async def run():
        model = (await client.models.list()).data[0].id
        chats = [
            client.chat.completions.create(
                model=model, messages=ASK, max_tokens=4, extra_body={"priority": p}
            )
            for p in (5, -3, 0, 2, -1, 7, 0, 1)
        ]
        streamed = await client.completions.create(
            model=model, prompt="Red, green and", max_tokens=4, stream=True,
            extra_body={"priority": -9},
        )  # fmt: skip
        pieces = [c.choices[0].text async for c in streamed if c.choices]
        return await asyncio.gather(*chats), "".join(pieces)

    replies, text = asyncio.run(run())
    assert len({r.choices[0].message.content for r in replies}) == 1
    assert all(r.usage.completion_tokens == 4 for r in replies) and text


def test_requests_are_logged_at_arrival_and_end(server):
    body = {"prompt": "Red, green and", "max_tokens": 4, "temperature": 0.0, "priority": 2}
    response = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60,
                          headers={"Authorization": f"Bearer {API_KEY}"})  # fmt: skip
    assert response.status_code == 200, response.text
    request_id = response.headers["x-request-id"]
    prompt_tokens = response.json()["usage"]["prompt_tokens"]
    log = server.log()
    arrival = re.search(rf"request {request_id}: (\d+) prompt tokens, (\{{.*\}}), priority 2", log)
    assert arrival and int(arrival.group(1)) == prompt_tokens
    assert json.loads(arrival.group(2))["max_tokens"] == 4
    assert f"request {request_id} finished (length): 4 output tokens in " in log
