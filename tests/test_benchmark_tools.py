"""CPU-checkable pieces of the benchmark tools: benchmarks/ab_variants.py (each variant runs on
its own patches over the unpatched tree, and the tree comes back after every run, a failing or
timed-out one too), the max_model_len the benchmarks give the engine, and the GEMM table files
(`write_gemm_tables` / `apply_gemm_tables`, latency.py --gemm-tables)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import ab_variants
from bench_utils import apply_gemm_tables, benchmark_max_model_len, write_gemm_tables


def _run(tmp_path: Path, variants: list, command: str, *extra: str) -> str:
    spec = tmp_path / "variants.json"
    spec.write_text(json.dumps(variants))
    out = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks/ab_variants.py"), str(spec), command, *extra],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    return out.stdout


def test_variants_patch_run_and_restore(tmp_path):
    (tmp_path / "knob.py").write_text("STAGES = 2\nTILE = 64\n")
    variants = [
        ["base", []],
        ["stages 3", [["knob.py", "STAGES = 2", "STAGES = 3"]]],
        ["both", [["knob.py", "STAGES = 2", "STAGES = 4"], ["knob.py", "TILE = 64", "TILE = 32"]]],
    ]
    command = f"{sys.executable} -c \"import knob; print(f'| {{knob.STAGES}} | {{knob.TILE}} |')\""
    out = _run(tmp_path, variants, command)
    blocks = out.split("== ")[1:]
    assert [b.splitlines()[0].split(":")[0] for b in blocks] == ["base", "stages 3", "both"]
    assert "| 2 | 64 |" in blocks[0] and "| 3 | 64 |" in blocks[1] and "| 4 | 32 |" in blocks[2]
    assert (tmp_path / "knob.py").read_text() == "STAGES = 2\nTILE = 64\n"


def test_failing_and_timed_out_runs_restore(tmp_path):
    (tmp_path / "knob.py").write_text("X = 1\n")
    variants = [["fails", [["knob.py", "X = 1", "X = 2"]]]]
    out = _run(tmp_path, variants, "echo '| row |'; echo oops >&2; exit 3")
    assert "fails: rc=3" in out and "| row |" in out and "oops" in out
    assert (tmp_path / "knob.py").read_text() == "X = 1\n"
    out = _run(tmp_path, variants, "sleep 5", "--timeout", "0.5")
    assert "fails: timed out" in out
    assert (tmp_path / "knob.py").read_text() == "X = 1\n"


def test_missing_text_names_the_file_and_leaves_it(tmp_path):
    knob = tmp_path / "knob.py"
    knob.write_text("A = 1\nB = 2\n")
    with pytest.raises(ValueError, match="knob.py: the text to replace is not there: 'C = 3'"):
        ab_variants.apply_patches([(str(knob), "A = 1", "A = 5"), (str(knob), "C = 3", "C = 4")])
    assert knob.read_text() == "A = 1\nB = 2\n"
    spec = tmp_path / "bad.json"
    spec.write_text(json.dumps([["x", [["knob.py"]]]]))
    with pytest.raises(ValueError, match="variant 'x': a patch must be"):
        ab_variants.load_variants(str(spec))


def test_benchmark_max_model_len(tmp_path):
    # The model's own context by default (as a server runs it), raised to what the run needs;
    # an explicit length wins unless it is too short for the run.
    (tmp_path / "config.json").write_text(json.dumps({"max_position_embeddings": 8192}))
    assert benchmark_max_model_len(str(tmp_path), 321) == 8192
    assert benchmark_max_model_len(str(tmp_path), 16512) == 16512
    assert benchmark_max_model_len(str(tmp_path), 321, 1000) == 1000
    with pytest.raises(SystemExit, match="at least 500"):
        benchmark_max_model_len(str(tmp_path), 500, 100)


def test_whole_file_patches_create_and_restore(tmp_path):
    (tmp_path / "knob.py").write_text("X = 1\n")
    variants = [
        ["files", [["knob.py", "X = 7\n"], ["extra.py", "Y = 2\n"]]],
        ["base", []],
    ]
    (tmp_path / "show.py").write_text(
        "import os, knob\nprint(f'| {knob.X} | {os.path.exists(\"extra.py\")} |')\n"
    )
    command = f"{sys.executable} show.py"
    out = _run(tmp_path, variants, command)
    assert "| 7 | True |" in out.split("== base")[0] and "| 1 | False |" in out.split("== base")[1]
    assert (tmp_path / "knob.py").read_text() == "X = 1\n" and not (tmp_path / "extra.py").exists()


def test_make_variants_takes_files_from_a_commit(tmp_path):
    def git(*args):
        subprocess.run(["git", *args], cwd=tmp_path, check=True, capture_output=True)

    git("init", "-q")
    (tmp_path / "knob.py").write_text("X = 1\n")
    git("add", "knob.py")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "one")
    (tmp_path / "knob.py").write_text("X = 2\n")
    (tmp_path / "new.py").write_text("N = 1\n")  # not in the commit: left as it is
    subprocess.run(
        [sys.executable, str(ROOT / "benchmarks/ab_variants.py"), "--make", "ab.json"]
        + ["--rev", "HEAD", "knob.py", "new.py"],
        cwd=tmp_path,
        check=True,
        capture_output=True,
    )
    variants = json.loads((tmp_path / "ab.json").read_text())
    assert [name for name, _ in variants] == ["base", "HEAD", "base", "HEAD"]
    assert variants[1][1] == [["knob.py", "X = 1\n"]] and variants[0][1] == []


def test_gemm_tables_round_trip_into_the_dispatch_tables(tmp_path, monkeypatch):
    import math

    from v1_engine.kernels import fp8_cutlass, fp8_launch, gemm_cutlass, triton_mlp

    monkeypatch.setattr(gemm_cutlass, "GEMM_TUNED", {})
    monkeypatch.setattr(triton_mlp, "TUNED_LAUNCH", {})
    fp8_skinny = {"channel": {(1, 4096, 4096): None}, "block": {}}
    monkeypatch.setattr(fp8_launch, "FP8_TUNED_LAUNCH", fp8_skinny)
    monkeypatch.setattr(fp8_cutlass, "SCALED_MM_SHAPE_CONFIGS", {(32, 1, 1): 0})
    path = str(tmp_path / "tables.json")
    write_gemm_tables(path, "bf16", [[64, 6144, 4096, 2, "stream_k", 1]])
    write_gemm_tables(path, "fp8", [[32, 4096, 4096, 8], ["inf", 4096, 14336, 9]])
    write_gemm_tables(path, "bf16", [[64, 4096, 4096, 3, "split_k", 2]])  # replaces its kind
    write_gemm_tables(path, "fused_mlp", [[64, 14336, 4096, {"block_n1": 16}]])
    fma = {"mode": "fma", "block_n": 4, "block_k": 1024, "num_warps": 4, "num_stages": 4}
    write_gemm_tables(
        path, "fp8_skinny", [["channel", 1, 4096, 4096, fma], ["channel", 1, 6144, 4096, None]]
    )
    summary = apply_gemm_tables(path)
    assert "1 bf16 GEMM_TUNED entries, 2 FP8" in summary
    assert "2 FP8 skinny FP8_TUNED_LAUNCH entries" in summary
    assert fp8_skinny["channel"] == {(1, 4096, 4096): fma | {"split_k": 1}, (1, 6144, 4096): None}
    assert fp8_launch.prefers_fp8_skinny("channel", 1, 4096, 4096)
    assert not fp8_launch.prefers_fp8_skinny("channel", 1, 6144, 4096)
    launch = triton_mlp.TUNED_LAUNCH[(64, 14336, 4096)]
    assert launch["block_n1"] == 16 and set(launch) == set(triton_mlp.LAUNCH_KEYS)
    assert gemm_cutlass.GEMM_TUNED == {(64, 4096, 4096): (3, "split_k", 2)}
    assert fp8_cutlass.SCALED_MM_SHAPE_CONFIGS == {
        (32, 1, 1): 0,
        (32, 4096, 4096): 8,
        (math.inf, 4096, 14336): 9,
    }
    assert gemm_cutlass.prefers(48, 4096, 4096) == gemm_cutlass.ENABLED
    assert fp8_cutlass.scaled_mm_config(16, 4096, 4096) == 8
    with pytest.raises(ValueError, match="kind must be one of"):
        write_gemm_tables(path, "int8", [])
    (tmp_path / "bad.json").write_text(json.dumps({"fp16": []}))
    with pytest.raises(ValueError, match=r"unknown table kinds \['fp16'\]"):
        apply_gemm_tables(str(tmp_path / "bad.json"))


HELPER_MODULES = ("bench_utils.py", "skinny_configs.py")
"""Modules of benchmarks/ the scripts import; not run themselves."""
SCRIPTS = sorted(p.name for p in (ROOT / "benchmarks").glob("*.py") if p.name not in HELPER_MODULES)


@pytest.mark.parametrize("script", SCRIPTS)
def test_help_prints(script):
    """Every benchmark's --help works on a machine without a GPU (argparse formats each help
    string with %, so a bare percent sign in one breaks --help for the whole script)."""
    out = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / script), "--help"],
        check=False,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.startswith("usage:"), out.stdout[:200]


@pytest.mark.parametrize(
    "kind", ["bf16", "channel", "block", "weight_only", "gated", "norm", "norm_gated"]
)
def test_skinny_sweep_builds_only_launches_the_kernels_take(kind):
    """Every config sweep_skinny_gemm.py builds for a kind (bodies, splits; benchmarks/
    skinny_configs.py) resolves in the kernel's own launch rules at each decode M the sweep
    runs it at, so a device call never spends its time on configs the kernel rejects; the block
    kind's fma body is swept, one 128-wide group a K step, split too; the FP8 kinds' wgmma body
    early, split too."""
    import skinny_configs as sweep
    from sweep_skinny_gemm import SHAPES

    from v1_engine.kernels import fp8_launch, skinny_launch

    configs = sweep.sweep_configs(kind, [2, 4], None)
    # The norm kinds fold the norm in front of qkv / gate_up (K = the hidden size: their wgmma
    # body holds the row in registers); the others take the longest K.
    n, k = SHAPES["gate_up" if kind in ("norm", "norm_gated") else "down"]
    ran = 0
    for launch in configs:
        for m in (1, 2, 4, 16, 64):
            if not sweep.applies(kind, launch, m) or (kind in fp8_launch.DECODE_KINDS and m > 4):
                continue
            if kind == "bf16":
                resolved = skinny_launch.resolve_launch(m, n, k, launch)
            else:
                resolved = fp8_launch.resolve_fp8_launch(kind, m, n, k, launch)
            assert resolved["mode"] == launch["mode"] and resolved["block_n"] == launch["block_n"]
            ran += 1
    assert ran > 0
    fma = [c for c in configs if c["mode"] == "fma"]
    if fma:  # the most float32 accumulator values a thread first (64 at M = 1)
        per_thread = [c["block_n"] * c["block_k"] // (32 * c["num_warps"]) for c in fma]
        gated = 2 if kind in ("gated", "norm_gated") else 1
        assert per_thread[0] * gated == 64 and per_thread[0] == max(per_thread)
    if kind == "block":
        assert fma and {c["block_k"] for c in fma} == {fp8_launch.SCALE_GROUP}
        assert fma[0]["block_n"] == 64 and any(c.get("split_k", 1) == 4 for c in fma)
    wgmma = [c for c in configs if c["mode"] == "wgmma"]
    if kind in ("channel", "block", "gated", "norm", "norm_gated"):  # the FP8 MMA body early
        assert wgmma and all(c["block_n"] % 64 == 0 for c in wgmma)
        assert any(c["mode"] == "wgmma" for c in configs[:8])
        assert any(c.get("split_k", 1) == 4 for c in wgmma) == (kind in ("channel", "block"))
    else:
        assert not wgmma
    assert sweep.sweep_configs(kind, [], ["fma"]) == [c for c in configs if c["mode"] == "fma"
                                                     and c.get("split_k", 1) == 1]  # fmt: skip
    if kind in fp8_launch.DECODE_KINDS:
        assert all(c.get("split_k", 1) == 1 for c in configs)
        assert sorted(map(str, fma + wgmma)) == sorted(map(str, configs))


def test_skinny_sweep_table_takes_the_fastest_launch_of_any_body(capsys):
    """report() prints the fastest launch of each other body too; the table entry (and the
    --json row) must still be the overall fastest launch, or None where the baseline is faster
    (a loop over the other bodies once overwrote it with the last one printed)."""
    from sweep_skinny_gemm import report

    fma = {"mode": "fma", "block_n": 16, "block_k": 512, "num_warps": 4, "num_stages": 3}
    wgmma = {"mode": "wgmma", "block_n": 64, "block_k": 256, "num_warps": 4, "num_stages": 3}
    key = (1, 6144, 4096)
    timed = [(13.3, "", wgmma), (12.1, "default", fma)]
    assert report("norm", "qkv", 6144, 4096, {1: (12.8, list(timed))}) == {key: fma}
    assert "fastest wgmma:    13.3 us" in capsys.readouterr().out
    timed = [(45.1, "", fma), (43.2, "", wgmma)]
    assert report("norm_gated", "gate_up", 28672, 4096, {1: (50.3, timed)}) == {
        (1, 28672, 4096): wgmma
    }
    assert report("norm", "qkv", 6144, 4096, {1: (12.0, [(12.1, "", fma)])}) == {key: None}


def test_blas_library_benchmark_names_a_winner_past_three_percent():
    from benchmark_blas_library import LIBRARIES, faster

    assert LIBRARIES == ("cublas", "cublaslt")  # torch.backends.cuda.preferred_blas_library's
    assert faster({"cublas": 17.3, "cublaslt": 12.4}) == "cublaslt"
    assert faster({"cublas": 10.0, "cublaslt": 10.5}) == "cublas"
    assert faster({"cublas": 10.0, "cublaslt": 10.2}) is None
    assert faster({"cublas": 10.2, "cublaslt": 10.0}) is None


def test_fused_mlp_candidates_are_valid_launches():
    """Every launch benchmark_fused_mlp.py times resolves in the kernel's launch rules at the M
    it is timed at (a bad key would cost a device call its candidates)."""
    from benchmark_fused_mlp import CANDIDATES, HIDDEN, INTERMEDIATE

    from v1_engine.kernels import triton_mlp

    for group, ms in (("decode", (1, 4)), ("small", (8, 16)), ("large", (32, 64))):
        for launch in CANDIDATES[group]:
            for m in ms:
                resolved = triton_mlp.resolve_launch(m, INTERMEDIATE, HIDDEN, HIDDEN, launch)
                assert all(resolved[key] == value for key, value in launch.items())
    # Both phases fma: a tensor-core phase would pad the fma body's rows to 16 too (it spills).
    assert all(c["mode1"] == c["mode2"] == "fma" for c in CANDIDATES["decode"])


def test_fp8_accuracy_compares_a_variant_with_its_reference(tmp_path):
    """benchmarks/fp8_accuracy.py's comparison: the reference against itself is exact; the model
    with FP8 weights and head is not, and its teacher-forced run sees the reference's tokens."""
    import torch

    sys.path.insert(0, str(ROOT / "tests" / "models"))
    import fp8_accuracy
    from model_helpers import save_scaled_tiny_llama

    from v1_engine.attention.selector import get_attn_backend
    from v1_engine.models.loader import get_model, load_hf_config

    save_scaled_tiny_llama(tmp_path)

    def build(quantization=None, lm_head="none"):
        return get_model(load_hf_config(tmp_path), tmp_path, dtype=torch.float32,
                         device=torch.device("cpu"), load_format="auto", seed=0,
                         quantization=quantization, lm_head_quantization=lm_head)  # fmt: skip

    reference, backend, f32 = build(), get_attn_backend(torch.device("cpu")), torch.float32
    prompt = [3, 17, 42, 5]
    same = fp8_accuracy.compare_prompt(reference, reference, backend, f32, f32, prompt, 6)
    assert (same.max_abs_diff, same.top1_agree, same.common_prefix) == (0.0, 6, 6)
    head = build("fp8", "fp8")
    fp8 = fp8_accuracy.compare_prompt(reference, head, backend, f32, f32, prompt, 6)
    assert fp8.max_abs_diff > 0.0 and fp8.num_tokens == 6 and fp8.num_elements == 6 * 256
    assert fp8.common_prefix <= fp8.top1_agree <= 6


def test_gpu_suite_patches_find_their_text():
    """The suite's engine A/Bs patch source text on the device, where a patch that no longer
    matches would cost a device call: each old text must still occur in its file."""
    suite = (ROOT / "benchmarks" / "gpu_suite.sh").read_text()
    launch = (ROOT / "v1_engine" / "kernels" / "attention_launch.py").read_text()
    assert '"FUSED_MERGE_MAX_SPLITS = 8"' in suite
    assert "\nFUSED_MERGE_MAX_SPLITS = 8\n" in launch
    epilogues = (ROOT / "v1_engine" / "kernels" / "skinny_epilogues.py").read_text()
    assert 'old = "NORM_IN_M_BUCKETS: tuple[int, ...] = ()"' in suite
    assert "\nNORM_IN_M_BUCKETS: tuple[int, ...] = ()\n" in epilogues
    decode = (ROOT / "v1_engine" / "kernels" / "triton_gemv_fp8_decode.py").read_text()
    assert '"EARLY_RELEASE_PER_SM = 2"' in suite and "\nEARLY_RELEASE_PER_SM = 2\n" in decode


def test_decode_roofline_rate_follows_the_card():
    """latency.py's HBM rate: the H200's fixed figure (the goals are stated in it), never a
    measurement there; any other card's own copy rate, measured."""
    from bench_utils import HBM_BYTES_PER_S, hbm_bytes_per_s

    measured = []

    def measure():
        measured.append(1)
        return 2.9e12

    assert hbm_bytes_per_s("NVIDIA H200", measure)[0] == HBM_BYTES_PER_S and not measured
    rate, source = hbm_bytes_per_s("NVIDIA H100 80GB HBM3", measure)
    assert rate == 2.9e12 and measured == [1] and "H100" in source


def test_latency_compilation_config_from_pass_options():
    """latency.py's pass options: none gives the bare level; --add-fusion-passes goes on top of
    the default set, --drop-fusion-passes leaves a default pass out (the A/B of a default pass),
    --fusion-passes replaces the set."""
    from latency import compilation_config

    from v1_engine.config import CompilationConfig

    default = CompilationConfig().effective_fusion_passes("cuda")
    assert "fp8_norm_linear" in default and "skinny_norm_linear" not in default
    assert compilation_config(2, None, None) == 2
    added = compilation_config(2, None, "skinny_norm_linear")
    assert added == {"level": 2, "fusion_passes": default + ["skinny_norm_linear"]}
    dropped = compilation_config(2, None, None, "fp8_norm_linear")
    assert dropped == {"level": 2, "fusion_passes": [p for p in default if p != "fp8_norm_linear"]}
    with pytest.raises(ValueError, match="fp8_norm_lienar"):
        compilation_config(2, None, None, "fp8_norm_lienar")
    assert compilation_config(1, "add_rms_norm,rope_kv_cache", None, "rope_kv_cache") == {
        "level": 1,
        "fusion_passes": ["add_rms_norm"],
    }


def test_decode_timeline_counts_overlap_once_and_finds_the_gaps():
    """profile_decode.decode_timeline on a made-up trace of two decode steps: overlapping kernels
    (as PDL runs them) count once toward the busy time; a gap before a step's first kernel is the
    host's, one inside the step is listed by the kernels around it."""
    from types import SimpleNamespace

    import profile_decode
    import torch

    cuda = torch.autograd.DeviceType.CUDA

    def kernel(name, start, end):
        return SimpleNamespace(
            name=name,
            device_type=cuda,
            device_time=end - start,
            time_range=SimpleNamespace(start=start, end=end),
        )

    events = [
        kernel("_row_argmax_kernel", 0, 10),  # the prefill step's
        kernel("gemm_a", 15, 40),  # 5 us waiting for the host
        kernel("attention", 35, 60),  # overlaps gemm_a by 5 us
        kernel("gemm_b", 62, 80),  # 2 us between attention and gemm_b
        kernel("_row_argmax_kernel", 80, 90),
        kernel("gemm_a", 90, 120),  # no gap: starts as the argmax ends
        kernel("attention", 120, 140),
        kernel("gemm_b", 146, 170),  # 6 us
        kernel("_row_argmax_kernel", 170, 180),
    ]
    prof = SimpleNamespace(events=lambda: events)
    text = profile_decode.decode_timeline(prof, steps=2)
    # Spans 80 and 90 us; busy 73 and 84 (the overlap counted once); idle 7 and 6.
    first = text.splitlines()[0]
    assert "span 85.0 us" in first and "GPU busy 78.5 us" in first, first
    assert "idle 6.5 us" in first and "(2.5 before its first kernel)" in first, first
    rows = text.splitlines()[1:]
    assert rows[0].split() == ["4.0", "us", "a", "step", "1.0", "x", "attention", "->", "gemm_b"]
    assert rows[1].split()[:6] == ["2.5", "us", "a", "step", "0.5", "x"]
    assert rows[1].endswith("_row_argmax_kernel -> gemm_a")
    with pytest.raises(SystemExit, match="expected 3 argmax kernels"):
        profile_decode.decode_timeline(SimpleNamespace(events=lambda: events[:-1]), steps=2)
