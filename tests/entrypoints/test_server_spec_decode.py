"""v1serve with `--speculative-config`: the official openai client gets the same greedy text as
without drafts, whole and streamed; /metrics counts the drafts kept, and so does the log's
periodic statistics line."""

from __future__ import annotations

import json

import openai
import pytest
from server_helpers import API_KEY, metric, running_server, start_server

from v1_engine import LLM, SamplingParams

CODE = "def mean(xs):\n    total = 0\n    for x in xs:\n        total += x\n    return total / len(xs)\n"
MESSAGES = [{"role": "user", "content": f"Add type hints to this code and return it:\n\n{CODE}"}]


@pytest.fixture(scope="module")
def spec_server():
    spec = json.dumps({"method": "ngram", "num_speculative_tokens": 3})
    with running_server("--speculative-config", spec, "--log-stats-interval", "0.2") as server:
        yield server


def test_drafted_chat_equals_the_offline_output_without_drafts(spec_server):
    expected = LLM(max_model_len=2048).chat(
        MESSAGES, SamplingParams(temperature=0.0, max_tokens=64), use_tqdm=False
    )[0]
    client = openai.OpenAI(base_url=f"{spec_server.url}/v1", api_key=API_KEY, max_retries=0)
    model = client.models.list().data[0].id
    whole = client.chat.completions.create(
        model=model, messages=MESSAGES, temperature=0.0, max_tokens=64
    )
    assert whole.choices[0].message.content == expected.outputs[0].text
    assert whole.usage.completion_tokens == len(expected.outputs[0].token_ids)
    stream = client.chat.completions.create(
        model=model, messages=MESSAGES, temperature=0.0, max_tokens=64, stream=True
    )
    deltas = [
        c.choices[0].delta.content for c in stream if c.choices and c.choices[0].delta.content
    ]
    assert "".join(deltas) == expected.outputs[0].text
    samples = spec_server.metrics()
    drafted = metric(samples, "v1engine:spec_decode_num_draft_tokens_total")
    kept = metric(samples, "v1engine:spec_decode_num_accepted_tokens_total")
    assert drafted >= kept > 10
    assert metric(samples, "v1engine:spec_decode_num_drafts_total") > 0
    # The periodic statistics line in the server's log, with its drafts.
    lines = [x for x in spec_server.log_path.read_text().splitlines() if "Engine: prompt" in x]
    assert lines and any("generation throughput" in x and "draft tokens accepted" in x
                         for x in lines), lines[-3:]  # fmt: skip
    # Idle, the server's once-a-second tick writes the last busy interval and then nothing.
    import time

    def count() -> int:
        return spec_server.log_path.read_text().count("Engine: prompt")

    time.sleep(1.5)
    settled = count()
    time.sleep(2.5)
    assert count() == settled


def test_a_bad_speculative_config_stops_the_server_with_the_field_named():
    with pytest.raises(pytest.fail.Exception, match="num_speculative_tokens"):
        start_server("--speculative-config", '{"method": "ngram"}')
