"""How much of the core loop's CPU work hides behind device execution, async scheduling on/off.

Runs an in-process EngineCore with `--num-requests` requests decoding together and records, per
step: CPU time to schedule, to prepare inputs, to update from the output and to process outputs
in the front-end, the device time of the step, and the step's wall time. The hidden CPU time of
a step is `cpu + device - wall` (clamped to [0, cpu]): zero when everything runs in sequence.

Device time is measured with CUDA events around execute_model on a GPU (no extra sync inside the
loop) and as the forward pass's wall time on CPU, where nothing can overlap: the CPU run shows the
structure of the measurement, not an overlap. Copy the printed table into benchmarks/RESULTS.md
with the date, commit and machine.

    python benchmarks/benchmark_core_overlap.py --num-requests 64 --output-len 64
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from v1_engine import LLM, SamplingParams
from v1_engine.engine.output_processor import OutputKind

CPU_PARTS = ("schedule", "prepare_inputs", "update_from_output", "process_outputs")


class StepTimer:
    """Wraps methods of live objects to accumulate their wall time into the current step."""

    def __init__(self, use_cuda_events: bool) -> None:
        self.use_cuda_events = use_cuda_events
        self.current: dict[str, float] = defaultdict(float)
        self.steps: list[dict[str, float]] = []
        self._events: list[tuple[Any, Any]] = []

    def wrap(self, owner: Any, method: str, part: str) -> None:
        original: Callable[..., Any] = getattr(owner, method)

        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                self.current[part] += time.perf_counter() - start

        setattr(owner, method, timed)

    def wrap_device(self, owner: Any, method: str) -> None:
        """Device time of `method`: CUDA events on a GPU, its wall time on CPU."""
        if not self.use_cuda_events:
            self.wrap(owner, method, "device")
            return
        original: Callable[..., Any] = getattr(owner, method)

        def timed(*args: Any, **kwargs: Any) -> Any:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            result = original(*args, **kwargs)
            end.record()
            self._events.append((start, end))
            return result

        setattr(owner, method, timed)

    def end_step(self, wall: float) -> None:
        if not self.use_cuda_events:
            # On CPU, execute_model's wall time includes the input preparation timed separately.
            self.current["device"] -= self.current.get("prepare_inputs", 0.0)
        self.current["wall"] = wall
        self.steps.append(dict(self.current))
        self.current = defaultdict(float)

    def finish(self) -> None:
        """Resolve the CUDA events once, after the run, so timing adds no sync to the loop."""
        if not self.use_cuda_events:
            return
        torch.cuda.synchronize()
        device_times = [start.elapsed_time(end) / 1e3 for start, end in self._events]
        for step, device in zip(self.steps, device_times):
            step["device"] = device


def run(args: argparse.Namespace, async_scheduling: bool) -> list[dict[str, float]]:
    llm = LLM(
        args.model,
        async_scheduling=async_scheduling,
        max_num_seqs=args.num_requests,
        load_format=args.load_format,
        dtype=args.dtype,
        gpu_memory_utilization=args.gpu_memory_utilization,
    )
    core = llm.engine_core
    timer = StepTimer(use_cuda_events=core.model_runner.device.type == "cuda")
    timer.wrap(core.scheduler, "schedule", "schedule")
    timer.wrap(core.scheduler, "update_from_output", "update_from_output")
    timer.wrap(core.model_runner, "_prepare_inputs", "prepare_inputs")
    timer.wrap_device(core.model_runner, "execute_model")
    timer.wrap(llm.output_processor, "process_outputs", "process_outputs")

    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    prompt = [1] + [100 + i for i in range(args.input_len - 1)]
    core_requests = []
    for i in range(args.num_requests):
        core_requests += llm.input_processor.process_fan_out(str(i), prompt, params)
    for request in core_requests:
        llm.output_processor.add_request(request, None, OutputKind.FINAL_ONLY)
        core.add_request(request)
    while core.has_unfinished_requests():
        start = time.perf_counter()
        processed = llm.output_processor.process_outputs(core.step())
        if processed.reqs_to_abort:
            core.abort_requests(processed.reqs_to_abort)
        timer.end_step(time.perf_counter() - start)
    timer.finish()
    del llm, core
    gc.collect()  # the timing wrappers form reference cycles; free the KV pool before the next run
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return timer.steps


def summarize(steps: list[dict[str, float]], warmup: int) -> dict[str, float]:
    steps = steps[warmup:]
    cpu = [sum(s.get(p, 0.0) for p in CPU_PARTS) for s in steps]
    hidden = [min(c, max(0.0, c + s.get("device", 0.0) - s["wall"])) for c, s in zip(cpu, steps)]
    summary = {f"{p}_ms": 1e3 * statistics.median(s.get(p, 0.0) for s in steps) for p in CPU_PARTS}
    summary["cpu_ms"] = 1e3 * statistics.median(cpu)
    summary["device_ms"] = 1e3 * statistics.median(s.get("device", 0.0) for s in steps)
    summary["wall_ms"] = 1e3 * statistics.median(s["wall"] for s in steps)
    summary["hidden_pct"] = 100.0 * sum(hidden) / max(sum(cpu), 1e-12)
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--load-format", default="auto")
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--warmup-steps", type=int, default=5)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.5)
    parser.add_argument("--append", action="store_true", help="append to benchmarks/RESULTS.md")
    args = parser.parse_args()
    rows = {}
    for async_scheduling in (False, True):
        steps = run(args, async_scheduling)
        rows["on" if async_scheduling else "off"] = summarize(steps, args.warmup_steps)
    columns = list(rows["off"])
    lines = [
        (
            f"{args.num_requests} requests, {args.input_len}-token prompts, {args.output_len} output "
            f"tokens; medians per step after {args.warmup_steps} warm-up steps (ms); hidden_pct = "
            "share of the CPU work overlapped with device execution"
        ),
        "",
        "| async | " + " | ".join(columns) + " |",
        "|---" * (len(columns) + 1) + "|",
    ]
    for name, summary in rows.items():
        lines.append(f"| {name} | " + " | ".join(f"{summary[c]:.2f}" for c in columns) + " |")
    print("\n".join(lines))
    if args.append:
        sys.path.insert(0, str(Path(__file__).parent))
        from bench_utils import append_results, machine

        append_results(
            f"core overlap ({machine().split(',')[0]})",
            "python benchmarks/benchmark_core_overlap.py " + " ".join(sys.argv[1:]),
            "\n".join(lines),
        )


if __name__ == "__main__":
    main()
