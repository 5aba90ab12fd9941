"""Start-up to first token, cold and warm compile cache, with the engine's breakdown.

Each start is a fresh Python process (so no in-memory cache helps): it builds an LLM on a config
of benchmarks/configs with dummy weights, generates one token, and reports the wall time from
process start to that token plus the runner's breakdown (weight load, KV allocation, Dynamo,
Inductor, graph capture). The first start uses an empty compile-cache directory (cold); the
second reuses it (warm).

Python bytecode: a pip install writes `.pyc` files next to the sources, but a read-only
site-packages (as on the GPU test image) has none, and every start then re-compiles thousands of
torch/transformers modules (about 12 s). The benchmark therefore first writes the bytecode of
torch, triton, transformers and v1engine into a private cache (`PYTHONPYCACHEPREFIX`), as an
install would, and both starts use it; `--no-prime-bytecode` measures without it.

    python benchmarks/startup.py --model llama3-8b --append
    python benchmarks/startup.py --profile-warm /tmp/warm.prof.txt   # + where a warm start goes
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_utils import append_results, model_dir

REPO = Path(__file__).resolve().parent.parent

_CHILD = r"""
import cProfile, io, json, os, pstats, sys, time
start = time.perf_counter()
from v1_engine import LLM, SamplingParams
imported = time.perf_counter() - start
profile_path = os.environ.get("V1ENGINE_STARTUP_PROFILE")
profiler = cProfile.Profile() if profile_path else None
if profiler is not None:
    profiler.enable()
llm = LLM(model=sys.argv[1], load_format="dummy", dtype="bfloat16", max_model_len=2048,
          compilation_config=int(sys.argv[2]), gpu_memory_utilization=0.85)
if profiler is not None:
    profiler.disable()
    text = io.StringIO()
    stats = pstats.Stats(profiler, stream=text)
    stats.sort_stats("cumulative").print_stats(60)
    stats.sort_stats("tottime").print_stats(40)
    with open(profile_path, "w") as f:
        f.write(text.getvalue())
ready = time.perf_counter() - start
out = llm.generate(["Hello"], SamplingParams(max_tokens=1), use_tqdm=False)
first = time.perf_counter() - start
runner = llm.engine_core.model_runner
print("STARTUP " + json.dumps({"first_token_s": first, "ready_s": ready, "import_s": imported,
                               "breakdown": runner.startup_s}))
"""


_BYTECODE_PACKAGES = ("torch", "triton", "transformers", "sympy", "v1_engine", "compile")


def prime_bytecode(prefix: str) -> float:
    """Compile the bytecode of the packages a start imports into `prefix`; seconds taken."""
    import importlib.util
    import time

    dirs = []
    for name in _BYTECODE_PACKAGES:
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.submodule_search_locations:
            dirs.extend(spec.submodule_search_locations)
    env = dict(os.environ, PYTHONPYCACHEPREFIX=prefix)
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    start = time.perf_counter()
    subprocess.run(
        [sys.executable, "-m", "compileall", "-q", "-j", "0", *dirs],
        env=env,
        capture_output=True,
        check=False,  # a few test files of those packages do not compile: not our concern
    )
    return time.perf_counter() - start


def one_start(
    path: str, level: int, cache_dir: str, pycache: str | None, profile: str | None = None
) -> dict:
    env = dict(os.environ, V1ENGINE_COMPILE_CACHE=cache_dir)
    if profile is not None:
        env["V1ENGINE_STARTUP_PROFILE"] = profile
    if pycache is not None:
        env["PYTHONPYCACHEPREFIX"] = pycache
        env.pop("PYTHONDONTWRITEBYTECODE", None)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    result = subprocess.run(
        [sys.executable, "-c", _CHILD, path, str(level)],
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    if result.returncode != 0:
        sys.stderr.write(result.stderr[-4000:])
        raise SystemExit(f"start-up run failed with exit code {result.returncode}")
    line = next(x for x in result.stdout.splitlines() if x.startswith("STARTUP "))
    return json.loads(line.removeprefix("STARTUP "))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="llama3-8b", help="a folder of benchmarks/configs")
    parser.add_argument("--compilation-level", type=int, default=2)
    parser.add_argument("--append", action="store_true", help="append to benchmarks/RESULTS.md")
    parser.add_argument(
        "--no-prime-bytecode", action="store_true", help="start without a bytecode cache"
    )
    parser.add_argument(
        "--profile-warm",
        metavar="FILE",
        default=None,
        help="a third, warm start under cProfile (engine construction): top functions to FILE",
    )
    args = parser.parse_args()
    path, _ = model_dir(args.model, min_positions=2048)
    with tempfile.TemporaryDirectory(prefix="v1engine-startup-") as tmp:
        cache_dir, pycache = os.path.join(tmp, "compile"), None
        note = "no bytecode cache"
        if not args.no_prime_bytecode:
            pycache = os.path.join(tmp, "pycache")
            note = f"bytecode primed first ({prime_bytecode(pycache):.0f} s, not counted)"
        runs = [("cold", one_start(path, args.compilation_level, cache_dir, pycache))]
        runs.append(("warm", one_start(path, args.compilation_level, cache_dir, pycache)))
        if args.profile_warm:
            one_start(path, args.compilation_level, cache_dir, pycache, args.profile_warm)
    stages = list(runs[0][1]["breakdown"])
    lines = [
        (
            f"model {args.model} (dummy weights, bf16), -O{args.compilation_level}; seconds from "
            f"process start; {note}"
        ),
        "",
        "| cache | first token | engine ready | import | " + " | ".join(stages) + " |",
        "| --- | ---: | ---: | ---: | " + " | ".join("---:" for _ in stages) + " |",
    ]
    for name, run in runs:
        cells = " | ".join(f"{run['breakdown'].get(s, 0.0):.1f}" for s in stages)
        lines.append(
            f"| {name} | {run['first_token_s']:.1f} | {run['ready_s']:.1f} | "
            f"{run['import_s']:.1f} | {cells} |"
        )
    table = "\n".join(lines)
    print(table)
    if args.append:
        append_results(f"startup: {args.model}", "python " + " ".join(sys.argv), table)


if __name__ == "__main__":
    main()
