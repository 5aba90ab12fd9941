"""DeepSeek-V3 block-FP8 checkpoints (the format DeepSeek releases V3 in) on the CPU reference
path, and once on CUDA.

A tiny random V3 (dims multiples of 128 where the 128x128 blocks need it: hidden 256,
moe_intermediate 128, kv_lora_rank 128, q_lora_rank 128) is written as a Hugging Face FP8
checkpoint by quantizing its safetensors per 128x128 block (`weight_scale_inv`, a
`quantization_config` with `weight_block_size`), plus multi-token-prediction tensors past the
last layer as V3 carries them. The oracle is the same model with the dequantized weights in
float32: the weights are then identical, so what differs is only what FP8 computes differently.

The init is scaled (linear weights normal(0, 0.7 / sqrt(fan_in))) so sublayers add to the
residual stream without swamping it, as in trained models; a 0.2-std model is chaotic and no
measure of a lossy format (see test_fp8_linear.py).
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import pytest
import torch
from model_helpers import scaled_init
from safetensors.torch import load_file, save_file
from test_deepseek_vs_hf import LatentPagedDriver
from test_fp8_linear import dequantize_blocks, quantize_blocks, relative_error

from v1_engine.kernels.fp8 import FP8_DTYPE
from v1_engine.layers.linear import Linear
from v1_engine.layers.moe import RoutedExperts
from v1_engine.layers.quantization import Fp8BlockLinearMethod, set_quant_config
from v1_engine.layers.quantization.fp8 import Fp8Config
from v1_engine.models import get_model, load_hf_config

TINY_V3 = {
    "vocab_size": 256,
    "hidden_size": 256,
    "intermediate_size": 256,
    "moe_intermediate_size": 128,
    "num_hidden_layers": 3,
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
    "max_position_embeddings": 128,
    "q_lora_rank": 128,
    "kv_lora_rank": 128,
    "qk_nope_head_dim": 64,
    "qk_rope_head_dim": 32,
    "v_head_dim": 64,
    "first_k_dense_replace": 1,
    "n_shared_experts": 1,
    "n_routed_experts": 4,
    "num_experts_per_tok": 2,
    "n_group": 2,
    "topk_group": 1,
    "norm_topk_prob": True,
    "routed_scaling_factor": 2.5,
    "num_nextn_predict_layers": 1,
    "tie_word_embeddings": False,
}
NUM_EXPERTS, HIDDEN, MOE_INTER = 4, 256, 128
MOE_LAYERS = (1, 2)
PROMPT = list(range(3, 40, 3))
NUM_GREEDY = 16
QUANTIZED = re.compile(r"_proj(_with_mqa)?\.weight$")
"""Every projection is FP8 in V3's checkpoint; the router (mlp.gate), norms, embeddings and the
LM head are not."""
LOGITS_BOUND = 0.05
"""Relative logits error vs the dequantized oracle on CPU. The weights are identical and the CPU
MoE reference runs the dequantized experts in float32, so only the dense linears' activation
rounding remains (e4m3 per 1x128 group: ~2.5% RMS per GEMM), damped in the logits as in
test_fp8_linear.py; measured 2.3%."""
ONLINE_BOUND = 0.07
"""quantization="fp8" also rounds the weights (linears per channel, experts per block): weight
rounding alone moves these logits 3.5% (the dequantized checkpoint vs its float source),
activation rounding 2.3%; together measured 4.0%."""


@torch.no_grad()
def save_tiny_v3(path: Path, seed: int = 0) -> None:
    """A scaled-init random float32 DeepSeek-V3 with MTP tensors (layer 3), saved to `path`."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model("deepseek_v3", **TINY_V3)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    scaled_init(model)
    model.save_pretrained(path)
    tensors = load_file(path / "model.safetensors")
    mtp = f"model.layers.{config.num_hidden_layers}"
    tensors[f"{mtp}.eh_proj.weight"] = torch.randn(HIDDEN, 2 * HIDDEN) * 0.05
    tensors[f"{mtp}.enorm.weight"] = torch.ones(HIDDEN)
    tensors[f"{mtp}.mlp.experts.0.gate_proj.weight"] = torch.randn(MOE_INTER, HIDDEN) * 0.05
    tensors[f"{mtp}.shared_head.head.weight"] = torch.randn(256, HIDDEN) * 0.05
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})


def _is_listed(module: str, entries: tuple[str, ...]) -> bool:
    return any(module == e or module.startswith(f"{e}.") for e in entries)


def write_block_fp8_checkpoint(
    src: Path, dst: Path, dequantized: Path, ignored: tuple[str, ...] = ()
) -> dict[str, torch.Tensor]:
    """`src` as a block-FP8 checkpoint at `dst` (modules under `ignored` kept float32 and
    listed in modules_to_not_convert) and its dequantized float32 twin at `dequantized`.
    Returns the FP8 checkpoint's tensors."""
    fp8, dq = {}, {}
    for name, w in load_file(src / "model.safetensors").items():
        module = name.removesuffix(".weight")
        if not QUANTIZED.search(name) or _is_listed(module, ignored):
            fp8[name] = dq[name] = w
            continue
        fp8[name], fp8[f"{module}.weight_scale_inv"] = quantize_blocks(w)
        dq[name] = dequantize_blocks(fp8[name], fp8[f"{module}.weight_scale_inv"])
    config = json.loads((src / "config.json").read_text())
    for path, tensors in ((dst, fp8), (dequantized, dq)):
        path.mkdir(parents=True, exist_ok=True)
        save_file(tensors, path / "model.safetensors")
    (dequantized / "config.json").write_text(json.dumps(config))
    config["quantization_config"] = {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": [128, 128],
        **({"modules_to_not_convert": list(ignored)} if ignored else {}),
    }
    (dst / "config.json").write_text(json.dumps(config))
    return fp8


def load(
    path: Path,
    quantization: str | None = None,
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
    load_format: str = "auto",
) -> torch.nn.Module:
    return get_model(
        load_hf_config(path),
        path,
        dtype=dtype,
        device=torch.device(device),
        load_format=load_format,
        seed=0,
        quantization=quantization,
    )


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> tuple[Path, Path, dict[str, torch.Tensor]]:
    """(FP8 checkpoint dir, dequantized float32 dir, the FP8 checkpoint's tensors)."""
    root = tmp_path_factory.mktemp("deepseek-v3-fp8")
    save_tiny_v3(root / "src")
    tensors = write_block_fp8_checkpoint(root / "src", root / "fp8", root / "dq")
    return root / "fp8", root / "dq", tensors


@pytest.fixture(scope="module")
def models(checkpoint) -> tuple[torch.nn.Module, torch.nn.Module]:
    """(the FP8 checkpoint loaded, the dequantized oracle), float32 on CPU."""
    fp8_dir, dq_dir, _ = checkpoint
    return load(fp8_dir), load(dq_dir)


def prompt_logits(model: torch.nn.Module) -> torch.Tensor:
    """The prompt's prefill logits, then 3 decode steps (the absorbed path)."""
    driver = LatentPagedDriver(model)
    rows = [driver.step([("a", PROMPT[:-3])])[0]]
    rows += [driver.step([("a", [token])])[0] for token in PROMPT[-3:]]
    return torch.cat(rows)


def greedy(model: torch.nn.Module) -> list[int]:
    driver = LatentPagedDriver(model)
    logits, tokens = driver.step([("a", PROMPT)])[0][-1], []
    for _ in range(NUM_GREEDY):
        tokens.append(int(logits.argmax()))
        logits = driver.step([("a", tokens[-1:])])[0][-1]
    return tokens


def linear_layers(model: torch.nn.Module) -> dict[str, Linear]:
    return {n: m for n, m in model.named_modules() if isinstance(m, Linear)}


# ---- loading ---------------------------------------------------------------------------------


def test_routed_experts_load_e4m3_with_per_expert_block_scales(models, checkpoint):
    fp8, oracle = models
    _, _, tensors = checkpoint
    for i in MOE_LAYERS:
        experts = fp8.model.layers[i].mlp.experts
        assert experts.weight_format == "checkpoint_block_fp8"
        assert experts.w13_weight.dtype == experts.w2_weight.dtype == FP8_DTYPE
        assert experts.w13_weight.shape == (NUM_EXPERTS, 2 * MOE_INTER, HIDDEN)
        assert experts.w2_weight.shape == (NUM_EXPERTS, HIDDEN, MOE_INTER)
        # [E, ceil(N/128), ceil(K/128)]: gate's block row, then up's; down has one block column.
        assert experts.w13_weight_scale_inv.shape == (NUM_EXPERTS, 2, 2)
        assert experts.w2_weight_scale_inv.shape == (NUM_EXPERTS, 2, 1)
        assert experts.w13_weight_scale_inv.dtype == torch.float32
        prefix = f"model.layers.{i}.mlp.experts.3"
        assert torch.equal(
            experts.w13_weight_scale_inv[3, 1], tensors[f"{prefix}.up_proj.weight_scale_inv"][0]
        )
        assert torch.equal(
            experts.w2_weight[3].float(), tensors[f"{prefix}.down_proj.weight"].float()
        )
        w13, w2 = experts.dequantized_weights()
        reference = oracle.model.layers[i].mlp.experts
        assert torch.equal(w13, reference.w13_weight)
        assert torch.equal(w2, reference.w2_weight)
        # The router stays high precision, with the checkpoint's values.
        gate = fp8.model.layers[i].mlp.gate
        assert gate.weight.dtype == torch.float32
        assert torch.equal(gate.weight, oracle.model.layers[i].mlp.gate.weight)


def test_every_projection_loads_through_the_block_linear_method(models):
    """q_a/q_b, kv_a (160 rows: a short last block), kv_b, o, the dense MLP and the shared
    experts; dequantizing reproduces the oracle's weights exactly."""
    fp8, oracle = models
    fp8_layers, oracle_layers = linear_layers(fp8), linear_layers(oracle)
    assert len(fp8_layers) == 3 * 5 + 3 * 2  # 5 attention projections and 2 MLP ones per layer
    for name, layer in fp8_layers.items():
        assert isinstance(layer.quant_method, Fp8BlockLinearMethod), name
        assert layer.weight.dtype == FP8_DTYPE, name
        assert torch.equal(layer.dequantized_weight(), oracle_layers[name].weight), name
    assert fp8.lm_head.weight.dtype == fp8.model.embed_tokens.weight.dtype == torch.float32


def test_kv_b_proj_is_absorbed_from_its_dequantized_weight(models, monkeypatch):
    """W_UK / W_UV equal the oracle's (views of its float32 kv_b_proj), are copies in the
    model dtype, and kv_b_proj itself is never called: no path multiplies by its e4m3 tensor."""
    fp8, oracle = models
    for layer, reference in zip(fp8.model.layers, oracle.model.layers, strict=True):
        attn, mla = layer.self_attn, layer.self_attn.mla_attn
        assert attn.kv_b_proj.weight.dtype == FP8_DTYPE
        assert mla.w_uk.dtype == mla.w_uv.dtype == torch.float32
        assert torch.equal(mla.w_uk, reference.self_attn.mla_attn.w_uk)
        assert torch.equal(mla.w_uv, reference.self_attn.mla_attn.w_uv)
        kv_b_storage = attn.kv_b_proj.weight.untyped_storage().data_ptr()
        assert mla.w_uk.untyped_storage().data_ptr() != kv_b_storage

        def refuse(*args, **kwargs):
            raise AssertionError("kv_b_proj was called")

        monkeypatch.setattr(attn.kv_b_proj, "forward", refuse)
    assert torch.isfinite(prompt_logits(fp8)).all()  # prefill (expanded) and decode (absorbed)


def test_mtp_layers_are_skipped(checkpoint, caplog):
    fp8_dir, _, tensors = checkpoint
    mtp = [name for name in tensors if name.startswith("model.layers.3.")]
    assert len(mtp) == 6  # eh_proj and an expert with their scales, enorm, shared_head
    assert any(tensors[name].dtype == FP8_DTYPE for name in mtp)
    with caplog.at_level(logging.INFO, logger="v1_engine.models.deepseek"):
        model = load(fp8_dir)
    assert f"skipped {len(mtp)} checkpoint tensors of multi-token-prediction layers" in caplog.text
    assert len(model.model.layers) == TINY_V3["num_hidden_layers"]


# ---- what it computes ------------------------------------------------------------------------


def test_fp8_experts_compute_what_the_dequantized_experts_do(models):
    """The MoE op gets the block scales: on CPU it dequantizes, so one MoE layer's routed
    experts agree with the oracle's to float32 rounding."""
    fp8, oracle = models
    generator = torch.Generator().manual_seed(3)
    hidden = torch.randn(9, HIDDEN, generator=generator)
    topk_ids = torch.randint(0, NUM_EXPERTS, (9, 2), generator=generator)
    topk_weights = torch.rand(9, 2, generator=generator)
    for i in MOE_LAYERS:
        got = fp8.model.layers[i].mlp.experts(hidden, topk_weights, topk_ids)
        want = oracle.model.layers[i].mlp.experts(hidden, topk_weights, topk_ids)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_logits_track_the_dequantized_model(models):
    fp8, oracle = models
    expected, actual = prompt_logits(oracle), prompt_logits(fp8)
    error = relative_error(actual, expected)
    assert 1e-4 < error < LOGITS_BOUND, error  # above 1e-4: activations really went to FP8
    agree = (actual.argmax(-1) == expected.argmax(-1)).float().mean().item()
    assert agree >= 0.8, agree  # measured 12 of 13 positions


def test_greedy_is_reproducible_and_follows_the_dequantized_model(checkpoint, models):
    fp8_dir, _, _ = checkpoint
    fp8, oracle = models
    first, second = greedy(fp8), greedy(load(fp8_dir))
    assert first == second
    assert len(set(first)) >= NUM_GREEDY // 2, "a degenerate (repetitive) generation"
    expected = greedy(oracle)
    num_equal = sum(a == b for a, b in zip(first, expected, strict=True))
    assert num_equal >= NUM_GREEDY - 4, (first, expected)  # measured 14 of 16


def test_dummy_weights_of_a_block_fp8_config_run(checkpoint):
    fp8_dir, _, _ = checkpoint
    model = load(fp8_dir, load_format="dummy")
    experts = model.model.layers[1].mlp.experts
    assert experts.w13_weight.dtype == FP8_DTYPE
    assert (experts.w13_weight_scale_inv == 0.02).all()
    assert torch.isfinite(prompt_logits(model)).all()


# ---- modules_to_not_convert, online quantization, refusals ---------------------------------


def test_modules_to_not_convert_keeps_experts_and_kv_b_proj_in_high_precision(tmp_path):
    save_tiny_v3(tmp_path / "src", seed=1)
    ignored = ("model.layers.2.mlp.experts", "model.layers.0.self_attn.kv_b_proj")
    write_block_fp8_checkpoint(tmp_path / "src", tmp_path / "fp8", tmp_path / "dq", ignored)
    fp8, oracle = load(tmp_path / "fp8"), load(tmp_path / "dq")
    kept = fp8.model.layers[2].mlp.experts
    assert kept.weight_format == "unquantized" and kept.w13_weight_scale_inv is None
    assert torch.equal(kept.w13_weight, oracle.model.layers[2].mlp.experts.w13_weight)
    assert fp8.model.layers[1].mlp.experts.w13_weight.dtype == FP8_DTYPE
    attn = fp8.model.layers[0].self_attn
    assert attn.kv_b_proj.weight.dtype == torch.float32
    # A high-precision kv_b_proj is absorbed as views: its values are held once.
    storage = attn.kv_b_proj.weight.untyped_storage().data_ptr()
    assert attn.mla_attn.w_uk.untyped_storage().data_ptr() == storage
    assert fp8.model.layers[1].self_attn.kv_b_proj.weight.dtype == FP8_DTYPE
    error = relative_error(prompt_logits(fp8), prompt_logits(oracle))
    assert error < LOGITS_BOUND, error


def test_a_partly_ignored_expert_layer_is_refused(checkpoint, tmp_path):
    fp8_dir, _, _ = checkpoint
    config = json.loads((fp8_dir / "config.json").read_text())
    config["quantization_config"]["modules_to_not_convert"] = [
        "model.layers.1.mlp.experts.2.gate_proj"
    ]
    (tmp_path / "config.json").write_text(json.dumps(config))
    (tmp_path / "model.safetensors").symlink_to(fp8_dir / "model.safetensors")
    with pytest.raises(ValueError, match=r"not every routed expert of the same layer"):
        load(tmp_path)


def test_online_fp8_quantizes_the_experts_per_block(checkpoint):
    """quantization="fp8" on the float checkpoint: linears per channel, experts per 128x128
    block (the layout the MoE kernel takes); each weight within half an e4m3 step of its
    block's largest magnitude (the step at 448 is 32, scaled by amax / 448)."""
    src = checkpoint[0].parent / "src"
    online, reference_model = load(src, "fp8"), load(src)
    for i in MOE_LAYERS:
        experts = online.model.layers[i].mlp.experts
        reference = reference_model.model.layers[i].mlp.experts
        assert experts.weight_format == "online_block_fp8"
        assert experts.w13_weight.dtype == experts.w2_weight.dtype == FP8_DTYPE
        assert experts.w13_weight_scale_inv.shape == (NUM_EXPERTS, 2, 2)
        assert experts.w2_weight_scale_inv.shape == (NUM_EXPERTS, 2, 1)
        pairs = zip(
            experts.dequantized_weights(),
            (reference.w13_weight, reference.w2_weight),
            (experts.w13_weight_scale_inv, experts.w2_weight_scale_inv),
            strict=True,
        )
        for got, want, scale in pairs:
            half_step = 16 * scale.repeat_interleave(128, 1).repeat_interleave(128, 2)
            error = (got - want).abs()
            assert (error <= half_step[:, : want.shape[1], : want.shape[2]]).all()
            assert error.max() > 0
    error = relative_error(prompt_logits(online), prompt_logits(reference_model))
    assert 1e-4 < error < ONLINE_BOUND, error


def test_fp8_checkpoints_without_blocks_and_misaligned_experts_are_refused():
    per_tensor = Fp8Config.from_checkpoint({"quant_method": "fp8"})
    message = r"weight_block_size must be one of .* routed experts"
    with set_quant_config(per_tensor), pytest.raises(ValueError, match=message):
        RoutedExperts(NUM_EXPERTS, HIDDEN, MOE_INTER, prefix="model.layers.1.mlp.experts")
    block = {"quant_method": "fp8", "weight_block_size": [128, 128]}
    with set_quant_config(Fp8Config.from_checkpoint(block)):
        with pytest.raises(ValueError, match=r"moe_intermediate_size must be a multiple of 128"):
            RoutedExperts(NUM_EXPERTS, HIDDEN, 96, prefix="model.layers.1.mlp.experts")
        experts = RoutedExperts(NUM_EXPERTS, HIDDEN, MOE_INTER, prefix="model.layers.1.mlp.experts")
    float_weight = torch.zeros(MOE_INTER, HIDDEN)
    with pytest.raises(ValueError, match=r"dtype torch.float32 but the layer holds .*float8"):
        experts.weight_loader(experts.w13_weight, float_weight, ("gate", 0))
    unquantized = RoutedExperts(NUM_EXPERTS, HIDDEN, MOE_INTER, prefix="model.layers.1.mlp.experts")
    with pytest.raises(ValueError, match=r"float8_e4m3fn but the layer holds torch.float32"):
        unquantized.weight_loader(unquantized.w13_weight, float_weight.to(FP8_DTYPE), ("up", 1))


# ---- CUDA: the Triton MoE and block-scaled GEMMs in the whole model ------------------------


@pytest.mark.gpu
def test_block_fp8_checkpoint_on_cuda_tracks_the_dequantized_model(checkpoint):
    """bf16 on CUDA: the FP8 model (block-scaled CUTLASS GEMMs, the Triton MoE kernel on e4m3
    experts, activations per 1x128 group in both) against the bf16 model of the dequantized
    weights (Triton MLA on both sides). The experts now quantize activations too, so the bound
    is the CPU one plus bf16 rounding; greedy tokens repeat exactly across two runs."""
    from test_gpu_vs_hf import GPUPagedDriver

    from v1_engine.attention.triton_attn import TritonAttentionBackend

    class LatentCudaDriver(GPUPagedDriver):
        def __init__(self, model: torch.nn.Module) -> None:
            self.model, self.block_size, num_blocks = model, 16, 64
            self.layers = model.attention_layers()
            for layer in self.layers:
                shape = layer.kv_cache_shape(num_blocks, self.block_size)
                layer.kv_cache = torch.full(
                    shape, float("nan"), dtype=torch.bfloat16, device="cuda"
                )
            generator = torch.Generator().manual_seed(0)
            self.free = torch.randperm(num_blocks, generator=generator).tolist()
            self.tables, self.computed = {}, {}
            self.backend = TritonAttentionBackend()  # unused: the MLA op picks by device

    def cuda_greedy(model: torch.nn.Module) -> tuple[torch.Tensor, list[int]]:
        driver = LatentCudaDriver(model)
        logits = driver.step([("a", PROMPT)])[0]
        rows, tokens = [logits], []
        for _ in range(NUM_GREEDY):
            tokens.append(int(rows[-1][-1].argmax()))
            rows.append(driver.step([("a", tokens[-1:])])[0])
        return torch.cat(rows).cpu(), tokens

    fp8_dir, dq_dir, _ = checkpoint
    fp8 = load(fp8_dir, dtype=torch.bfloat16, device="cuda")
    experts = fp8.model.layers[1].mlp.experts
    assert experts.w13_weight.is_cuda and experts.w13_weight.dtype == FP8_DTYPE
    actual, tokens = cuda_greedy(fp8)
    _, again = cuda_greedy(load(fp8_dir, dtype=torch.bfloat16, device="cuda"))
    assert tokens == again
    oracle = load(dq_dir, dtype=torch.bfloat16, device="cuda")
    expected = LatentCudaDriver(oracle)
    rows = [expected.step([("a", PROMPT)])[0]]
    rows += [expected.step([("a", [t])])[0] for t in tokens]
    error = relative_error(actual[: len(PROMPT) + NUM_GREEDY], torch.cat(rows).cpu())
    print(f"block FP8 on CUDA: relative logits error {error:.4f} vs the dequantized bf16 model")
    assert error < 0.08, error


class _Compiled:
    """The model with its forward through the engine's compiled path (Dynamo with the token
    count unbacked, split at the MLA ops, Inductor pieces)."""

    def __init__(self, model: torch.nn.Module) -> None:
        from compile import build_compiled_forward
        from v1_engine.config import CompilationConfig

        self.model = model
        self.forward = build_compiled_forward(model, CompilationConfig(level=1))

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.forward(input_ids, positions)

    def __getattr__(self, name: str):
        return getattr(self.model, name)


def test_block_fp8_deepseek_compiles_and_follows_eager(checkpoint):
    """Block-FP8 DeepSeek-V3 (FP8 dense projections, FP8 experts) through torch.compile: it
    traces once with no symbolic bool between pieces, and prefill + absorbed decode logits stay
    with eager's (Inductor reorders float32 math; the FP8 rounding of activations may then flip
    a few values, so the bound is the FP8 logits bound, not bit equality)."""
    fp8_dir, _, _ = checkpoint
    model = load(fp8_dir)
    expected = prompt_logits(model)
    compiled = _Compiled(model)
    actual = prompt_logits(compiled)
    assert compiled.forward.stats.num_traces == 1
    error = ((actual - expected).norm() / expected.norm()).item()
    assert error < LOGITS_BOUND / 5, error
    assert (actual.argmax(-1) == expected.argmax(-1)).all()
