"""--generation-config on the server: a request's unset sampling fields take the
generation_config.json's values (tests/engine/test_generation_config.py has the engine side)."""

from __future__ import annotations

import json

import openai
from server_helpers import API_KEY, running_server


def test_the_server_takes_the_files_defaults_for_unset_fields(tmp_path):
    (tmp_path / "generation_config.json").write_text(
        json.dumps({"eos_token_id": 2, "temperature": 0.0, "max_new_tokens": 5})
    )
    folder = str(tmp_path)
    with running_server("--generation-config", folder) as server:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0)
        model = client.models.list().data[0].id
        ask = [{"role": "user", "content": "Name a colour."}]
        # Unset temperature and max_tokens: the file's greedy decoding and 5 tokens.
        first = client.chat.completions.create(model=model, messages=ask)
        again = client.chat.completions.create(model=model, messages=ask)
        assert first.usage.completion_tokens == 5 and first.choices[0].finish_reason == "length"
        assert again.choices[0].message.content == first.choices[0].message.content
        # Set fields keep the client's values.
        longer = client.chat.completions.create(model=model, messages=ask, max_tokens=7,
                                                temperature=0.0)  # fmt: skip
        assert longer.usage.completion_tokens == 7
        assert longer.choices[0].message.content.startswith(first.choices[0].message.content)
