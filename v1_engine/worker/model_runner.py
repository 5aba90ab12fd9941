"""ModelRunner: turns a SchedulerOutput into model inputs, runs the model, samples.

It owns the model, the KV cache tensors and the persistent InputBatch; it knows nothing of the
scheduler beyond the SchedulerOutput / ModelRunnerOutput contract.
"""

from __future__ import annotations

import logging

import numpy as np
import torch

from v1_engine.attention.backend import AttentionMetadata
from v1_engine.attention.selector import get_attn_backend
from v1_engine.config import EngineConfig
from v1_engine.core.sched_output import ModelRunnerOutput, SchedulerOutput
from v1_engine.forward_context import set_forward_context
from v1_engine.models.loader import get_model, load_hf_config
from v1_engine.protocol import LogprobsLists
from v1_engine.sample.logprobs import compute_prompt_logprobs
from v1_engine.sample.metadata import SamplingMetadata
from v1_engine.sample.sampler import Sampler
from v1_engine.worker.input_batch import CachedRequestState, InputBatch
from v1_engine.worker.kv_sizing import kv_bytes_per_block, num_kv_blocks_for_budget

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
        self.model = get_model(
            self.hf_config,
            mc.model,
            dtype=self.dtype,
            device=device,
            load_format=mc.load_format,
            seed=mc.seed,
        )
        self.attn_backend = get_attn_backend(device)
        self.sampler = Sampler()
        self.input_batch = InputBatch(
            config.scheduler_config.max_num_seqs, self.max_model_len, self.block_size
        )
        self.kv_caches: list[torch.Tensor] = []

    # ---- KV cache -------------------------------------------------------------------------

    def determine_num_kv_blocks(self) -> int:
        cc = self.config.cache_config
        layers = self.model.attention_layers()
        per_block = kv_bytes_per_block(layers, self.block_size, self.dtype)
        if cc.num_kv_blocks is not None:
            return cc.num_kv_blocks
        if self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            used = total - free
            budget = int(total * cc.gpu_memory_utilization) - used - (1 << 30)
        else:
            budget = cc.cpu_kv_cache_bytes
        num_blocks = num_kv_blocks_for_budget(budget, per_block)
        if num_blocks * self.block_size < self.max_model_len:
            raise ValueError(
                f"the KV cache budget holds {num_blocks * self.block_size} tokens, fewer than "
                f"max_model_len ({self.max_model_len}): lower max_model_len or raise the budget"
            )
        return num_blocks

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.kv_caches = []
        for layer in self.model.attention_layers():
            shape = (2, num_blocks, self.block_size, layer.num_kv_heads, layer.head_size)
            cache = torch.zeros(shape, dtype=self.dtype, device=self.device)
            layer.kv_cache = cache
            self.kv_caches.append(cache)
        logger.info(
            "KV cache: %d blocks of %d tokens (%.1f MiB)",
            num_blocks,
            self.block_size,
            sum(c.numel() * c.element_size() for c in self.kv_caches) / 2**20,
        )

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
            )
            batch.add_request(state, new.block_ids, new.num_computed_tokens)
        for cached in so.scheduled_cached_reqs:
            row = batch.req_id_to_row[cached.req_id]
            assert batch.num_computed_tokens[row] == cached.num_computed_tokens, cached.req_id
            batch.append_blocks(row, cached.new_block_ids)

    def _prepare_inputs(self, so: SchedulerOutput, req_ids: list[str]):
        batch = self.input_batch
        rows = np.array([batch.req_id_to_row[r] for r in req_ids], dtype=np.int64)
        num_sched = np.array([so.num_scheduled_tokens[r] for r in req_ids], dtype=np.int64)
        total = int(num_sched.sum())
        cu = np.zeros(len(req_ids) + 1, dtype=np.int64)
        np.cumsum(num_sched, out=cu[1:])
        token_req = np.repeat(np.arange(len(req_ids)), num_sched)
        offsets = np.arange(total) - cu[:-1][token_req]
        computed = batch.num_computed_tokens[rows]
        positions = computed[token_req] + offsets
        token_rows = rows[token_req]
        input_ids = batch.token_ids[token_rows, positions]
        bs = self.block_size
        slots = batch.block_table[token_rows, positions // bs].astype(np.int64) * bs + positions % bs
        seq_lens = computed + num_sched
        max_blocks = int(-(-seq_lens.max() // bs))
        block_table = batch.block_table[rows, :max_blocks]

        dev = self.device
        seq_lens_cpu = torch.from_numpy(seq_lens.astype(np.int32))
        qsl_cpu = torch.from_numpy(cu.astype(np.int32))
        metadata = AttentionMetadata(
            num_actual_tokens=total,
            query_start_loc=qsl_cpu.to(dev, non_blocking=True),
            seq_lens=seq_lens_cpu.to(dev, non_blocking=True),
            block_table=torch.from_numpy(np.ascontiguousarray(block_table)).to(dev),
            slot_mapping=torch.from_numpy(slots).to(dev, non_blocking=True),
            max_query_len=int(num_sched.max()),
            max_seq_len=int(seq_lens.max()),
            query_start_loc_cpu=qsl_cpu,
            seq_lens_cpu=seq_lens_cpu,
        )
        input_ids_t = torch.from_numpy(input_ids).to(dev, non_blocking=True)
        positions_t = torch.from_numpy(positions).to(dev, non_blocking=True)
        return rows, num_sched, cu, seq_lens, input_ids_t, positions_t, metadata

    @torch.inference_mode()
    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        self.update_states(so)
        if so.is_empty:
            return ModelRunnerOutput(req_ids=[], sampled_token_ids=[])
        batch = self.input_batch
        req_ids = list(so.num_scheduled_tokens)
        rows, num_sched, cu, seq_lens, input_ids, positions, metadata = self._prepare_inputs(
            so, req_ids
        )
        with set_forward_context(metadata, self.attn_backend, self.model.attention_layers()):
            hidden = self.model(input_ids, positions)

        # A request samples only when this step reaches the end of its known tokens.
        sampling = seq_lens >= batch.num_tokens[rows]
        sample_idx = np.nonzero(sampling)[0]
        prompt_logprobs = self._prompt_logprobs(req_ids, rows, cu, hidden)
        sampled_lists: list[list[int]] = [[] for _ in req_ids]
        logprobs: dict[str, LogprobsLists] = {}
        if len(sample_idx):
            logits_idx = torch.from_numpy(cu[1:][sample_idx] - 1).to(self.device)
            logits = self.model.compute_logits(hidden[logits_idx])
            metadata_s = self._sampling_metadata([req_ids[i] for i in sample_idx])
            out = self.sampler(logits, metadata_s)
            sampled = out.sampled_token_ids.tolist()
            for j, i in enumerate(sample_idx):
                sampled_lists[i] = [sampled[j]]
            if out.logprobs is not None:
                lists = out.logprobs.to_lists()
                for j, i in enumerate(sample_idx):
                    want = batch.states[req_ids[i]].sampling_params.logprobs
                    if want is not None:
                        logprobs[req_ids[i]] = _take_row(lists, j, want)

        batch.num_computed_tokens[rows] = seq_lens
        for i, tokens in enumerate(sampled_lists):
            if tokens:
                batch.append_token(int(rows[i]), tokens[0])
        return ModelRunnerOutput(
            req_ids=req_ids,
            sampled_token_ids=sampled_lists,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
        )

    def _sampling_metadata(self, req_ids: list[str]) -> SamplingMetadata:
        states = [self.input_batch.states[r] for r in req_ids]
        return SamplingMetadata.build(
            params=[s.sampling_params for s in states],
            prompt_token_ids=[s.prompt_token_ids for s in states],
            output_token_ids=[s.output_token_ids for s in states],
            eos_token_ids=[s.eos_token_id for s in states],
            generators=[s.generator for s in states],
            vocab_size=self.vocab_size,
            device=self.device,
        )

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
            logits = self.model.compute_logits(h)
            targets = torch.tensor(state.prompt_token_ids[start + 1 : end + 1], device=self.device)
            result[req_id] = compute_prompt_logprobs(logits, targets, k).to_lists()
        return result


def _take_row(lists: LogprobsLists, row: int, num_logprobs: int) -> LogprobsLists:
    return LogprobsLists(
        token_ids=[lists.token_ids[row][: num_logprobs + 1]],
        logprobs=[lists.logprobs[row][: num_logprobs + 1]],
        ranks=[lists.ranks[row]],
    )
