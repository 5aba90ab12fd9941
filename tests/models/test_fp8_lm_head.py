"""The FP8 LM heads (ModelConfig.lm_head_quantization). "fp8": quantized at load per vocabulary
row as the online FP8 linears are, the high-precision weight freed (a tied embedding keeps its
own), logits within FP8 error. "fp8_rescored": an FP8 copy scores, each slice's top logits are
recomputed against the kept weight, so the likely tokens' logits and the greedy tokens are the
model-dtype head's. "auto" and the errors that name the option, and the flag from the CLI through
`LLM` (CPU, the reference path); on CUDA against the bf16 model."""

from __future__ import annotations

import weakref

import pytest
import torch
from model_helpers import save_scaled_tiny_llama
from safetensors.torch import load_file
from test_fp8_linear import (
    PROMPT,
    cuda_logits,
    greedy,
    load,
    param_bytes,
    prompt_logits,
    relative_error,
)

from v1_engine.config import EngineConfig
from v1_engine.entrypoints.cli import engine_kwargs, make_parser
from v1_engine.kernels.fp8 import FP8_DTYPE
from v1_engine.layers import embedding
from v1_engine.layers.embedding import LMHead
from v1_engine.models import get_model, load_hf_config, loader


def test_fp8_lm_head_is_quantized_per_vocab_row(scaled_dir):
    fp8, fp8_head = load(scaled_dir, "fp8"), load(scaled_dir, "fp8", lm_head="fp8")
    head = fp8_head.lm_head
    vocab, hidden = fp8.lm_head.weight.shape
    assert head.weight.dtype == FP8_DTYPE and head.weight.shape == (vocab, hidden)
    assert head.weight_scale.dtype == torch.float32 and head.weight_scale.shape == (vocab, 1)
    assert fp8_head.model.embed_tokens.weight.dtype == torch.float32
    assert fp8.lm_head.weight.dtype == torch.float32  # off by default
    # float32 → e4m3 (3 bytes saved per weight) plus one float32 scale per vocab row.
    assert param_bytes(fp8_head) == param_bytes(fp8) - 3 * vocab * hidden + 4 * vocab


def test_lm_head_quantization_drops_the_loaded_weight_and_runs_once():
    head = LMHead(48, 32)
    head.weight.data.normal_()
    original = weakref.ref(head.weight)
    expected = head.weight.detach().clone()
    head.quantize_fp8()
    assert original() is None, "the high-precision weight is still referenced"
    weight, scale = head.weight, head.weight_scale
    head.quantize_fp8()
    assert head.weight is weight and head.weight_scale is scale
    error = (weight.float() * scale - expected).abs()
    assert (error <= expected.abs().amax(1, keepdim=True) / 448 * 16).all()
    x = torch.randn(3, 5, 32)
    for dtype in (torch.float32, torch.bfloat16):  # the output keeps the input's dtype
        assert head(x.to(dtype)).dtype == dtype
    assert 1e-3 < relative_error(head(x), x @ expected.T) < 0.05


def test_fp8_lm_head_logits_track_float32_and_differ_from_the_high_precision_head(scaled_dir):
    """The head's GEMM adds its own ~3.5% RMS rounding (weight and activation in e4m3) to the
    logits, undamped, on top of the FP8 layers' ~2.7%: measured 4.4%. Bound: 6%."""
    expected = prompt_logits(load(scaled_dir))
    fp8 = prompt_logits(load(scaled_dir, "fp8"))
    actual = prompt_logits(load(scaled_dir, "fp8", lm_head="fp8"))
    error = relative_error(actual, expected)
    assert error < 0.06, error
    # Far above the bf16 rounding of the GEMM output (2^-9): the head really ran in FP8.
    assert relative_error(actual, fp8) > 0.01
    agree = (actual.argmax(-1) == expected.argmax(-1)).float().mean().item()
    assert agree >= 0.9, agree


def test_fp8_lm_head_of_a_tied_model_is_a_copy(tmp_path):
    """The embedding keeps its float32 weight (the lookup still reads it); the head gets its
    own e4m3 copy."""
    save_scaled_tiny_llama(tmp_path, tie_word_embeddings=True)
    stored = load_file(tmp_path / "model.safetensors")["model.embed_tokens.weight"]
    ref = load(tmp_path)
    model = load(tmp_path, "fp8", lm_head="fp8")
    assert ref.lm_head.weight is ref.model.embed_tokens.weight
    embedding = model.model.embed_tokens.weight
    assert embedding.dtype == torch.float32 and torch.equal(embedding, stored)
    assert model.lm_head.weight.dtype == FP8_DTYPE
    dequantized = model.lm_head.weight.float() * model.lm_head.weight_scale
    assert ((dequantized - stored).abs() <= stored.abs().amax(1, keepdim=True) / 448 * 16).all()
    error = relative_error(prompt_logits(model), prompt_logits(ref))
    assert 1e-3 < error < 0.06, error  # measured 4.0%, as untied


@pytest.mark.parametrize("choice", ["fp8", "fp8_rescored"])
def test_an_fp8_lm_head_needs_fp8_linear_layers_and_an_lm_head(scaled_dir, monkeypatch, choice):
    needs_fp8 = rf"lm_head_quantization='{choice}' needs FP8 linear layers: quantization='fp8'"
    with pytest.raises(ValueError, match=needs_fp8):
        load(scaled_dir, lm_head=choice)
    choices = r"\('auto', 'none', 'fp8', 'fp8_rescored'\), got 'yes'"
    with pytest.raises(ValueError, match=r"lm_head_quantization must be one of " + choices):
        EngineConfig.from_kwargs(model=str(scaled_dir), lm_head_quantization="yes")

    class HeadlessModel(torch.nn.Module):
        def __init__(self, config) -> None:
            super().__init__()

    # Refused before anything is allocated, so checkable without a GPU.
    odd = load_hf_config(scaled_dir)
    odd.vocab_size = 250
    with pytest.raises(ValueError, match=r"vocab_size that is a multiple of 16 on CUDA .* got 250"):
        get_model(odd, scaled_dir, dtype=torch.bfloat16, device=torch.device("cuda"),
                  load_format="dummy", seed=0, quantization="fp8", lm_head_quantization=choice)  # fmt: skip

    monkeypatch.setattr(loader, "get_model_class", lambda config: HeadlessModel)
    with pytest.raises(ValueError, match=r"`lm_head` is an LMHead; HeadlessModel has none"):
        load(scaled_dir, "fp8", lm_head=choice)


def test_auto_takes_the_rescored_head_on_cuda_with_fp8_layers_only(scaled_dir):
    config = load_hf_config(scaled_dir)
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    resolve = loader.resolve_lm_head_quantization
    assert resolve("auto", True, config, cuda) == "fp8_rescored"
    assert resolve("auto", False, config, cuda) == "none"
    assert resolve("auto", True, config, cpu) == "none"
    for choice in ("none", "fp8", "fp8_rescored"):
        assert resolve(choice, True, config, cpu) == choice
    config.vocab_size = 250  # the FP8 GEMM's alignment: auto keeps the model dtype
    assert resolve("auto", True, config, cuda) == "none"
    assert load(scaled_dir, "fp8").lm_head.weight.dtype == torch.float32  # CPU: auto is none


def test_lm_head_quantization_flag_reaches_the_engine_config():
    for choice in ("none", "fp8", "fp8_rescored"):
        args = make_parser().parse_args(["--quantization", "fp8", "--lm-head-quantization", choice])
        config = EngineConfig.from_kwargs(**engine_kwargs(args))
        assert config.model_config.lm_head_quantization == choice
    default = EngineConfig.from_kwargs(**engine_kwargs(make_parser().parse_args([])))
    assert default.model_config.lm_head_quantization == "auto"


def test_llm_with_the_fp8_head_serves_it(tmp_path, default_tokenizer):
    """Through LLM: the head is FP8 and the greedy tokens are those of the driver-run model
    with the FP8 head, twice over."""
    from v1_engine import LLM, SamplingParams

    save_scaled_tiny_llama(tmp_path, vocab_size=len(default_tokenizer), tokenizer=default_tokenizer)
    kwargs = {"quantization": "fp8", "lm_head_quantization": "fp8"}
    llm = LLM(str(tmp_path), max_model_len=128, num_kv_blocks=64, **kwargs)
    assert llm.engine_core.model_runner.model.lm_head.weight.dtype == FP8_DTYPE
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    runs = [llm.generate([PROMPT], params, use_tqdm=False)[0] for _ in range(2)]
    first, second = (list(run.outputs[0].token_ids) for run in runs)
    assert first == second == greedy(load(tmp_path, "fp8", lm_head="fp8"), 8)


# ---- the rescored head ---------------------------------------------------------------------


def test_rescored_head_keeps_the_weight_and_adds_an_fp8_copy(scaled_dir):
    fp8, rescored = load(scaled_dir, "fp8"), load(scaled_dir, "fp8", lm_head="fp8_rescored")
    head = rescored.lm_head
    vocab, hidden = head.weight.shape
    assert head.rescore and head.quant_method is None
    assert torch.equal(head.weight, fp8.lm_head.weight)  # the float32 weight, as loaded
    assert head.fp8_weight.dtype == FP8_DTYPE and head.fp8_weight.shape == (vocab, hidden)
    assert head.fp8_weight_scale.shape == (vocab, 1)
    dequantized = head.fp8_weight.float() * head.fp8_weight_scale
    bound = head.weight.abs().amax(1, keepdim=True) / 448 * 16
    assert ((dequantized - head.weight).abs() <= bound).all()
    assert param_bytes(rescored) == param_bytes(fp8) + vocab * hidden + 4 * vocab
    fp8_weight = head.fp8_weight
    head.quantize_fp8(rescore=True)  # a second call does nothing
    head.quantize_fp8()
    assert head.fp8_weight is fp8_weight and head.quant_method is None


@pytest.mark.parametrize("chunk", [1024, 64])
def test_rescored_head_gives_the_model_dtype_logits_of_each_slices_top(
    scaled_dir, monkeypatch, chunk
):
    """Teacher-forced over the prompt (13 rows: the FP8 scoring path) against the FP8 model
    with its float32 head: each slice's top 4 (by the FP8 scores) hold the float32 head's
    logits, the rest visibly FP8 ones, and every row's argmax is the float32 head's."""
    monkeypatch.setattr(embedding, "RESCORE_CHUNK", chunk)
    exact = prompt_logits(load(scaled_dir, "fp8"))
    model = load(scaled_dir, "fp8", lm_head="fp8_rescored")
    actual = prompt_logits(model)
    assert actual.shape == exact.shape and actual.shape[0] <= embedding.RESCORE_MAX_M
    same = torch.isclose(actual, exact, rtol=1e-5, atol=1e-5)
    vocab = exact.shape[1]
    slices = -(-vocab // chunk)
    assert (same.sum(1) >= slices * embedding.RESCORE_TOP).all(), same.sum(1)
    assert torch.equal(actual.argmax(-1), exact.argmax(-1))
    top = exact.topk(2, dim=-1).indices
    assert same.gather(1, top).all()  # the two likeliest tokens always among the re-scored
    assert relative_error(actual, exact) > 1e-3  # the tail really came from the FP8 copy


def test_rescored_head_takes_the_weight_whole_beyond_decode_sizes_or_when_exact(scaled_dir):
    model = load(scaled_dir, "fp8", lm_head="fp8_rescored")
    head = model.lm_head
    hidden = torch.randn(embedding.RESCORE_MAX_M + 1, head.weight.shape[1])
    assert torch.equal(head(hidden), hidden @ head.weight.T)
    assert not torch.equal(head(hidden[:3]), hidden[:3] @ head.weight.T)
    assert torch.equal(model.compute_logits(hidden[:3], exact=True), hidden[:3] @ head.weight.T)


def test_rescored_head_greedy_is_the_model_dtype_heads(scaled_dir):
    assert greedy(load(scaled_dir, "fp8", lm_head="fp8_rescored")) == greedy(
        load(scaled_dir, "fp8")
    )


def test_rescored_head_on_the_default_model_decodes_as_the_model_dtype_head(default_model_dir):
    """The real weights (SmolLM2-135M-Instruct, tied embeddings): the greedy tokens of the FP8
    model with the rescored head are those with its float32 head. (Its FP8 head alone agrees on
    fewer: benchmarks/RESULTS.md, top-1 agreement 0.895 against 0.934.)"""
    from v1_engine.models.loader import get_tokenizer

    exact = load(default_model_dir, "fp8")
    rescored = load(default_model_dir, "fp8", lm_head="fp8_rescored")
    assert rescored.lm_head.rescore
    tokenizer = get_tokenizer(default_model_dir)
    # The counting prompt's digits are neighbouring token ids, within the FP8 error of each
    # other: with contiguous slices its greedy decode left the float32 head's at step 16.
    prompt = tokenizer.encode("1, 2, 3, 4,")
    assert greedy(rescored, 20, prompt) == greedy(exact, 20, prompt)


def test_llm_with_the_rescored_head_decodes_as_the_model_dtype_head(tmp_path, default_tokenizer):
    from v1_engine import LLM, SamplingParams

    save_scaled_tiny_llama(tmp_path, vocab_size=len(default_tokenizer), tokenizer=default_tokenizer)
    llm = LLM(str(tmp_path), max_model_len=128, num_kv_blocks=64, quantization="fp8",
              lm_head_quantization="fp8_rescored")  # fmt: skip
    assert llm.engine_core.model_runner.model.lm_head.rescore
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, prompt_logprobs=3)
    out = llm.generate([PROMPT], params, use_tqdm=False)[0]
    assert list(out.outputs[0].token_ids) == greedy(load(tmp_path, "fp8"), 12)
    # Prompt logprobs score given tokens, often in the tail: every one from the float32 weight,
    # as the head without FP8 scoring gives them (13 rows here: a decode-sized input).
    ref = LLM(str(tmp_path), max_model_len=128, num_kv_blocks=64, quantization="fp8",
              lm_head_quantization="none")  # fmt: skip
    want = ref.generate([PROMPT], params, use_tqdm=False)[0]
    assert len(out.prompt_logprobs) == len(PROMPT)
    for got_pos, want_pos in zip(out.prompt_logprobs[1:], want.prompt_logprobs[1:]):
        assert got_pos.keys() == want_pos.keys()
        for token, logprob in got_pos.items():
            assert logprob.logprob == pytest.approx(want_pos[token].logprob, abs=1e-4)


@pytest.mark.gpu
def test_fp8_lm_head_on_cuda_tracks_bfloat16(tmp_path):
    """The FP8 head on CUDA (the Triton per-token quant and the FP8 GEMMs of kernels/fp8.py):
    logits within the CPU test's FP8 bound of the bf16 model's, a byte per head weight saved
    against the FP8 model with a bf16 head, and visibly not that model's logits."""
    save_scaled_tiny_llama(tmp_path, hidden_size=256, intermediate_size=384, head_dim=64)
    expected, _ = cuda_logits(tmp_path, None)
    fp8, fp8_bytes = cuda_logits(tmp_path, "fp8")
    actual, head_bytes = cuda_logits(tmp_path, "fp8", lm_head="fp8")
    error = relative_error(actual, expected)
    print(f"FP8 head: relative logits error {error:.4f}, weights {head_bytes} vs {fp8_bytes} bytes")
    assert error < 0.06
    assert relative_error(actual, fp8) > 0.01
    vocab, hidden = 256, 256
    assert head_bytes <= fp8_bytes - vocab * hidden * 0.9, (head_bytes, fp8_bytes)


@pytest.mark.gpu
def test_rescored_head_on_cuda_matches_the_bf16_head_where_it_counts(tmp_path):
    """The rescored head on CUDA, in the model (13 prompt rows: per-token quant and the FP8
    GEMM) and on the Llama-3-8B head's shape at 1 and 4 rows (the weight-only FP8 kernel):
    argmax and the likeliest logits are the bf16 head's, the tail is FP8."""
    save_scaled_tiny_llama(tmp_path, hidden_size=256, intermediate_size=384, head_dim=64)
    exact, _ = cuda_logits(tmp_path, "fp8")
    actual, _ = cuda_logits(tmp_path, "fp8", lm_head="fp8_rescored")
    assert torch.equal(actual.argmax(-1), exact.argmax(-1))
    top = exact.topk(2, dim=-1).indices
    torch.testing.assert_close(actual.gather(1, top), exact.gather(1, top), rtol=1e-2, atol=1e-2)
    assert relative_error(actual, exact) > 1e-3

    torch.manual_seed(0)
    head = LMHead(128256, 4096).to("cuda", torch.bfloat16)
    head.weight.data.normal_(std=4096**-0.5)
    head.quantize_fp8(rescore=True)
    for rows in (1, 4):
        hidden = torch.randn(rows, 4096, device="cuda", dtype=torch.bfloat16)
        expected = (hidden.float() @ head.weight.float().T).cpu()
        got = head(hidden).float().cpu()
        assert torch.equal(got.argmax(-1), expected.argmax(-1))
        top = expected.topk(3, dim=-1).indices
        torch.testing.assert_close(
            got.gather(1, top), expected.gather(1, top), rtol=8e-3, atol=0.05
        )
        assert relative_error(got, expected) > 1e-3
