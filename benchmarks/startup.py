"""Start-up to first token, cold and warm compile cache, with the engine's breakdown.

Each start is a fresh Python process (so no in-memory cache helps): it builds an LLM on a config
of benchmarks/configs with dummy weights, generates one token, and reports the wall time from
process start to that token plus the runner's breakdown (weight load, KV allocation, Dynamo,
Inductor, graph capture). The first start uses an empty compile-cache directory (cold); the
second reuses it (warm).

    python benchmarks/startup.py --model llama3-8b --append
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
import json, sys, time
start = time.perf_counter()
from v1_engine import LLM, SamplingParams
llm = LLM(model=sys.argv[1], load_format="dummy", dtype="bfloat16", max_model_len=2048,
          compilation_config=int(sys.argv[2]), gpu_memory_utilization=0.85)
ready = time.perf_counter() - start
out = llm.generate(["Hello"], SamplingParams(max_tokens=1), use_tqdm=False)
first = time.perf_counter() - start
runner = llm.engine_core.model_runner
print("STARTUP " + json.dumps({"first_token_s": first, "ready_s": ready,
                               "breakdown": runner.startup_s}))
"""


def one_start(path: str, level: int, cache_dir: str) -> dict:
    env = dict(os.environ, V1ENGINE_COMPILE_CACHE=cache_dir)
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
    args = parser.parse_args()
    path, _ = model_dir(args.model, min_positions=2048)
    with tempfile.TemporaryDirectory(prefix="v1engine-compile-cache-") as cache_dir:
        runs = [("cold", one_start(path, args.compilation_level, cache_dir))]
        runs.append(("warm", one_start(path, args.compilation_level, cache_dir)))
    stages = list(runs[0][1]["breakdown"])
    lines = [
        (
            f"model {args.model} (dummy weights, bf16), -O{args.compilation_level}; seconds from "
            "process start"
        ),
        "",
        "| cache | first token | engine ready | " + " | ".join(stages) + " |",
        "| --- | ---: | ---: | " + " | ".join("---:" for _ in stages) + " |",
    ]
    for name, run in runs:
        cells = " | ".join(f"{run['breakdown'].get(s, 0.0):.1f}" for s in stages)
        lines.append(f"| {name} | {run['first_token_s']:.1f} | {run['ready_s']:.1f} | {cells} |")
    table = "\n".join(lines)
    print(table)
    if args.append:
        append_results(f"startup: {args.model}", "python " + " ".join(sys.argv), table)


if __name__ == "__main__":
    main()
