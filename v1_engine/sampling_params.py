"""SamplingParams: how one request is sampled and when it stops.

A msgspec Struct so it crosses the process boundary as typed msgpack. `verify()` is the single
place user-supplied values are checked; every error names the field and the allowed range.
"""

from __future__ import annotations

import math

import msgspec

from v1_engine.structured_output import StructuredOutputsParams

_SAMPLING_EPS = 1e-5
_INT64_LIMIT = 2**63

MAX_LOGIT_BIAS = 100.0
"""logit_bias values lie in [-MAX_LOGIT_BIAS, MAX_LOGIT_BIAS], OpenAI's range."""


class SamplingParams(msgspec.Struct, omit_defaults=True, kw_only=True):
    n: int = 1
    """Number of completions to return for the prompt."""
    temperature: float = 1.0
    """0 means greedy decoding."""
    top_p: float = 1.0
    """Nucleus sampling: keep the smallest set of tokens whose probability sums to top_p."""
    top_k: int = 0
    """Keep only the top_k most likely tokens; 0 or -1 disables."""
    min_p: float = 0.0
    """Drop tokens whose probability is below min_p times the most likely token's."""
    seed: int | None = None
    """Per-request seed: the same seed and inputs give the same tokens."""
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    max_tokens: int | None = 16
    """Maximum number of generated tokens; None means up to the model's context length."""
    min_tokens: int = 0
    """Stop tokens and EOS are suppressed until this many tokens have been generated."""
    stop: list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = None
    """Number of top log-probabilities returned per generated token (plus the sampled one)."""
    prompt_logprobs: int | None = None
    """Number of top log-probabilities returned per prompt token."""
    skip_special_tokens: bool = True
    logit_bias: dict[int, float] | None = None
    """Token id -> value added to its logit before sampling, greedy rows included (OpenAI's
    `logit_bias`): -100 in effect bans a token, 100 in effect forces it. Logprobs stay those of
    the unbiased logits."""
    allowed_token_ids: list[int] | None = None
    """Only these token ids can be sampled (every other logit is -inf before sampling)."""
    structured_outputs: StructuredOutputsParams | None = None
    """Constrain the output to a JSON schema, any JSON object, a regex, a choice of strings or
    an EBNF grammar (v1_engine/structured_output.py)."""

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]

    @property
    def is_greedy(self) -> bool:
        return self.temperature < _SAMPLING_EPS

    def verify(self, max_logprobs: int = 20) -> None:
        """Raise ValueError naming the offending field and its allowed range."""
        if not isinstance(self.n, int) or self.n < 1:
            raise ValueError(f"n must be an integer >= 1, got {self.n!r}")
        for name in ("n", "top_k", "max_tokens", "min_tokens", "logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and abs(value) >= _INT64_LIMIT:
                # msgpack (the engine core's link) carries 64-bit integers only.
                raise ValueError(f"{name} must be below 2**63, got {value}")
        if not (math.isfinite(self.temperature) and self.temperature >= 0.0):
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise ValueError(f"top_k must be -1, 0 (disabled) or >= 1, got {self.top_k}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise ValueError(f"presence_penalty must be in [-2, 2], got {self.presence_penalty}")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise ValueError(f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}")
        if not 0.0 < self.repetition_penalty <= 2.0:
            raise ValueError(f"repetition_penalty must be in (0, 2], got {self.repetition_penalty}")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens must be >= 0, got {self.min_tokens}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens must be <= max_tokens ({self.max_tokens}), got {self.min_tokens}"
            )
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and not 0 <= value <= max_logprobs:
                raise ValueError(f"{name} must be in [0, {max_logprobs}], got {value}")
        if self.stop is not None and any(not s for s in self.stop):
            raise ValueError("stop must not contain empty strings")
        if self.seed is not None and not 0 <= self.seed < 2**63:
            raise ValueError(f"seed must be in [0, 2**63), got {self.seed}")
        self._verify_token_lists()
        if self.structured_outputs is not None:
            if not isinstance(self.structured_outputs, StructuredOutputsParams):
                raise ValueError(
                    "structured_outputs must be a StructuredOutputsParams, got "
                    f"{type(self.structured_outputs).__name__}"
                )
            self.structured_outputs.verify()
            if self.min_tokens > 0:
                # Where the grammar ends only a stop token may follow; min_tokens bans it there.
                raise ValueError(
                    "min_tokens must be 0 with structured_outputs (the grammar decides where the "
                    f"output ends), got {self.min_tokens}"
                )

    def _verify_token_lists(self) -> None:
        """Types and value ranges of the token-id fields; InputProcessor checks the ids against
        the vocabulary, which it knows."""
        for name in ("stop_token_ids", "allowed_token_ids"):
            ids = getattr(self, name)
            if ids is not None and not all(_is_token_id(t) for t in ids):
                raise ValueError(f"{name} must be a list of token ids (integers >= 0), got {ids!r}")
        if self.allowed_token_ids is not None and not self.allowed_token_ids:
            raise ValueError("allowed_token_ids must not be empty (no token could be sampled)")
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise ValueError(
                    f"logit_bias must be a dict of token id -> bias, got "
                    f"{type(self.logit_bias).__name__}"
                )
            for token_id, bias in self.logit_bias.items():
                if not _is_token_id(token_id):
                    raise ValueError(
                        f"logit_bias keys must be token ids (integers >= 0), got {token_id!r}"
                    )
                if (
                    isinstance(bias, bool)
                    or not isinstance(bias, int | float)
                    or not math.isfinite(bias)
                    or abs(bias) > MAX_LOGIT_BIAS
                ):
                    raise ValueError(
                        f"logit_bias values must be numbers in [-{MAX_LOGIT_BIAS:g}, "
                        f"{MAX_LOGIT_BIAS:g}], got {bias!r} for token {token_id}"
                    )

    def token_id_fields(self) -> dict[str, list[int]]:
        """Every token id the request names, by field, for the vocabulary check."""
        fields = {
            "stop_token_ids": self.stop_token_ids,
            "logit_bias": list(self.logit_bias) if self.logit_bias else None,
            "allowed_token_ids": self.allowed_token_ids,
        }
        return {name: ids for name, ids in fields.items() if ids}


def _is_token_id(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0
