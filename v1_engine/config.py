"""EngineConfig: one object made of small dataclasses, each field documented where declared.

Built from keyword arguments (`LLM(...)`, `AsyncEngine(...)`) or CLI flags. Values that depend
on the model (context length, dtype, KV sizing) are resolved once, by `resolve_model_facts`, when
the model's Hugging Face config is known. `EngineConfig.compute_hash()` keys the compile cache.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass, field
from typing import Any

DTYPE_CHOICES = ("auto", "float32", "float16", "bfloat16")
LOAD_FORMAT_CHOICES = ("auto", "dummy", "gguf", "safetensors")
QUANTIZATION_CHOICES = (None, "fp8")
LM_HEAD_QUANTIZATION_CHOICES = ("auto", "none", "fp8", "fp8_rescored")
KV_CACHE_DTYPE_CHOICES = ("auto", "fp8", "fp8_e4m3")
ATTENTION_BACKEND_CHOICES = (None, "triton", "flash_attn", "cpu")


@dataclass
class ModelConfig:
    model: str | None = None
    """HF directory, GGUF file or None for the embedded default model (SmolLM2-135M-Instruct)."""
    tokenizer: str | None = None
    """Tokenizer directory; defaults to the model's."""
    dtype: str = "auto"
    """Weight/activation dtype: auto picks float32 on CPU and bfloat16 on CUDA."""
    max_model_len: int | None = None
    """Context length (prompt + output); None takes the model's max_position_embeddings."""
    seed: int = 0
    """Seed of the global RNG (dummy weights, unseeded sampling)."""
    load_format: str = "auto"
    """auto (HF dir or GGUF by path), dummy (random weights of the real config), gguf, safetensors."""
    max_logprobs: int = 20
    """Largest `logprobs` / `prompt_logprobs` a request may ask for."""
    served_model_name: str | None = None
    """Name clients use for the model; defaults to the model path's basename."""
    quantization: str | None = None
    """None: weights as stored (an FP8 checkpoint's `quantization_config` is still honoured).
    "fp8": quantize a bf16/fp16 checkpoint's linear layers to FP8 e4m3 at load (per-channel weight
    scales, dynamic per-token activation scales)."""
    lm_head_quantization: str = "auto"
    """The LM head's weight when the linear layers are FP8 (the head otherwise stays in the model
    dtype). "none": in the model dtype, as vLLM keeps it. "fp8_rescored": an e4m3 copy (one scale
    per vocabulary row) scores the vocabulary at decode sizes (up to 16 rows), then the 4 largest
    logits of every strided 1024-token slice (tokens c, c + S, c + 2S, ...) are recomputed
    against the model-dtype weight: the likely tokens get the model-dtype logits (greedy picks
    its token unless five of one slice sit within the FP8 error of each other), the tail FP8
    ones (prompt logprobs always come from the model-dtype weight). Half the head's bytes are
    read (Llama-3-8B: 0.53 GB less a step; FP8 batch 1 on the H200 2.57-2.62 -> 2.52 ms) for a
    byte a weight more memory (0.53 GB). "fp8": the head quantized as the FP8 layers are
    (per-token activations too), its high-precision weight dropped: the least memory and bytes,
    every logit with FP8 error. "auto": "fp8_rescored" on CUDA with FP8 linear layers
    (quantization="fp8" or an FP8 checkpoint) and an LMHead whose vocabulary is a multiple of
    16, else "none"."""
    generation_config: str = "auto"
    """"auto": the model's generation_config.json gives the EOS ids to stop on and the default
    sampling of requests that leave it unset; "vllm": the engine's defaults only (the EOS ids
    still count); or a folder whose generation_config.json is read instead
    (models/generation_config.py)."""

    def verify(self) -> None:
        if self.dtype not in DTYPE_CHOICES:
            raise ValueError(f"dtype must be one of {DTYPE_CHOICES}, got {self.dtype!r}")
        if self.load_format not in LOAD_FORMAT_CHOICES:
            raise ValueError(
                f"load_format must be one of {LOAD_FORMAT_CHOICES}, got {self.load_format!r}"
            )
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {self.max_model_len}")
        if self.max_logprobs < 0:
            raise ValueError(f"max_logprobs must be >= 0, got {self.max_logprobs}")
        if self.quantization not in QUANTIZATION_CHOICES:
            raise ValueError(
                f"quantization must be one of {QUANTIZATION_CHOICES}, got {self.quantization!r}"
            )
        check_lm_head_quantization(self.lm_head_quantization)
        if self.generation_config not in ("auto", "vllm"):
            from v1_engine.models.generation_config import generation_config_folder

            generation_config_folder(self.generation_config, "")


def check_lm_head_quantization(choice: str) -> None:
    """ValueError naming ModelConfig.lm_head_quantization and its choices unless `choice` is one."""
    if choice not in LM_HEAD_QUANTIZATION_CHOICES:
        raise ValueError(
            f"lm_head_quantization must be one of {LM_HEAD_QUANTIZATION_CHOICES}, got {choice!r}"
        )


def default_block_size(hf_config: Any) -> int:
    """Tokens per KV-cache block when none is asked for: 64 for a model with a latent (MLA)
    cache, whose decode kernel then reads each step's tokens from one block (82% of the H200's
    HBM bandwidth at 64 x 4k against 68% with 16-token blocks; benchmarks/RESULTS.md), else 16."""
    return 64 if getattr(hf_config, "kv_lora_rank", None) else 16


@dataclass
class CacheConfig:
    block_size: int | None = None
    """Tokens per KV-cache block; None picks the model's default (`default_block_size`: 64 for
    DeepSeek's latent cache, else 16) once its config is read."""
    num_kv_blocks: int | None = None
    """Blocks in the KV pool; None sizes the pool from memory (gpu_memory_utilization on CUDA,
    cpu_kv_cache_bytes on CPU)."""
    enable_prefix_caching: bool = True
    """Reuse KV blocks across requests that share a prompt prefix."""
    gpu_memory_utilization: float = 0.9
    """Fraction of device memory the engine may use (weights + activations + KV cache)."""
    cpu_kv_cache_bytes: int = 1 << 30
    """KV-cache budget on CPU when num_kv_blocks is None."""
    kv_cache_dtype: str = "auto"
    """KV-cache dtype: auto follows the model dtype; fp8 (= fp8_e4m3) stores K/V in e4m3 with
    per-layer scales, halving the cache's bytes."""
    attention_backend: str | None = None
    """Which backend reads the paged cache: None picks (Triton on CUDA, the PyTorch reference on
    CPU, unless $V1ENGINE_ATTENTION_BACKEND says otherwise); "flash_attn" needs the optional
    vllm_flash_attn package, a float16/bfloat16 model, kv_cache_dtype "auto" and a block_size
    that is a multiple of 16."""

    def verify(self) -> None:
        if self.block_size is not None and self.block_size not in (1, 2, 4, 8, 16, 32, 64, 128):
            raise ValueError(
                f"block_size must be a power of two in [1, 128], got {self.block_size}"
            )
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be >= 1, got {self.num_kv_blocks}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}"
            )
        if self.kv_cache_dtype not in KV_CACHE_DTYPE_CHOICES:
            raise ValueError(
                f"kv_cache_dtype must be one of {KV_CACHE_DTYPE_CHOICES}, "
                f"got {self.kv_cache_dtype!r}"
            )
        if self.attention_backend not in ATTENTION_BACKEND_CHOICES:
            raise ValueError(
                f"attention_backend must be one of {ATTENTION_BACKEND_CHOICES}, "
                f"got {self.attention_backend!r}"
            )
        if self.attention_backend == "flash_attn" and self.kv_cache_dtype != "auto":
            raise ValueError(
                f"kv_cache_dtype must be 'auto' with attention_backend 'flash_attn', "
                f"got {self.kv_cache_dtype!r}"
            )
        if self.attention_backend == "flash_attn" and (self.block_size or 16) % 16:
            raise ValueError(
                f"block_size must be a multiple of 16 with attention_backend 'flash_attn', "
                f"got {self.block_size}"
            )


SCHEDULING_POLICIES = ("fcfs", "priority")

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
"""The server's log lines (the engine core process marks its own with [core])."""


@dataclass
class SchedulerConfig:
    max_num_batched_tokens: int | None = None
    """Token budget of one step; None picks max(2048, max_model_len) (no chunking of one prompt)
    capped at 8192, so long prompts are chunked."""
    max_num_seqs: int | None = None
    """Most requests running at once; None picks 256."""
    enable_chunked_prefill: bool = True
    """Split prompts longer than the remaining budget across steps."""
    async_scheduling: bool | None = None
    """Schedule step N+1 while step N runs; None turns it on where supported."""
    scheduling_policy: str = "fcfs"
    """"fcfs": requests run in arrival order. "priority": by each request's `priority` (lower
    first, ties by arrival), both in admission and in preemption (the lowest-priority running
    request gives its blocks up first)."""

    def verify(self) -> None:
        for name in ("max_num_batched_tokens", "max_num_seqs"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(
                f"scheduling_policy must be one of {SCHEDULING_POLICIES}, "
                f"got {self.scheduling_policy!r}"
            )


@dataclass
class ParallelConfig:
    tensor_parallel_size: int = 1
    """Only 1 is supported for now."""

    def verify(self) -> None:
        if self.tensor_parallel_size != 1:
            raise ValueError(f"tensor_parallel_size must be 1, got {self.tensor_parallel_size}")


COMPILATION_LEVELS = (0, 1, 2)
FUSION_PASSES = (
    "add_rms_norm",
    "silu_and_mul",
    "rms_norm_fp8_quant",
    "silu_and_mul_fp8_quant",
    "fp8_gated_mlp",
    "fp8_norm_linear",
    "fp8_dynamic_linear",
    "skinny_silu_mul",
    "skinny_norm_linear",
    "fused_mlp",
    "skinny_add_rms_norm",
    "rope_kv_cache",
)
OPT_IN_FUSION_PASSES = (
    "skinny_add_rms_norm",
    "fused_mlp",
    "skinny_norm_linear",
)
"""Passes applied only when `fusion_passes` names them: measured slower than the unfused ops
(the norm in the last tile of the GEMM: batch 1 4.50 vs 4.33 ms a step, benchmarks/RESULTS.md,
"Skinny GEMM epilogues"; the persistent fused MLP: 5-7% slower than the chain at M 16-64,
"A decoder layer's MLP in one persistent kernel", and fused_mlp's op runs its kernel only
where kernels/triton_mlp.TUNED_LAUNCH, empty, holds a launch). fp8_dynamic_linear (o_proj on
the bf16 attention output where the "weight_only" table holds the shape: M = 1 for
Llama-3-8B) is on: 3.297 / 3.297 / 3.295 -> 3.285 ms a step at FP8 batch 1 on an H100, three
alternating rounds of one process each (RESULTS.md, "The fused split-KV merge + FP8 o_proj
measured"), and it drops the rounding of o_proj's input. fp8_gated_mlp is on: 3.373 -> 3.287
ms there. fp8_norm_linear is on too (each layer's two add + RMSNorm kernels folded into the FP8
GEMM after them where the "norm" / "norm_gated" tables hold the shape, M = 1 for Llama-3-8B):
3.372 -> 3.297 ms at FP8 batch 1 on an H100 ("The add + RMSNorm folded into the FP8 GEMM
measured"). skinny_norm_linear (the same fold for the bf16 skinny GEMMs: qkv, gate_up, the LM
head) measured slower at its table launches (bf16 batch 1 5.50 -> 5.99 ms, 64 x 1k 9.26 -> 14.0
on an H100: "The bf16 norm fold measured"), so kernels/skinny_epilogues.NORM_IN_M_BUCKETS is
empty."""


@dataclass
class CompilationConfig:
    level: int | None = None
    """0: eager. 1: torch.compile (the graph split at the attention ops, each piece compiled by
    Inductor) plus, on CUDA, piecewise CUDA graphs for mixed batches. 2: level 1 plus full-graph
    capture of uniform decode steps on CUDA (on CPU, 2 behaves like 1). None picks 2 on CUDA and 0
    on CPU, where compiling costs more start-up time than it saves."""
    enforce_eager: bool = False
    """Run the model eagerly whatever the level: no torch.compile, no CUDA graphs."""
    cudagraph_capture_sizes: list[int] | None = None
    """Batch sizes (tokens of a piecewise graph, requests of a decode graph) captured in CUDA
    graphs; a batch is padded up to the next one. None derives them (see capture_sizes)."""
    piecewise_capture_sizes: list[int] | None = None
    """Token counts piecewise graphs are captured for. None: cudagraph_capture_sizes when that is
    set; else at level 2, where full decode graphs take every uniform decode step, piecewise
    graphs serve only prefills and mixed batches, whose padding costs little, so a coarse ladder
    (see piecewise_sizes) with a third of the captures; at level 1, where they serve decode steps
    too, the derived capture sizes."""
    max_cudagraph_capture_size: int = 512
    """Largest batch a CUDA graph is captured for (capped by max_num_seqs for decode graphs, by
    max_num_batched_tokens for piecewise graphs)."""
    fusion_passes: list[str] | None = None
    """Graph rewrites applied before Inductor, from FUSION_PASSES. None picks every pass but
    OPT_IN_FUSION_PASSES on CUDA (each fused op runs one Triton kernel there; the FP8 ones match
    only FP8 models) and none on the CPU (where the fused ops would run their unfused
    references)."""
    piecewise_cudagraphs: bool = True
    """Capture piecewise CUDA graphs (level >= 1 on CUDA) for steps of up to the largest capture
    size in tokens that are not uniform decode steps (prefills, mixed batches): the compiled
    pieces replay as graphs and only attention runs eagerly between them."""
    verify_cudagraphs: bool = True
    """With speculative decoding at level 2 on CUDA (Triton attention, no MLA): capture
    whole-forward graphs of verify steps (each request at most 1 + drafts tokens), as decode steps
    have, instead of running them through the piecewise graphs (compile/cuda_graphs.py
    `VarlenCudaGraphs`). False: the piecewise graphs and eager attention for verify steps."""

    @classmethod
    def from_value(
        cls, value: int | dict[str, Any] | CompilationConfig | None
    ) -> CompilationConfig:
        """The `compilation_config` argument: a level (like -O1), a dict of fields, a config, or
        None for the device's default level."""
        if value is None:
            return cls()
        if isinstance(value, CompilationConfig):
            return value
        if isinstance(value, bool) or not isinstance(value, (int, dict)):
            raise ValueError(  # noqa: TRY004 (user input: ValueError naming the field)
                f"compilation_config must be an int level in {COMPILATION_LEVELS} or a dict, "
                f"got {value!r}"
            )
        if isinstance(value, int):
            return cls(level=value)
        return _from_fields(cls, value, "compilation_config")

    def effective_fusion_passes(self, device_type: str = "cpu") -> list[str]:
        """The fusion passes applied on `device_type`, in FUSION_PASSES order when derived."""
        if self.fusion_passes is not None:
            return list(self.fusion_passes)
        if device_type != "cuda":
            return []
        return [name for name in FUSION_PASSES if name not in OPT_IN_FUSION_PASSES]

    def effective_level(self, device_type: str = "cpu") -> int:
        """The level the model runner applies on `device_type`: 0 when enforce_eager is set."""
        if self.enforce_eager:
            return 0
        if self.level is None:
            return 2 if device_type == "cuda" else 0
        return self.level

    def capture_sizes(self, limit: int) -> list[int]:
        """Batch sizes CUDA graphs are captured for, ascending: the configured list, or 1, 2, 4,
        then every 8 up to 256 and every 16 beyond, up to max_cudagraph_capture_size; both capped
        by `limit`, the largest batch the graphs can see (max_num_seqs requests for decode
        graphs, max_num_batched_tokens tokens for piecewise graphs)."""
        cap = min(self.max_cudagraph_capture_size, limit)
        if self.cudagraph_capture_sizes is not None:
            return sorted({s for s in self.cudagraph_capture_sizes if s <= cap})
        sizes = [1, 2, 4, *range(8, 256, 8), *range(256, cap + 1, 16)]
        return sorted({s for s in sizes if s <= cap} | {cap})

    def piecewise_sizes(self, limit: int, level: int) -> list[int]:
        """Token counts piecewise graphs are captured for at `level`, ascending, capped like
        capture_sizes: piecewise_capture_sizes, else cudagraph_capture_sizes; else at level 2
        the ladder 1, 2, 4, 6, 8, 12, 16, 24, 32, 48, ... (each power of two and 1.5x it: a step
        pads by at most a third from 4 tokens up) up to max_cudagraph_capture_size; at level 1
        capture_sizes(limit)."""
        cap = min(self.max_cudagraph_capture_size, limit)
        if self.piecewise_capture_sizes is not None:
            return sorted({s for s in self.piecewise_capture_sizes if s <= cap})
        if level < 2 or self.cudagraph_capture_sizes is not None:
            return self.capture_sizes(limit)
        ladder, power = {1, 2}, 4
        while power <= cap:
            ladder |= {power, power * 3 // 2}
            power *= 2
        return sorted({s for s in ladder if s <= cap} | {cap})

    def verify(self) -> None:
        if self.level is not None and self.level not in COMPILATION_LEVELS:
            raise ValueError(
                f"compilation level must be one of {COMPILATION_LEVELS}, got {self.level!r}"
            )
        if self.max_cudagraph_capture_size < 1:
            raise ValueError(
                f"max_cudagraph_capture_size must be >= 1, got {self.max_cudagraph_capture_size}"
            )
        for name in ("cudagraph_capture_sizes", "piecewise_capture_sizes"):
            sizes = getattr(self, name)
            if sizes is not None and any(not isinstance(s, int) or s < 1 for s in sizes):
                raise ValueError(f"{name} must be positive ints, got {sizes!r}")
        unknown = [p for p in self.fusion_passes or () if p not in FUSION_PASSES]
        if unknown:
            raise ValueError(f"fusion_passes must be among {FUSION_PASSES}, got {unknown}")
        repeated = sorted({p for p in self.fusion_passes or () if self.fusion_passes.count(p) > 1})
        if repeated:
            raise ValueError(f"fusion_passes must name each pass once, got {repeated} repeated")


SPECULATIVE_METHODS = (None, "ngram")
MAX_SPECULATIVE_TOKENS = 16


@dataclass
class SpeculativeConfig:
    """Speculative decoding (vLLM's `speculative_config`): each step proposes draft tokens per
    request, the next step verifies them all in one forward and keeps the longest prefix the
    target model agrees with, plus the token it samples after it. Output follows the target
    model's distribution exactly (greedy output is unchanged)."""

    method: str | None = None
    """"ngram": prompt lookup, drafts copied from where the request's newest tokens occurred
    before in its own prompt or output (no draft model). None disables speculative decoding."""
    num_speculative_tokens: int | None = None
    """Draft tokens proposed per request and step (1..16); required with a method."""
    prompt_lookup_max: int = 4
    """ngram: the longest suffix of the request's tokens looked up (tried first)."""
    prompt_lookup_min: int = 2
    """ngram: the shortest suffix looked up; a shorter match proposes nothing."""
    draft_backoff: int = 8
    """A request whose drafts keep failing drafts less: after m >= 2 verify steps in a row that
    kept none of its drafts, it skips the next min(2^(m-2), draft_backoff) steps' drafts (any
    kept draft resets it). 0 drafts every step. The output is the same either way."""

    @property
    def enabled(self) -> bool:
        return self.method is not None

    @classmethod
    def from_value(cls, value: dict[str, Any] | SpeculativeConfig | None) -> SpeculativeConfig:
        """The `speculative_config` argument: a dict of fields, a config, or None (off)."""
        if value is None:
            return cls()
        if isinstance(value, SpeculativeConfig):
            return value
        if not isinstance(value, dict):
            raise ValueError(  # noqa: TRY004 (user input: ValueError naming the field)
                f"speculative_config must be a dict of fields or None, got {value!r}"
            )
        return _from_fields(cls, value, "speculative_config")

    def verify(self) -> None:
        if self.method not in SPECULATIVE_METHODS:
            raise ValueError(
                f"speculative_config.method must be one of {SPECULATIVE_METHODS}, "
                f"got {self.method!r}"
            )
        k = self.num_speculative_tokens
        if self.method is None:
            if k:
                raise ValueError(
                    "speculative_config.num_speculative_tokens needs a method "
                    f"(one of {SPECULATIVE_METHODS[1:]})"
                )
            return
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(
                "speculative_config.num_speculative_tokens must be an int in "
                f"[1, {MAX_SPECULATIVE_TOKENS}], got {k!r}"
            )
        lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
        for name, n in (("prompt_lookup_min", lo), ("prompt_lookup_max", hi)):
            if isinstance(n, bool) or not isinstance(n, int) or n < 1:
                raise ValueError(f"speculative_config.{name} must be an int >= 1, got {n!r}")
        if lo > hi:
            raise ValueError(
                f"speculative_config.prompt_lookup_min ({lo}) must be <= prompt_lookup_max ({hi})"
            )
        b = self.draft_backoff
        if isinstance(b, bool) or not isinstance(b, int) or b < 0:
            raise ValueError(f"speculative_config.draft_backoff must be an int >= 0, got {b!r}")


def _from_fields(cls: type, value: dict[str, Any], name: str) -> Any:
    """A config section from a dict of its fields; unknown keys raise, naming the allowed ones."""
    allowed = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(value) - allowed)
    if unknown:
        raise ValueError(f"unknown {name} keys {unknown}; allowed: {', '.join(sorted(allowed))}")
    return cls(**value)


@dataclass
class EngineConfig:
    model_config: ModelConfig = field(default_factory=ModelConfig)
    cache_config: CacheConfig = field(default_factory=CacheConfig)
    scheduler_config: SchedulerConfig = field(default_factory=SchedulerConfig)
    parallel_config: ParallelConfig = field(default_factory=ParallelConfig)
    compilation_config: CompilationConfig = field(default_factory=CompilationConfig)
    speculative_config: SpeculativeConfig = field(default_factory=SpeculativeConfig)
    device: str = "auto"
    """auto picks cuda when available, else cpu."""

    _SECTIONS = (
        "model_config",
        "cache_config",
        "scheduler_config",
        "parallel_config",
        "compilation_config",
    )
    """Sections whose fields are flat keyword arguments; `speculative_config` comes whole."""

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> EngineConfig:
        """Route flat keyword arguments (vLLM's names) to their section; unknown names raise."""
        sections: dict[str, dict[str, Any]] = {name: {} for name in cls._SECTIONS}
        owners = {
            f.name: section
            for section in cls._SECTIONS
            for f in dataclasses.fields(cls.__dataclass_fields__[section].default_factory())
        }
        device = kwargs.pop("device", "auto")
        compilation = CompilationConfig.from_value(kwargs.pop("compilation_config", None))
        speculative = SpeculativeConfig.from_value(kwargs.pop("speculative_config", None))
        for key, value in kwargs.items():
            if key not in owners:
                extra = ["compilation_config", "device", "speculative_config"]
                allowed = ", ".join(sorted(owners) + extra)
                raise ValueError(f"unknown engine argument {key!r}; allowed: {allowed}")
            sections[owners[key]][key] = value
        config = cls(
            model_config=ModelConfig(**sections["model_config"]),
            cache_config=CacheConfig(**sections["cache_config"]),
            scheduler_config=SchedulerConfig(**sections["scheduler_config"]),
            parallel_config=ParallelConfig(**sections["parallel_config"]),
            compilation_config=dataclasses.replace(compilation, **sections["compilation_config"]),
            speculative_config=speculative,
            device=device,
        )
        config.verify()
        return config

    def verify(self) -> None:
        for name in self._SECTIONS:
            getattr(self, name).verify()
        self.speculative_config.verify()
        if self.speculative_config.enabled and self.scheduler_config.async_scheduling:
            raise ValueError(
                "async_scheduling cannot be combined with speculative_config: the next step's "
                "drafts depend on how many of this step's were accepted"
            )
        if self.device not in ("auto", "cpu", "cuda"):
            raise ValueError(f"device must be one of ('auto', 'cpu', 'cuda'), got {self.device!r}")

    def resolve_device(self) -> str:
        if self.device != "auto":
            return self.device
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"

    def resolve_model_facts(self, max_position_embeddings: int, block_size: int = 16) -> None:
        """Fill in the values that depend on the model, once its config is known (`block_size`:
        the model's default, taken when none was asked for)."""
        mc, sc = self.model_config, self.scheduler_config
        if self.cache_config.block_size is None:
            self.cache_config.block_size = block_size
        if mc.max_model_len is None:
            mc.max_model_len = max_position_embeddings
        elif mc.max_model_len > max_position_embeddings:
            raise ValueError(
                f"max_model_len must be <= the model's max_position_embeddings "
                f"({max_position_embeddings}), got {mc.max_model_len}"
            )
        if sc.max_num_seqs is None:
            sc.max_num_seqs = 256
        if sc.max_num_batched_tokens is None:
            sc.max_num_batched_tokens = min(max(2048, mc.max_model_len), 8192)
        if not sc.enable_chunked_prefill and sc.max_num_batched_tokens < mc.max_model_len:
            raise ValueError(
                f"max_num_batched_tokens must be >= max_model_len ({mc.max_model_len}) "
                f"when chunked prefill is disabled, got {sc.max_num_batched_tokens}"
            )

    def compute_hash(self) -> str:
        payload = json.dumps(dataclasses.asdict(self), sort_keys=True, default=str)
        return hashlib.sha256(payload.encode()).hexdigest()[:16]
