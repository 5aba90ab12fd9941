"""Shared pieces of the GPU benchmarks: model directories from configs, ceilings, rooflines.

A benchmark model is a real Hugging Face config from benchmarks/configs/ run with dummy weights.
The engine also loads a tokenizer from the model directory, so `model_dir` assembles a temporary
directory: the config plus the default model's tokenizer files (from $V1ENGINE_TOKENIZER_DIR, else
the embedded default model). The tokenizer only detokenizes outputs here; prompts are token ids.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

CONFIG_ROOT = Path(__file__).resolve().parent / "configs"
RESULTS_PATH = Path(__file__).resolve().parent / "RESULTS.md"
HBM_BYTES_PER_S = 4.29e12  # measured device-to-device copy on the H200 (read + write)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def tokenizer_source() -> Path:
    env = os.environ.get("V1ENGINE_TOKENIZER_DIR")
    if env:
        return Path(env)
    from v1_engine.models.loader import resolve_model_path

    return resolve_model_path(None)


def model_dir(name: str, min_positions: int = 0) -> tuple[str, str]:
    """(directory, note): config `name` + tokenizer in a temp dir.

    If `min_positions` exceeds the config's max_position_embeddings, the copy raises it (the
    compute per token is unchanged; only RoPE would be extrapolated) and the note says so.
    """
    config = json.loads((CONFIG_ROOT / name / "config.json").read_text())
    note = ""
    if min_positions > config["max_position_embeddings"]:
        note = (
            f"max_position_embeddings raised {config['max_position_embeddings']} -> "
            f"{min_positions} for timing"
        )
        config["max_position_embeddings"] = min_positions
    out = Path(tempfile.mkdtemp(prefix=f"v1e-bench-{name}-"))
    (out / "config.json").write_text(json.dumps(config, indent=2))
    source = tokenizer_source()
    for file in TOKENIZER_FILES:
        if (source / file).is_file():
            shutil.copy(source / file, out / file)
    return str(out), note


def benchmark_max_model_len(path: str, needed: int, requested: int | None = None) -> int:
    """The max_model_len a benchmark gives the engine: `requested` when set (SystemExit if below
    `needed`), else the model's own context (the max_position_embeddings of the config in `path`,
    what a server runs with), raised to `needed`. Decode CUDA graphs are captured for this
    length and their split-KV factor follows it, so a just-enough length would time graphs no
    deployment of the model runs."""
    if requested is not None:
        if requested < needed:
            raise SystemExit(f"--max-model-len must be at least {needed} for this run")
        return requested
    config = json.loads((Path(path) / "config.json").read_text())
    return max(needed, int(config["max_position_embeddings"]))


@dataclass(frozen=True)
class ModelShape:
    """Parameter and KV sizes of a config, for rooflines (bf16 unless a dtype size is given)."""

    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tied: bool

    @classmethod
    def from_config(cls, name: str) -> ModelShape:
        c = json.loads((CONFIG_ROOT / name / "config.json").read_text())
        return cls(
            layers=c["num_hidden_layers"],
            hidden=c["hidden_size"],
            intermediate=c["intermediate_size"],
            heads=c["num_attention_heads"],
            kv_heads=c["num_key_value_heads"],
            head_dim=c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"],
            vocab=c["vocab_size"],
            tied=bool(c.get("tie_word_embeddings", False)),
        )

    @property
    def layer_params(self) -> int:
        qkv = self.hidden * (self.heads + 2 * self.kv_heads) * self.head_dim
        o = self.heads * self.head_dim * self.hidden
        mlp = 3 * self.hidden * self.intermediate
        return self.layers * (qkv + o + mlp + 2 * self.hidden)

    @property
    def lm_head_params(self) -> int:
        return self.vocab * self.hidden

    def decode_weight_bytes(self, elem: int = 2) -> int:
        """Weights one decode step reads: all but the input embedding (a gather of B rows)."""
        return (self.layer_params + self.lm_head_params + self.hidden) * elem

    def kv_bytes_per_token(self, elem: int = 2) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * elem

    def prefill_flops(self, prompt_len: int, logits_rows: int = 1) -> float:
        """Matmul FLOPs of one prompt: projections + MLP per token, causal attention, lm_head."""
        dense = 2.0 * self.layer_params * prompt_len
        attention = (
            4.0 * self.layers * self.heads * self.head_dim * prompt_len * (prompt_len + 1) / 2
        )
        return dense + attention + 2.0 * self.lm_head_params * logits_rows


def cuda_time_ms(fn, warmup: int = 3, repeat: int = 10) -> float:
    """Median milliseconds of fn() timed with CUDA events after warm-up, one call at a time from
    an idle device: the host's launch work is included (graph_time_ms excludes it)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeat):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def graph_time_ms(fn, calls: int = 20, repeat: int = 10) -> float:
    """Median device milliseconds per call of fn(), `calls` launches captured in one CUDA graph
    (how the engine's decode graphs run kernels: no host overhead between them). fn must be
    capturable: no host syncs; its allocations come from the graph's pool."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    times = []
    for _ in range(repeat):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / calls)
    del graph
    return sorted(times)[len(times) // 2]


def measure_gemm_tflops(m: int = 4096, n: int = 4096, k: int = 4096) -> float:
    """bf16 torch.mm rate on random inputs, the ceiling the prefill figures are judged by."""
    a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(k, n, device="cuda", dtype=torch.bfloat16)
    ms = cuda_time_ms(lambda: torch.mm(a, b), warmup=5, repeat=20)
    return 2.0 * m * n * k / (ms * 1e-3) / 1e12


def measure_copy_bytes_per_s(nbytes: int = 1 << 30) -> float:
    """Device-to-device copy rate (bytes read + written per second) of a `nbytes` buffer, best
    of 10: how HBM_BYTES_PER_S was measured on the H200."""
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    cuda_time_ms(lambda: dst.copy_(src), warmup=3, repeat=1)
    best = min(cuda_time_ms(lambda: dst.copy_(src), warmup=0, repeat=1) for _ in range(10))
    return 2.0 * nbytes / (best * 1e-3)


def hbm_bytes_per_s(device_name: str, measure=measure_copy_bytes_per_s) -> tuple[float, str]:
    """(rate, how it was found) the decode rooflines use on `device_name`: the H200's fixed
    HBM_BYTES_PER_S, the figure the issues' goals are stated in, or on any other card its own
    copy rate measured now (so an H100's roofline column is its own, not the H200's)."""
    if "H200" in device_name:
        return HBM_BYTES_PER_S, "the H200's measured copy rate"
    return measure(), f"copy rate measured on this {device_name}"


def commit() -> str:
    env = os.environ.get("BENCH_COMMIT")
    if env:
        return env
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True
        )
        return out.stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def machine() -> str:
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        gpu = f"{props.name} ({props.total_memory / 2**30:.0f} GiB)"
    else:
        gpu = "no GPU"
    return f"{gpu}, torch {torch.__version__}, {platform.node()}"


SWITCHES = (
    "V1ENGINE_PDL",
    "V1ENGINE_SKINNY_GEMM",
    "V1ENGINE_CUTLASS_GEMM",
    "V1ENGINE_FP8_GEMV",
    "V1ENGINE_ATTENTION_BACKEND",
    "TORCH_BLAS_PREFER_CUBLASLT",
)
"""Environment variables that change which kernels run: a result section records those set."""


def switches() -> str:
    """The SWITCHES set in the environment, e.g. `V1ENGINE_PDL=0`, or "defaults"."""
    set_ones = [f"{name}={os.environ[name]}" for name in SWITCHES if name in os.environ]
    return " ".join(set_ones) or "defaults"


def append_results(title: str, command: str, body: str) -> None:
    """Append a dated section (commit, machine, switches, command, body) to
    benchmarks/RESULTS.md."""
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    if not RESULTS_PATH.exists():
        RESULTS_PATH.write_text("# Benchmark results\n\nSections are appended by the scripts.\n")
    section = (
        f"\n## {title}\n\n- date: {date}\n- commit: {commit()}\n- machine: {machine()}\n"
        f"- switches: {switches()}\n- command: `{command}`\n\n{body.rstrip()}\n"
    )
    with RESULTS_PATH.open("a") as f:
        f.write(section)


TABLE_KINDS = ("bf16", "fp8", "fp8_skinny", "fused_mlp")


def read_gemm_tables(path: str) -> dict[str, list]:
    """The tables of a `write_gemm_tables` file by kind ({} where the file does not exist)."""
    file = Path(path)
    return json.loads(file.read_text()) if file.exists() else {}


def write_gemm_tables(path: str, kind: str, rows: list[list]) -> None:
    """Writes (or adds to) a GEMM table file that `apply_gemm_tables` reads: `kind` "bf16" rows
    are GEMM_TUNED entries [M bucket, N, K, config, decomposition, splits]
    (kernels/gemm_cutlass.py), "fp8" rows SCALED_MM_SHAPE_CONFIGS entries [M bucket bound, N,
    K, config] (kernels/fp8_cutlass.py), "fp8_skinny" rows FP8_TUNED_LAUNCH entries [kind, M
    bucket, N, K, launch dict or None] (kernels/fp8_launch.py), "fused_mlp" rows
    TUNED_LAUNCH entries [M bucket, I, N, launch dict] (kernels/triton_mlp.py)."""
    if kind not in TABLE_KINDS:
        raise ValueError(f"kind must be one of {TABLE_KINDS}, got {kind!r}")
    tables = read_gemm_tables(path)
    tables[kind] = rows
    Path(path).write_text(json.dumps(tables))


def apply_gemm_tables(path: str) -> str:
    """Adds the entries of a `write_gemm_tables` file to the dispatch tables of this process (an
    engine in this process then runs them: an A/B before the entries are committed). Returns a
    one-line account of what was set."""
    import math

    from v1_engine.kernels import fp8_cutlass, fp8_launch, gemm_cutlass, triton_mlp

    tables = json.loads(Path(path).read_text())
    unknown = set(tables) - set(TABLE_KINDS)
    if unknown:
        raise ValueError(f"{path}: unknown table kinds {sorted(unknown)}; allowed: {TABLE_KINDS}")
    for bucket, n, k, config, decomposition, splits in tables.get("bf16", []):
        gemm_cutlass.GEMM_TUNED[(int(bucket), int(n), int(k))] = (
            int(config),
            str(decomposition),
            int(splits),
        )
    for bound, n, k, config in tables.get("fp8", []):
        key = (math.inf if bound in (None, "inf") else int(bound), int(n), int(k))
        fp8_cutlass.SCALED_MM_SHAPE_CONFIGS[key] = int(config)
    for kind, bucket, n, k, launch in tables.get("fp8_skinny", []):
        key = (int(bucket), int(n), int(k))
        fp8_launch.FP8_TUNED_LAUNCH[kind][key] = (
            None if launch is None else fp8_launch.resolve_fp8_launch(kind, *key, launch)
        )
    for bucket, i, n, launch in tables.get("fused_mlp", []):
        key = (int(bucket), int(i), int(n))
        triton_mlp.TUNED_LAUNCH[key] = triton_mlp.resolve_launch(int(bucket), int(i), int(n), 0,
                                                                 launch)  # fmt: skip
    return (
        f"GEMM tables from {path}: {len(tables.get('bf16', []))} bf16 GEMM_TUNED entries, "
        f"{len(tables.get('fp8', []))} FP8 SCALED_MM_SHAPE_CONFIGS entries, "
        f"{len(tables.get('fp8_skinny', []))} FP8 skinny FP8_TUNED_LAUNCH entries, "
        f"{len(tables.get('fused_mlp', []))} fused MLP TUNED_LAUNCH entries"
    )
