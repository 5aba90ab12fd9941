"""Which CUDA graphs a model runner captures, the memory they reserve, and their capture.

Three kinds share one memory pool (compile/cuda_graphs.py has them): full graphs of decode steps
(level 2: a request count each), full graphs of speculative decoding's verify steps (level 2,
drafts on, `verify_cudagraphs`, an attention backend that captures any query length, no MLA:
1 + k tokens a request), and piecewise graphs of any step up to the largest token count
(`piecewise_cudagraphs`, level >= 1). The sizes are known from the config before anything is
captured, so the KV sizing reserves the pool's memory first (`reserve_bytes`).
"""

from __future__ import annotations

import functools
import logging
from typing import TYPE_CHECKING, Any

import torch

from v1_engine.config import EngineConfig
from v1_engine.layers.mla import MLAAttention, get_mla_backend
from v1_engine.worker.kv_sizing import make_dummy_forward

if TYPE_CHECKING:
    from compile.cuda_graphs import (
        DecodeCudaGraphs,
        Forward,
        PiecewiseCudaGraphs,
        VarlenCudaGraphs,
    )

logger = logging.getLogger(__name__)


class CudaGraphPlan:
    """A runner's CUDA graphs: their sizes from the config, then the captured graphs."""

    def __init__(
        self,
        config: EngineConfig,
        model: Any,
        attn_backend: Any,
        device: torch.device,
        dtype: torch.dtype,
        hidden_size: int,
        vocab_size: int,
    ) -> None:
        self.config = config
        self.model = model
        self.attn_backend = attn_backend
        self.device = device
        self.dtype = dtype
        self.hidden_size = hidden_size
        self.vocab_size = vocab_size
        self.decode: DecodeCudaGraphs | None = None
        """Full CUDA graphs of decode steps, once captured."""
        self.verify: VarlenCudaGraphs | None = None
        """Full CUDA graphs of verify steps (each request its last token and its drafts)."""
        self.piecewise: PiecewiseCudaGraphs | None = None
        """Piecewise CUDA graphs of any step up to the largest size."""

    @functools.cached_property
    def possible(self) -> bool:
        """CUDA graphs need CUDA, level >= 1 and attention backends that can be captured."""
        cc = self.config.compilation_config
        if self.device.type != "cuda" or cc.effective_level("cuda") < 1:
            return False
        if not getattr(self.attn_backend, "supports_cudagraph", False):
            logger.info(
                "attention backend %s cannot be captured: no CUDA graphs", self.attn_backend
            )
            return False
        if self._uses_mla and not getattr(
            get_mla_backend(self.device), "supports_cudagraph", False
        ):
            logger.info("the MLA backend cannot be captured: no CUDA graphs")
            return False
        return True

    @functools.cached_property
    def _uses_mla(self) -> bool:
        return any(isinstance(x, MLAAttention) for x in self.model.attention_layers())

    @functools.cached_property
    def decode_sizes(self) -> list[int]:
        """Requests per decode graph (level 2); empty when there are none."""
        cc = self.config.compilation_config
        if not self.possible or cc.effective_level("cuda") < 2:
            return []
        return cc.capture_sizes(self.config.scheduler_config.max_num_seqs)

    @functools.cached_property
    def verify_query_len(self) -> int:
        """Query tokens a request computes in a verify step: its last token and its drafts (0
        without speculative decoding)."""
        spec = self.config.speculative_config
        return 1 + spec.num_speculative_tokens if spec.enabled else 0  # type: ignore[operator]

    @functools.cached_property
    def verify_sizes(self) -> list[int]:
        """Requests per verify graph: the decode graphs' sizes whose tokens fit the step's
        token budget (empty unless drafts are on, `verify_cudagraphs`, the attention backend
        captures any query length and the model has no MLA)."""
        q = self.verify_query_len
        if not q or not self.decode_sizes:
            return []
        if not self.config.compilation_config.verify_cudagraphs:
            return []
        if not getattr(self.attn_backend, "supports_varlen_cudagraph", False):
            logger.info("attention backend %s: verify steps run piecewise", self.attn_backend)
            return []
        if self._uses_mla:
            return []
        budget = self.config.scheduler_config.max_num_batched_tokens
        return [n for n in self.decode_sizes if n * q <= budget]

    @functools.cached_property
    def piecewise_sizes(self) -> list[int]:
        """Tokens per piecewise graph (level >= 1, `piecewise_cudagraphs`); empty when none."""
        cc = self.config.compilation_config
        if not self.possible or not cc.piecewise_cudagraphs:
            return []
        limit = self.config.scheduler_config.max_num_batched_tokens
        return cc.piecewise_sizes(limit, cc.effective_level("cuda"))

    @functools.cached_property
    def sizes(self) -> list[int]:
        """Every size some graph is captured for (requests of a decode graph, tokens of a
        piecewise or verify graph), ascending; empty when graphs are off."""
        verify = {n * self.verify_query_len for n in self.verify_sizes}
        return sorted(set(self.decode_sizes) | set(self.piecewise_sizes) | verify)

    def reserve_bytes(self) -> int:
        """Memory the graphs' shared pool will take, measured before the KV pool exists: the peak
        activations of the largest captured batch (the pool holds about one such forward, as
        smaller graphs reuse it), plus the decode graphs' output buffers."""
        if not self.sizes:
            return 0
        largest = self.sizes[-1]
        forward = make_dummy_forward(
            self.model,
            self.attn_backend,
            largest,
            1,
            self.vocab_size,
            self.device,
            max_positions=self.config.model_config.max_model_len,
        )
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        base = torch.cuda.memory_allocated(self.device)
        forward()
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device) - base
        hidden = self.hidden_size * torch.empty((), dtype=self.dtype).element_size()
        torch.cuda.empty_cache()
        return peak + sum(self.sizes) * hidden

    def capture(self, forward: Forward) -> bool:
        """Capture every planned graph of the compiled `forward` into one pool; False when there
        is nothing to capture (no sizes, or a forward that was not compiled for graphs)."""
        state = getattr(getattr(forward, "backend", None), "graph_state", None)
        if not self.sizes or state is None:
            return False
        from compile.cuda_graphs import DecodeCudaGraphs, PiecewiseCudaGraphs, VarlenCudaGraphs

        layers = self.model.attention_layers()
        pool = torch.cuda.graph_pool_handle()
        max_model_len = self.config.model_config.max_model_len
        block_size = self.config.cache_config.block_size
        # What a full graph's buffers and attention launch are sized for; one pool for all.
        full = {
            "max_blocks_per_req": -(-max_model_len // block_size),
            "max_seq_len": max_model_len,
            "device": self.device,
            "pool": pool,
        }
        if self.decode_sizes:
            self.decode = DecodeCudaGraphs(forward, self.decode_sizes, **full)
            self.decode.capture(self.attn_backend, layers)
        if self.verify_sizes:
            self.verify = VarlenCudaGraphs(forward, self.verify_sizes, **full,
                                           query_len=self.verify_query_len,
                                           block_size=block_size)  # fmt: skip
            self.verify.capture(self.attn_backend, layers)
        if self.piecewise_sizes:
            self.piecewise = PiecewiseCudaGraphs(
                forward, state, self.piecewise_sizes, self.device, pool=pool
            )
            self.piecewise.capture(self.attn_backend, layers)
        return True
