"""Token embedding and the LM head (which may share the embedding's weight, or score in FP8 after
loading: ModelConfig.lm_head_quantization)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from v1_engine.kernels.fp8 import per_token_fp8_quant
from v1_engine.layers.quantization.base import LinearMethod
from v1_engine.layers.quantization.fp8 import Fp8OnlineLinearMethod, scaled_linear

RESCORE_CHUNK = 1024
"""The rescored FP8 head cuts the vocabulary into cdiv(V, RESCORE_CHUNK) strided slices of
RESCORE_CHUNK tokens (slice c: tokens c, c + S, c + 2S, ...; kernels/triton_rescore.py says why
strided) and re-scores the largest FP8 logits of each..."""
RESCORE_TOP = 4
"""...RESCORE_TOP of them: a token whose exact logit is the row's largest keeps an approximate
value only if four tokens of its own slice score above it in FP8 (near-ties, within the FP8
error), so greedy decoding takes the model-dtype head's token."""
RESCORE_MAX_M = 16
"""Rows up to which the rescored head scores in FP8 (decode steps); longer inputs (prompt
logprobs, large batches) take the model-dtype weight whole: exact, and the re-score's reads
grow with the rows."""


class VocabEmbedding(nn.Module):
    def __init__(self, num_embeddings: int, embedding_dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_embeddings, embedding_dim), requires_grad=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_ids, self.weight)


def rescore_slice_tops_ref(
    logits: torch.Tensor, hidden: torch.Tensor, weight: torch.Tensor, chunk: int, top: int
) -> torch.Tensor:
    """The oracle of kernels/triton_rescore.py: each logits row [M, V] is cut into S =
    cdiv(V, chunk) strided slices (slice c: tokens c, c + S, ...); in place, every slice's `top`
    largest values (the lowest index first among equal values) become hidden [M, K] @
    weight[index] [V, K], summed in float32; returns `logits`."""
    m, vocab = logits.shape
    slices = -(-vocab // chunk)
    padded = torch.full((m, chunk * slices), float("-inf"), device=logits.device)
    padded[:, :vocab] = logits.float()
    # [m, chunk, slices]: column c is slice c, its rows the tokens in increasing order.
    order = padded.view(m, chunk, slices).sort(dim=1, descending=True, stable=True).indices
    starts = torch.arange(slices, device=logits.device)
    index = (order[:, :top] * slices + starts).reshape(m, -1)
    for row in range(m):
        picked = index[row][index[row] < vocab]
        exact = weight[picked].float() @ hidden[row].float()
        logits[row, picked] = exact.to(logits.dtype)
    return logits


class LMHead(nn.Module):
    """Projects hidden states to vocabulary logits; `tie_to` shares an embedding's weight and
    `quantize_fp8` (ModelConfig.lm_head_quantization) makes it score in FP8 after loading."""

    def __init__(self, num_embeddings: int, embedding_dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_embeddings, embedding_dim), requires_grad=False)
        self.quant_method: LinearMethod | None = None
        """Set by quantize_fp8(); None: the weight as loaded, in the model dtype."""
        self.rescore = False
        """Set by quantize_fp8(rescore=True): `fp8_weight` scores, `weight` re-scores."""

    def tie_to(self, embedding: VocabEmbedding) -> None:
        self.weight = embedding.weight

    def quantize_fp8(self, rescore: bool = False) -> None:
        """Quantize the loaded weight as the online FP8 linear layers do (e4m3, one float32 scale
        per vocabulary row). A second call does nothing.

        rescore=False ("fp8"): `weight` becomes e4m3 [vocab, hidden] with `weight_scale`
        [vocab, 1]; the forward quantizes its input per token. The high-precision weight is
        dropped; a tied embedding keeps its own (the head gets a new FP8 parameter).

        rescore=True ("fp8_rescored"): `weight` stays; `fp8_weight` / `fp8_weight_scale` are
        added. Up to RESCORE_MAX_M rows the forward scores the vocabulary with them (the input
        not quantized where a kernel takes it so), then recomputes each strided slice's
        RESCORE_TOP largest logits against `weight`: the likely tokens get the model-dtype
        head's logits, the tail keeps FP8 ones, and half the head's bytes are read."""
        if self.quant_method is not None or self.rescore:
            return
        if rescore:
            q, scale = per_token_fp8_quant(self.weight.data)
            self.fp8_weight = nn.Parameter(q, requires_grad=False)
            self.fp8_weight_scale = nn.Parameter(scale, requires_grad=False)
            self.rescore = True
            return
        self.quant_method = Fp8OnlineLinearMethod()
        self.quant_method.process_weights_after_loading(self)

    def forward(self, hidden_states: torch.Tensor, exact: bool = False) -> torch.Tensor:
        """Logits in the model dtype. `exact` skips the rescored head's FP8 scoring (every
        logit from `weight`); the "fp8" head, which keeps no other weight, ignores it."""
        if self.quant_method is not None:
            return self.quant_method.apply(self, hidden_states, None)
        decode_sized = hidden_states.dim() == 2 and hidden_states.shape[0] <= RESCORE_MAX_M
        if self.rescore and decode_sized and not exact:
            return self._rescored(hidden_states.contiguous())
        if hidden_states.is_cuda and self.weight.dtype in (torch.bfloat16, torch.float16):
            # Decode-sized batches: the skinny Triton GEMM (5% faster than cuBLAS on the
            # Llama-3-8B vocabulary); larger ones fall back to F.linear inside the op.
            from v1_engine.kernels import skinny_launch, skinny_linear_op

            if skinny_launch.SKINNY_GEMM_ENABLED:
                return skinny_linear_op.skinny_linear(hidden_states, self.weight)
        return F.linear(hidden_states, self.weight)

    def _rescored(self, hidden: torch.Tensor) -> torch.Tensor:
        """FP8 scores of the whole vocabulary, each slice's likeliest re-scored in place."""
        weight, scale = self.fp8_weight, self.fp8_weight_scale
        if not hidden.is_cuda:
            logits = scaled_linear(hidden, weight, scale, None)
            return rescore_slice_tops_ref(logits, hidden, self.weight, RESCORE_CHUNK, RESCORE_TOP)
        from v1_engine.kernels import triton_rescore
        from v1_engine.kernels.skinny_launch import FMA_MAX_M

        if hidden.shape[0] <= FMA_MAX_M and hidden.dtype in (torch.bfloat16, torch.float16):
            from v1_engine.kernels.triton_gemv_fp8_decode import fp8_weight_only_gemm

            logits = fp8_weight_only_gemm(hidden, weight, scale)
        else:
            logits = scaled_linear(hidden, weight, scale, None)
        return triton_rescore.rescore_slice_tops(
            logits, hidden, self.weight, RESCORE_CHUNK, RESCORE_TOP
        )
