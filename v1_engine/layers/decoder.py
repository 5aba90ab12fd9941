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
