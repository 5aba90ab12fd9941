"""The on-disk compile cache: keys that change with what decides the code, and a warm start that
skips Inductor's work (measured in fresh processes, so no in-memory cache can help)."""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from compile import aot, cache
from v1_engine.config import CompilationConfig, EngineConfig

REPO = Path(__file__).resolve().parents[2]


def test_key_depends_on_parts_versions_and_source(monkeypatch):
    base = cache.cache_key({"model": {"hidden_size": 64}, "dtype": "float32"})
    assert base == cache.cache_key({"dtype": "float32", "model": {"hidden_size": 64}})
    assert base != cache.cache_key({"model": {"hidden_size": 65}, "dtype": "float32"})
    monkeypatch.setattr(cache.torch, "__version__", "0.0.0-other")
    assert base != cache.cache_key({"model": {"hidden_size": 64}, "dtype": "float32"})
    monkeypatch.undo()
    cache.source_hash.cache_clear()
    monkeypatch.setattr(cache, "source_hash", lambda: "edited")
    assert base != cache.cache_key({"model": {"hidden_size": 64}, "dtype": "float32"})


def test_source_hash_covers_both_packages():
    digest = cache.source_hash()
    assert len(digest) == 64 and digest == cache.source_hash()


def test_cache_dirs_and_off_switch(monkeypatch, tmp_path):
    monkeypatch.setenv(cache.CACHE_ENV_VAR, str(tmp_path))
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    monkeypatch.delenv("TRITON_CACHE_DIR", raising=False)
    directory = cache.use_compile_cache({"x": 1})
    assert directory is not None and directory.parent == tmp_path
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(directory / "inductor")
    assert os.environ["TRITON_CACHE_DIR"] == str(directory / "triton")
    assert cache.use_compile_cache({"x": 2}) != directory
    monkeypatch.setenv(cache.CACHE_ENV_VAR, "off")
    assert cache.use_compile_cache({"x": 1}) is None


def test_default_level_is_two_on_cuda_and_eager_on_cpu():
    config = EngineConfig.from_kwargs().compilation_config
    assert config.effective_level("cuda") == 2
    assert config.effective_level("cpu") == 0
    assert CompilationConfig(level=1).effective_level("cuda") == 1
    assert CompilationConfig(enforce_eager=True).effective_level("cuda") == 0


def test_capture_sizes():
    sizes = CompilationConfig().capture_sizes(limit=1024)
    assert sizes[:5] == [1, 2, 4, 8, 16] and sizes[-1] == 512
    assert 248 in sizes and 256 in sizes and 272 in sizes and 260 not in sizes
    assert sizes == sorted(set(sizes))
    assert CompilationConfig().capture_sizes(limit=100)[-1] == 100
    assert CompilationConfig(max_cudagraph_capture_size=8).capture_sizes(64) == [1, 2, 4, 8]
    explicit = CompilationConfig(cudagraph_capture_sizes=[4, 1, 64, 2])
    assert explicit.capture_sizes(limit=32) == [1, 2, 4]


def test_piecewise_sizes():
    """Level 2 pads mixed batches onto a coarse ladder (full graphs take uniform decodes); level
    1 captures the decode list; an explicit list wins at any level (piecewise_capture_sizes, else
    cudagraph_capture_sizes); all capped by the limit."""
    ladder = CompilationConfig().piecewise_sizes(limit=8192, level=2)
    assert ladder == [1, 2, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512]
    assert all(b <= a * 2 for a, b in itertools.pairwise(ladder))  # pads by less than 2x
    assert all(b <= a * 3 // 2 for a, b in itertools.pairwise(ladder[2:]))  # ... a third from 4 up
    assert CompilationConfig().piecewise_sizes(limit=100, level=2)[-3:] == [64, 96, 100]
    assert CompilationConfig().piecewise_sizes(1024, 1) == CompilationConfig().capture_sizes(1024)
    explicit = CompilationConfig(piecewise_capture_sizes=[64, 8, 1000])
    assert explicit.piecewise_sizes(limit=512, level=2) == [8, 64]
    both = CompilationConfig(cudagraph_capture_sizes=[4, 16, 64])  # the one list serves both
    assert both.piecewise_sizes(limit=512, level=2) == [4, 16, 64]
    with pytest.raises(ValueError, match="piecewise_capture_sizes must be positive ints"):
        CompilationConfig(piecewise_capture_sizes=[0]).verify()


_START = """
import json, os, sys
from v1_engine import LLM, SamplingParams
llm = LLM(sys.argv[1], max_model_len=128, num_kv_blocks=32, compilation_config=1)
runner = llm.engine_core.model_runner
params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
tokens = llm.generate(["The capital of France is"], params, use_tqdm=False)[0].outputs[0].token_ids
print(json.dumps({"inductor_s": runner.startup_s["Inductor"], "tokens": list(tokens),
                  "dir": os.environ["TORCHINDUCTOR_CACHE_DIR"],
                  "loaded": runner._forward.stats.loaded,
                  "traces": runner._forward.stats.num_traces}))
"""


def _launch(model_dir: Path, cache_root: Path) -> subprocess.Popen:
    env = dict(os.environ, V1ENGINE_COMPILE_CACHE=str(cache_root), PYTHONPATH=str(REPO))
    return subprocess.Popen(
        [sys.executable, "-c", _START, str(model_dir)],
        env=env,
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _result(process: subprocess.Popen) -> dict:
    stdout, stderr = process.communicate(timeout=600)
    assert process.returncode == 0, stderr[-3000:]
    return json.loads(stdout.strip().splitlines()[-1])


def _start(model_dir: Path, cache_root: Path) -> dict:
    return _result(_launch(model_dir, cache_root))


@pytest.mark.slow
def test_warm_start_skips_dynamo_and_inductor(tiny_llama_dir, tmp_path):
    """The cold start traces and saves the forward (compile/aot.py); the warm one loads it (no
    Dynamo trace) and finds Inductor's pieces cached, and generates the same tokens."""
    cold = _start(tiny_llama_dir, tmp_path)
    warm = _start(tiny_llama_dir, tmp_path)
    assert cold["dir"] == warm["dir"]
    assert any(Path(cold["dir"]).rglob("*")), "the cold start wrote no artifacts"
    assert warm["inductor_s"] < 0.5 * cold["inductor_s"], (cold, warm)
    assert warm["tokens"] == cold["tokens"]
    if aot.supported():
        assert (Path(cold["dir"]).parent / aot.ARTIFACT).is_file()
        assert (cold["loaded"], warm["loaded"]) == (False, True)
    assert cold["traces"] == warm["traces"] == 1


@pytest.mark.slow
def test_unreadable_saved_forward_falls_back_to_tracing(tiny_llama_dir, tmp_path):
    """A damaged forward.aot costs a trace, never the start: the engine traces, serves the
    same tokens, and saves a good artifact again for the next start."""
    if not aot.supported():
        pytest.skip("this torch cannot compile ahead of time")
    cold = _start(tiny_llama_dir, tmp_path)
    artifact = Path(cold["dir"]).parent / aot.ARTIFACT
    artifact.write_bytes(b"not a saved forward")
    again = _start(tiny_llama_dir, tmp_path)
    assert again["tokens"] == cold["tokens"] and not again["loaded"]
    assert artifact.read_bytes() != b"not a saved forward"
    assert _start(tiny_llama_dir, tmp_path)["loaded"]


@pytest.mark.slow
def test_concurrent_cold_starts_share_the_cache(tiny_llama_dir, tmp_path):
    """Two processes compiling the same model into one empty cache at the same time both
    succeed (Inductor and Triton publish each artifact by an atomic rename), agree, and leave
    a cache a third start reads warm."""
    first, second = _launch(tiny_llama_dir, tmp_path), _launch(tiny_llama_dir, tmp_path)
    a, b = _result(first), _result(second)
    assert a["dir"] == b["dir"] and a["tokens"] == b["tokens"]
    warm = _start(tiny_llama_dir, tmp_path)
    assert warm["tokens"] == a["tokens"]
    assert warm["inductor_s"] < 0.5 * max(a["inductor_s"], b["inductor_s"]), (a, b, warm)


def test_aot_switch_turns_the_saved_forward_off(tiny_llama_dir, tmp_path, monkeypatch):
    """V1ENGINE_AOT_COMPILE=0: the engine traces with torch.compile and saves no forward."""
    from v1_engine import LLM

    monkeypatch.setenv(aot.ENV_VAR, "0")
    monkeypatch.setenv(cache.CACHE_ENV_VAR, str(tmp_path))
    assert not aot.supported()
    llm = LLM(str(tiny_llama_dir), max_model_len=128, num_kv_blocks=32, compilation_config=1)
    forward = llm.engine_core.model_runner._forward
    assert forward._aot is None and not forward.stats.loaded and forward.stats.num_traces == 1
    assert not list(tmp_path.rglob(aot.ARTIFACT))
