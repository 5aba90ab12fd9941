"""The pre-norm decoder layer every supported model shares: norm → attention → norm → MLP, with
each residual add fused into the norm that follows it."""

from __future__ import annotations

import torch
from torch import nn


class PreNormDecoderLayer(nn.Module):
    """Subclasses build `self_attn(positions, x)`, `mlp(x)`, `input_layernorm` and
    `post_attention_layernorm` (RMSNorms that take an optional residual to add first)."""

    def forward(
        self, positions: torch.Tensor, hidden_states: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (sublayer output, residual stream before it): the next norm adds them."""
        if residual is None:
            residual = hidden_states
            hidden_states = self.input_layernorm(hidden_states)
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual)
        hidden_states = self.self_attn(positions, hidden_states)
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        return self.mlp(hidden_states), residual


class PreNormDecoderStack(nn.Module):
    """Subclasses build `embed_tokens`, `layers` (PreNormDecoderLayers) and the final `norm`."""

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden_states = self.embed_tokens(input_ids)
        residual = None
        for layer in self.layers:
            hidden_states, residual = layer(positions, hidden_states, residual)
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states


class CausalLMBase(nn.Module):
    """The causal-LM shell every model shares: a decoder stack `model` and an LM head that may be
    tied to the input embedding. Subclasses set `self.model` before calling `_init_lm_head`."""

    def _init_lm_head(self, config) -> None:
        from v1_engine.layers.embedding import LMHead

        self.lm_head = LMHead(config.vocab_size, config.hidden_size)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        if self.tie_word_embeddings:
            self.lm_head.tie_to(self.model.embed_tokens)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """input_ids, positions [T] (all requests of the step packed) → hidden states [T, H]."""
        return self.model(input_ids, positions)

    def compute_logits(self, hidden_states: torch.Tensor, exact: bool = False) -> torch.Tensor:
        """hidden states [N, H] → logits [N, vocab] in the model's dtype. Their consumers upcast
        where they compute (the sampler's penalties, temperature and logprobs, prompt logprobs);
        greedy decoding's argmax needs no float32 copy of a 128k-wide row. `exact`: every logit
        from the model-dtype weight even where the head scores in FP8 first (the rescored
        head; prompt logprobs score given tokens, often in the tail)."""
        return self.lm_head(hidden_states, exact=exact)
