"""The model's generation_config.json: the end-of-sequence tokens it stops on besides the
tokenizer's, and the sampling settings its authors recommend.

Instruct models often end a turn with a token other than the tokenizer's EOS (Llama 3.1:
`<|eot_id|>` and `<|eom_id|>` beside `<|end_of_text|>`; Qwen2.5: `<|im_end|>` and
`<|endoftext|>`): Hugging Face's generate() stops on every id the file lists, and so does the
engine (as stop tokens, unless `ignore_eos`). The sampling settings (temperature, top_p, top_k,
min_p, repetition_penalty, and max_new_tokens as max_tokens) become the defaults of requests
that do not set them, as vLLM's `--generation-config auto` does; `generation_config="vllm"`
ignores them (the engine's own defaults; the EOS ids still count), a folder path reads that
folder's file instead.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

FILE = "generation_config.json"

SAMPLING_KEYS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "max_new_tokens": "max_tokens",
}
"""generation_config.json key -> SamplingParams field."""


@dataclass(frozen=True)
class GenerationDefaults:
    eos_token_ids: tuple[int, ...] = ()
    """Every end-of-sequence id the file lists (the tokenizer's EOS among them, usually)."""
    sampling: dict[str, Any] = field(default_factory=dict)
    """SamplingParams fields the file sets: the defaults of requests that leave them unset."""


def generation_config_folder(choice: str, model_path: str) -> Path:
    """Where to read generation_config.json: the model's folder ("auto", "vllm") or the folder
    `choice` names. ValueError naming `generation_config` for a folder without the file."""
    if choice in ("auto", "vllm"):
        return Path(model_path)
    folder = Path(choice).expanduser()
    if not (folder / FILE).is_file():
        raise ValueError(
            f"generation_config must be 'auto', 'vllm' or a folder holding {FILE}, got {choice!r}"
        )
    return folder


def load_generation_defaults(choice: str, model_path: str) -> GenerationDefaults:
    """The EOS ids and (unless `choice` is "vllm") the sampling settings of the
    generation_config.json that `choice` (ModelConfig.generation_config) selects for the model
    in `model_path`; empty without a file."""
    path = generation_config_folder(choice, model_path) / FILE
    if not path.is_file():
        return GenerationDefaults()
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    eos = data.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, list) else (eos,) if isinstance(eos, int) else ()
    sampling = {
        name: data[key]
        for key, name in SAMPLING_KEYS.items()
        if data.get(key) is not None and choice != "vllm"
    }
    if sampling:
        shown = ", ".join(f"{k}={v}" for k, v in sampling.items())
        logger.info(
            "default sampling from the model's %s: %s (requests that set a field keep theirs; "
            "--generation-config vllm ignores the file)",
            FILE,
            shown,
        )
    return GenerationDefaults(eos_ids, sampling)
