"""ModelRunner: turns a SchedulerOutput into model inputs, runs the model, samples.

It owns the model, the KV cache tensors and the persistent InputBatch; it knows nothing of the
scheduler beyond the SchedulerOutput / ModelRunnerOutput contract.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from concurrent.futures import Future

import numpy as np
import torch

from v1_engine.attention.selector import get_attn_backend
from v1_engine.config import EngineConfig
from v1_engine.core.sched_output import SchedulerOutput
from v1_engine.forward_context import set_forward_context
from v1_engine.models.loader import get_model, load_hf_config
from v1_engine.protocol import LogprobsLists
from v1_engine.sample.logprobs import compute_prompt_logprobs
from v1_engine.sample.metadata import SamplingMetadata
from v1_engine.sample.sampler import Sampler
from v1_engine.sampling_params import SamplingParams
from v1_engine.spec_decode.ngram import DraftBackoff, NgramProposer
from v1_engine.spec_decode.verify import accept_drafts
from v1_engine.structured_output import (
    GrammarCompilerService,
    RequestGrammar,
    StructuredOutputsParams,
)
from v1_engine.worker.cuda_graph_plan import CudaGraphPlan
from v1_engine.worker.host_staging import HostStaging
from v1_engine.worker.input_batch import CachedRequestState, InputBatch
from v1_engine.worker.kv_sizing import (
    kv_bytes_per_block,
    make_dummy_forward,
    num_kv_blocks_for_budget,
    profile_kv_budget,
    resolve_kv_cache_dtype,
)
from v1_engine.worker.sampling_rows import sampling_metadata
from v1_engine.worker.step_inputs import StepInputs, prepare_step_inputs
from v1_engine.worker.step_output import PendingTokens, StepOutput, copy_to_host

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return _DTYPES[name]


class ModelRunner:
    def __init__(self, config: EngineConfig, device: torch.device) -> None:
        self.config = config
        self.device = device
        mc = config.model_config
        self.dtype = resolve_dtype(mc.dtype, device)
        self.hf_config = load_hf_config(mc.model)
        self.vocab_size = self.hf_config.vocab_size
        self.block_size = config.cache_config.block_size
        self.max_model_len = mc.max_model_len
        start = time.perf_counter()
        self.model = get_model(
            self.hf_config,
            mc.model,
            dtype=self.dtype,
            device=device,
            load_format=mc.load_format,
            seed=mc.seed,
            quantization=mc.quantization,
            lm_head_quantization=mc.lm_head_quantization,
        )
        self.kv_cache_dtype = resolve_kv_cache_dtype(
            config.cache_config, self.dtype, self.model.attention_layers()
        )
        self.startup_s: dict[str, float] = {"weight load": time.perf_counter() - start}
        """Startup breakdown in seconds, logged once the forward is ready."""
        self._forward: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = self.model
        """The model forward as steps call it: the model itself, or its compiled form."""
        self.attn_backend = get_attn_backend(device, config.cache_config.attention_backend)
        self.sampler = Sampler()
        spec = config.speculative_config
        self._proposer: NgramProposer | None = None
        """Speculative decoding's drafter; with it each step is settled at launch (the next
        step's drafts depend on which of this step's were accepted)."""
        if spec.enabled:
            assert spec.num_speculative_tokens is not None
            self._proposer = NgramProposer(
                spec.num_speculative_tokens, spec.prompt_lookup_min, spec.prompt_lookup_max
            )
        self._grammar_compiler: GrammarCompilerService | None = None
        """Compiles structured-output specs; made at the first request that has one."""
        self.input_batch = InputBatch(
            config.scheduler_config.max_num_seqs, self.max_model_len, self.block_size
        )
        self.kv_caches: list[torch.Tensor] = []
        self._pending: PendingTokens | None = None
        """Tokens sampled by the last step, not yet written into the host-side batch."""
        self._staging = HostStaging(device)
        self.graphs = CudaGraphPlan(
            config,
            self.model,
            self.attn_backend,
            device,
            self.dtype,
            self.hf_config.hidden_size,
            self.vocab_size,
        )
        """The CUDA graphs (decode, verify, piecewise), captured after the KV cache."""

    # ---- KV cache -------------------------------------------------------------------------

    def determine_num_kv_blocks(self) -> int:
        cc = self.config.cache_config
        layers = self.model.attention_layers()
        per_block = kv_bytes_per_block(layers, self.block_size, self.kv_cache_dtype)
        if cc.num_kv_blocks is not None:
            return cc.num_kv_blocks
        if self.device.type == "cuda":
            start = time.perf_counter()
            num_blocks = self._profile_num_kv_blocks()
            self.startup_s["memory profiling"] = time.perf_counter() - start
            return num_blocks
        budget = cc.cpu_kv_cache_bytes
        num_blocks = num_kv_blocks_for_budget(budget, per_block)
        if num_blocks * self.block_size < self.max_model_len:
            raise ValueError(
                f"the KV cache budget holds {num_blocks * self.block_size} tokens, fewer than "
                f"max_model_len ({self.max_model_len}): lower max_model_len or raise the budget"
            )
        return num_blocks

    def _profile_num_kv_blocks(self) -> int:
        """Run a forward at the full token budget, then give the KV pool what is left of
        gpu_memory_utilization after weights, peak activations and non-torch memory."""
        sc, cc = self.config.scheduler_config, self.config.cache_config
        dummy_forward = make_dummy_forward(
            self.model,
            self.attn_backend,
            sc.max_num_batched_tokens,
            sc.max_num_seqs,
            self.vocab_size,
            self.device,
            max_positions=self.max_model_len,
        )
        num_blocks, self.kv_report = profile_kv_budget(
            self.model,
            dummy_forward,
            block_size=self.block_size,
            kv_dtype=self.kv_cache_dtype,
            gpu_memory_utilization=cc.gpu_memory_utilization,
            device=self.device,
            profiled_tokens=sc.max_num_batched_tokens,
            max_model_len=self.max_model_len,
        )
        reserve = self.graphs.reserve_bytes()
        if reserve:
            per_block = self.kv_report.bytes_per_block
            num_blocks -= -(-reserve // per_block)
            if num_blocks * self.block_size < self.max_model_len:
                raise ValueError(
                    f"after reserving {reserve / 2**30:.2f} GiB for CUDA graphs the KV cache holds "
                    f"{num_blocks * self.block_size} tokens, fewer than max_model_len "
                    f"({self.max_model_len}): lower max_model_len or max_cudagraph_capture_size, "
                    "or raise gpu_memory_utilization"
                )
            logger.info(
                "KV cache: %d blocks after reserving %.2f GiB for CUDA graphs",
                num_blocks,
                reserve / 2**30,
            )
        return num_blocks

    def initialize_kv_cache(self, num_blocks: int) -> None:
        start = time.perf_counter()
        self.kv_caches = []
        for layer in self.model.attention_layers():
            shape = layer.kv_cache_shape(num_blocks, self.block_size)
            cache = torch.zeros(shape, dtype=self.kv_cache_dtype, device=self.device)
            layer.kv_cache = cache
            self.kv_caches.append(cache)
        logger.info(
            "KV cache: %d blocks of %d tokens (%.1f MiB)",
            num_blocks,
            self.block_size,
            sum(c.numel() * c.element_size() for c in self.kv_caches) / 2**20,
        )
        self.startup_s["KV allocation"] = time.perf_counter() - start
        self._compile_forward()
        start = time.perf_counter()
        if self.graphs.capture(self._forward):
            self.startup_s["graph capture"] = time.perf_counter() - start
        logger.info(
            "startup breakdown: %s", ", ".join(f"{k} {v:.2f} s" for k, v in self.startup_s.items())
        )

    def _compile_forward(self) -> None:
        """At compilation level >= 1, trace and compile the forward now, on a dummy batch, so
        the first request pays nothing and serving never compiles."""
        cc = self.config.compilation_config
        if cc.effective_level(self.device.type) == 0:
            return
        from compile import build_compiled_forward
        from compile.cache import use_compile_cache

        cache_dir = use_compile_cache(self._compile_cache_parts())
        compiled = build_compiled_forward(
            self.model,
            cc,
            cudagraphs=bool(self.graphs.sizes),
            device_type=self.device.type,
            cache_dir=cache_dir,
        )
        if compiled.backend.passes:
            logger.info("fusion passes: %s", ", ".join(n for n, _ in compiled.backend.passes))
        num_tokens = min(16, self.config.scheduler_config.max_num_batched_tokens)
        with torch.inference_mode():
            # Created like a step's inputs (inference tensors): Dynamo guards on it.
            input_ids = torch.zeros(num_tokens, dtype=torch.int64, device=self.device)
            positions = torch.arange(num_tokens, device=self.device)
            with set_forward_context(None, self.attn_backend, self.model.attention_layers()):
                compiled(input_ids, positions)
        self.startup_s["Dynamo"] = compiled.dynamo_s  # loading the saved trace on a warm start
        self.startup_s["Inductor"] = compiled.stats.inductor_s
        self._forward = compiled

    def _compile_cache_parts(self) -> dict[str, object]:
        """What the compiled code depends on besides torch, triton and our source."""
        device = self.device.type
        if device == "cuda":
            major, minor = torch.cuda.get_device_capability(self.device)
            device += f"-sm{major}{minor}"
        return {
            "model": self.hf_config.to_dict(),
            "dtype": str(self.dtype),
            "compilation": dataclasses.asdict(self.config.compilation_config),
            "fusion_passes": self.config.compilation_config.effective_fusion_passes(
                self.device.type
            ),
            "quantization": self.config.model_config.quantization,
            # The head runs outside the compiled forward today; keyed in case it moves in.
            "lm_head_quantization": self.config.model_config.lm_head_quantization,
            "max_num_batched_tokens": self.config.scheduler_config.max_num_batched_tokens,
            "device": device,
        }

    # ---- one step ------------------------------------------------------------------------

    def update_states(self, so: SchedulerOutput) -> None:
        batch = self.input_batch
        for req_id in so.finished_req_ids:
            batch.remove_request(req_id)
        for new in so.scheduled_new_reqs:
            batch.remove_request(new.req_id)
            params = new.sampling_params
            generator = None
            if params.seed is not None:
                generator = torch.Generator(device=self.device)
                generator.manual_seed(params.seed)
            state = CachedRequestState(
                req_id=new.req_id,
                prompt_token_ids=new.prompt_token_ids,
                output_token_ids=list(new.output_token_ids),
                sampling_params=params,
                generator=generator,
                eos_token_id=new.eos_token_id,
                grammar=self._request_grammar(params, new.eos_token_id),
            )
            batch.add_request(state, new.block_ids, new.num_computed_tokens)
        for cached in so.scheduled_cached_reqs:
            row = batch.req_id_to_row[cached.req_id]
            assert batch.num_computed_tokens[row] == cached.num_computed_tokens, cached.req_id
            batch.append_blocks(row, cached.new_block_ids)
        for req_id, drafts in so.scheduled_spec_token_ids.items():
            batch.write_drafts(req_id, drafts)

    def _prepare_inputs(self, so: SchedulerOutput, req_ids: list[str]) -> StepInputs:
        return prepare_step_inputs(
            self.input_batch, so, req_ids, self.block_size, self._staging, self._pending
        )

    @torch.inference_mode()
    def execute_model(self, so: SchedulerOutput) -> StepOutput:
        """Launch one step; its sampled tokens stay on the device until `get_output()`.

        The previous step's tokens are fed to this step's inputs on the device, so the
        scheduler may plan this step before it has seen them (async scheduling).
        """
        self.update_states(so)
        if so.is_empty:
            self._resolve_pending()
            return StepOutput(req_ids=[], sampled=None)
        batch = self.input_batch
        req_ids = list(so.num_scheduled_tokens)
        inputs = self._prepare_inputs(so, req_ids)
        rows, cu, sample_idx = inputs.rows, inputs.cu, inputs.sample_idx
        hidden = self._run_forward(inputs)
        prompt_logprobs = self._prompt_logprobs(req_ids, rows, cu, hidden)
        batch.num_computed_tokens[rows] = inputs.seq_lens
        # Penalties and min_tokens need the previous step's tokens on the host: by now the
        # device has long finished that step, so this wait costs nothing on a GPU.
        self._resolve_pending()

        if not len(sample_idx):
            return StepOutput(req_ids=req_ids, sampled=None, prompt_logprobs=prompt_logprobs)
        sample_req_ids = [req_ids[i] for i in sample_idx]
        if inputs.logits_prefix is not None:
            sampled_hidden = hidden[: inputs.logits_prefix]
        else:
            sampled_hidden = hidden[inputs.logits_idx]
        logits = self.model.compute_logits(sampled_hidden)
        if self._proposer is not None:
            return self._verify_and_propose(so, req_ids, sample_req_ids, logits, prompt_logprobs)
        states = [batch.states[r] for r in sample_req_ids]
        out = self.sampler(logits, self._sampling_metadata(states))
        pending = PendingTokens(
            req_ids=sample_req_ids,
            positions=[batch.add_placeholder(int(rows[i])) for i in sample_idx],
            device_ids=out.sampled_token_ids,
            host_ids=copy_to_host(out.sampled_token_ids),
        )
        self._pending = pending
        return StepOutput(
            req_ids=req_ids,
            sampled=pending,
            logprobs=out.logprobs,
            num_logprobs=[batch.states[r].sampling_params.logprobs for r in sample_req_ids],
            prompt_logprobs=prompt_logprobs,
        )

    def _verify_and_propose(
        self,
        so: SchedulerOutput,
        req_ids: list[str],
        sample_req_ids: list[str],
        logits: torch.Tensor,
        prompt_logprobs: dict[str, LogprobsLists],
    ) -> StepOutput:
        """Speculative decoding: sample every position of each request's drafts, keep what the
        drafts got right (spec_decode/verify.py), settle the batch state and propose the next
        drafts. Settled at once, so the step's tokens are on the host when it returns."""
        batch = self.input_batch
        spec = so.scheduled_spec_token_ids
        states = [batch.states[r] for r in sample_req_ids]
        out = self.sampler(
            logits, self._sampling_metadata(states, [spec.get(r, []) for r in sample_req_ids])
        )
        tokens = out.sampled_token_ids.tolist()  # the step's one wait for the device
        accepted: dict[str, list[int]] = {}
        first_rows: list[int] = []
        next_drafts: dict[str, list[int]] = {}
        start = 0
        for req_id in sample_req_ids:
            drafts = spec.get(req_id, [])
            kept = accept_drafts(tokens[start : start + len(drafts) + 1], drafts)
            first_rows.append(start)
            start += len(drafts) + 1
            row = batch.req_id_to_row[req_id]
            batch.num_computed_tokens[row] -= len(drafts) + 1 - len(kept)
            batch.append_tokens(req_id, kept)
            accepted[req_id] = kept
            state = batch.states[req_id]
            if state.backoff is None:
                state.backoff = DraftBackoff(self.config.speculative_config.draft_backoff)
            state.backoff.record(len(drafts), len(kept) - 1)
            proposal = self._propose(req_id) if state.backoff.allow() else []
            if proposal:
                next_drafts[req_id] = proposal
        return StepOutput(
            req_ids=req_ids,
            sampled=None,
            logprobs=out.logprobs,
            num_logprobs=[batch.states[r].sampling_params.logprobs for r in sample_req_ids],
            prompt_logprobs=prompt_logprobs,
            accepted=accepted,
            first_rows=first_rows,
            spec_token_ids=next_drafts,
        )

    def _propose(self, req_id: str) -> list[int]:
        """Drafts for the request's next step: none past max_tokens or max_model_len, and for a
        grammar-constrained request only those its grammar allows."""
        assert self._proposer is not None
        batch = self.input_batch
        state = batch.states[req_id]
        row = batch.req_id_to_row[req_id]
        num_tokens = int(batch.num_tokens[row])
        room = self.max_model_len - num_tokens - 1
        max_tokens = state.sampling_params.max_tokens
        if max_tokens is not None:
            room = min(room, max_tokens - len(state.output_token_ids) - 1)
        if room < 1:
            return []
        drafts = self._proposer.propose(batch.token_ids[row, :num_tokens], room)
        if state.grammar is not None:
            drafts = state.grammar.valid_prefix(state.output_token_ids, drafts)
        return drafts

    def _run_forward(self, inputs: StepInputs) -> torch.Tensor:
        """Hidden states of the step: a decode graph, a verify graph (each request at most 1 +
        drafts tokens, with speculative decoding), piecewise graphs, or the plain forward.

        The previous step's sampled tokens, still on the device, become this step's inputs
        where this step computes them (a decode step's only token): the decode graph's input
        kernel writes them with the rest; the other paths scatter them into input_ids first."""
        input_ids, positions, metadata = inputs.input_ids, inputs.positions, inputs.metadata
        pending = self._pending
        decode = self.graphs.decode
        if decode is not None and decode.can_run(metadata):
            feed = None
            if inputs.feed_dst is not None:
                assert pending is not None and inputs.feed_rows is not None
                feed = (inputs.feed_rows, pending.device_ids)
            return decode.run(input_ids, positions, metadata, feed)
        if inputs.feed_dst is not None:
            assert pending is not None
            input_ids.index_copy_(
                0, inputs.feed_dst, pending.device_ids.index_select(0, inputs.feed_src)
            )
        verify = self.graphs.verify
        if verify is not None and verify.can_run(metadata):
            return verify.run(input_ids, positions, metadata)
        layers = self.model.attention_layers()
        piecewise = self.graphs.piecewise
        if piecewise is not None and piecewise.can_run(metadata):
            return piecewise.run(input_ids, positions, metadata, self.attn_backend, layers)
        with set_forward_context(metadata, self.attn_backend, layers):
            return self._forward(input_ids, positions)

    def _resolve_pending(self) -> None:
        """Move the previous step's sampled tokens into the host-side batch state."""
        pending, self._pending = self._pending, None
        if pending is None:
            return
        for req_id, position, token_id in zip(
            pending.req_ids, pending.positions, pending.host_tokens()
        ):
            self.input_batch.set_token(req_id, position, token_id)

    def submit_grammar(self, structured: StructuredOutputsParams) -> Future:
        """Start compiling a request's grammar (on a worker thread); equal specs share one."""
        if self._grammar_compiler is None:
            tokenizer = self.config.model_config.tokenizer or self.config.model_config.model
            self._grammar_compiler = GrammarCompilerService(tokenizer, self.vocab_size)
        return self._grammar_compiler.submit(structured)

    def _request_grammar(
        self, params: SamplingParams, eos_token_id: int | None
    ) -> RequestGrammar | None:
        """A new request's matcher (the scheduler admitted it once its grammar compiled)."""
        if params.structured_outputs is None:
            return None
        structured = params.structured_outputs
        return RequestGrammar(
            self.submit_grammar(structured),
            eos_token_id,
            structured.reasoning_end,
            structured.reasoning_start,
        )

    def _sampling_metadata(
        self, states: list[CachedRequestState], drafts: list[list[int]] | None = None
    ) -> SamplingMetadata:
        return sampling_metadata(states, drafts, self.vocab_size, self.device)

    def _prompt_logprobs(
        self, req_ids: list[str], rows: np.ndarray, cu: np.ndarray, hidden: torch.Tensor
    ) -> dict[str, LogprobsLists]:
        """Score the prompt positions of this chunk: position p predicts prompt token p + 1."""
        batch = self.input_batch
        result: dict[str, LogprobsLists] = {}
        for i, req_id in enumerate(req_ids):
            state = batch.states[req_id]
            k = state.sampling_params.prompt_logprobs
            if k is None:
                continue
            start = int(batch.num_computed_tokens[rows[i]])
            end = min(start + int(cu[i + 1] - cu[i]), len(state.prompt_token_ids) - 1)
            if end <= start:
                continue
            h = hidden[int(cu[i]) : int(cu[i]) + end - start]
            logits = self.model.compute_logits(h, exact=True)
            targets = torch.tensor(state.prompt_token_ids[start + 1 : end + 1], device=self.device)
            result[req_id] = compute_prompt_logprobs(logits, targets, k).to_lists()
        return result
