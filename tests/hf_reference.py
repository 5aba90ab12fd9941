"""Hugging Face transformers as the reference implementation in tests."""

from __future__ import annotations

import torch


def hf_greedy(model, prompt_token_ids: list[int], max_new_tokens: int, exact: bool) -> list[int]:
    """Hugging Face greedy tokens; `exact` forces max_new_tokens (EOS suppressed until then)."""
    input_ids = torch.tensor([prompt_token_ids])
    with torch.no_grad():
        out = model.generate(
            input_ids,
            attention_mask=torch.ones_like(input_ids),
            do_sample=False,
            max_new_tokens=max_new_tokens,
            min_new_tokens=max_new_tokens if exact else 0,
            pad_token_id=model.config.eos_token_id,
        )
    return out[0, len(prompt_token_ids) :].tolist()
