"""Serving benchmark: stream completions from a running v1serve (or any OpenAI-compatible server)
and report request throughput, output tokens/s, TTFT, ITL, TPOT and end-to-end latency.

Requests arrive as a Poisson process (or at a fixed rate, or all at once) with random or fixed
input/output lengths. Prompts are token-id lists cut from tokenized text, so every request has
exactly the input length asked for; `ignore_eos` makes it generate exactly its output length.
A PNG of the latency distributions is written next to the printed table.

With `--urgent-fraction F` a random F of the requests is urgent: sent with `priority` -1 (the
others 0) for a server started with `--scheduling-policy priority`, and the latencies of both
groups are reported apart; `--no-send-priority` keeps the same split but sends no priority (the
same workload against an fcfs server, for comparison).

    v1serve &                                   # default model on 127.0.0.1:8000
    python benchmarks/benchmark_serving.py --num-prompts 64 --request-rate 4 \
        --input-len 128 --output-len 64 --plot benchmarks/serving_latency.png
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from dataclasses import asdict, dataclass, field

import httpx
import numpy as np

SOURCE_TEXT = (
    "The printing press changed how ideas travelled. Rainbows form when sunlight is refracted, "
    "reflected and dispersed in water droplets. Bread needs flour, water, salt and yeast, and "
    "time for the dough to rise. In chess, each side starts with sixteen pieces. The sky looks "
    "blue because air scatters short wavelengths more than long ones. Honey bees communicate "
    "the direction of flowers with a waggle dance. Vaccines train the immune system to "
    "recognise a pathogen. Water evaporates, condenses into clouds and falls again as rain. "
)


@dataclass
class RequestResult:
    ok: bool
    input_len: int
    output_len: int = 0
    ttft: float = 0.0
    e2e: float = 0.0
    itls: list[float] = field(default_factory=list)
    error: str = ""
    urgent: bool = False


@dataclass
class Request:
    prompt: list[int]
    output_len: int
    urgent: bool = False


async def make_requests(client: httpx.AsyncClient, args: argparse.Namespace) -> list[Request]:
    """Token-id prompts of the requested lengths, cut at random offsets from tokenized text."""
    response = await client.post("/tokenize", json={"prompt": SOURCE_TEXT * 40})
    response.raise_for_status()
    pool = response.json()["tokens"]
    rng = random.Random(args.seed)
    requests = []
    for _ in range(args.num_prompts):
        input_len = _sample_len(rng, args.input_len, args.range_ratio)
        output_len = _sample_len(rng, args.output_len, args.range_ratio)
        start = rng.randrange(0, len(pool) - input_len)
        urgent = rng.random() < args.urgent_fraction
        requests.append(Request(pool[start : start + input_len], output_len, urgent))
    return requests


def _sample_len(rng: random.Random, mean: int, range_ratio: float) -> int:
    low, high = int(mean * (1 - range_ratio)), int(mean * (1 + range_ratio))
    return max(1, rng.randint(low, high))


def arrival_gaps(args: argparse.Namespace) -> list[float]:
    """Seconds to wait before each request: exponential (Poisson), constant, or none."""
    if args.request_rate == float("inf"):
        return [0.0] * args.num_prompts
    if args.arrival == "fixed":
        return [1.0 / args.request_rate] * args.num_prompts
    rng = np.random.default_rng(args.seed)
    return list(rng.exponential(1.0 / args.request_rate, size=args.num_prompts))


async def send(
    client: httpx.AsyncClient, model: str, request: Request, send_priority: bool = False
) -> RequestResult:
    body = {
        "model": model,
        "prompt": request.prompt,
        "max_tokens": request.output_len,
        "ignore_eos": True,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if send_priority and request.urgent:
        body["priority"] = -1
    result = RequestResult(ok=False, input_len=len(request.prompt), urgent=request.urgent)
    start = last = time.perf_counter()
    try:
        async with client.stream("POST", "/v1/completions", json=body) as response:
            if response.status_code != 200:
                result.error = (await response.aread()).decode()[:200]
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                now = time.perf_counter()
                if chunk.get("usage"):
                    result.output_len = chunk["usage"]["completion_tokens"]
                if not chunk.get("choices") or not chunk["choices"][0].get("text"):
                    continue
                if result.ttft == 0.0:
                    result.ttft = now - start
                else:
                    result.itls.append(now - last)
                last = now
        result.e2e = time.perf_counter() - start
        result.ok = result.output_len > 0
    except httpx.HTTPError as e:
        result.error = f"{type(e).__name__}: {e}"
    return result


async def run(args: argparse.Namespace) -> tuple[list[RequestResult], float]:
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(
        base_url=args.base_url, headers=headers, timeout=args.timeout, limits=limits
    ) as client:
        models = (await client.get("/v1/models")).json()["data"]
        model = args.model or models[0]["id"]
        requests = await make_requests(client, args)
        await send(client, model, Request(requests[0].prompt[:8], 2))  # warm-up, not measured
        semaphore = asyncio.Semaphore(args.max_concurrency or len(requests))

        async def limited(request: Request) -> RequestResult:
            async with semaphore:
                return await send(client, model, request, args.send_priority)

        tasks = []
        start = time.perf_counter()
        for gap, request in zip(arrival_gaps(args), requests):
            await asyncio.sleep(gap)
            tasks.append(asyncio.create_task(limited(request)))
        results = await asyncio.gather(*tasks)
        return results, time.perf_counter() - start


def summarize(results: list[RequestResult], duration: float) -> dict[str, float]:
    done = [r for r in results if r.ok]
    ms = 1000.0
    ttft = np.array([r.ttft for r in done]) * ms
    itl = np.array([x for r in done for x in r.itls]) * ms
    tpot = np.array([(r.e2e - r.ttft) / (r.output_len - 1) for r in done if r.output_len > 1]) * ms
    e2e = np.array([r.e2e for r in done]) * ms
    output_tokens = sum(r.output_len for r in done)
    summary = {
        "completed": len(done),
        "failed": len(results) - len(done),
        "duration_s": duration,
        "total_input_tokens": sum(r.input_len for r in done),
        "total_output_tokens": output_tokens,
        "request_throughput_rps": len(done) / duration,
        "output_throughput_tok_s": output_tokens / duration,
        "total_throughput_tok_s": (output_tokens + sum(r.input_len for r in done)) / duration,
    }
    for name, values in (("ttft", ttft), ("itl", itl), ("tpot", tpot), ("e2e", e2e)):
        if len(values):
            summary[f"mean_{name}_ms"] = float(values.mean())
            summary[f"p50_{name}_ms"] = float(np.percentile(values, 50))
            summary[f"p99_{name}_ms"] = float(np.percentile(values, 99))
    if any(r.urgent for r in done):
        for group, urgent in (("urgent", True), ("normal", False)):
            members = [r for r in done if r.urgent == urgent]
            summary[f"{group}_requests"] = len(members)
            for name in ("ttft", "e2e"):
                values = np.array([getattr(r, name) for r in members]) * ms
                if len(values):
                    summary[f"{group}_p50_{name}_ms"] = float(np.percentile(values, 50))
                    summary[f"{group}_p99_{name}_ms"] = float(np.percentile(values, 99))
    return summary


def print_summary(summary: dict[str, float], args: argparse.Namespace) -> None:
    rate = "inf" if args.request_rate == float("inf") else f"{args.request_rate:g}/s {args.arrival}"
    print(f"{'=' * 18} Serving benchmark {'=' * 18}")
    print(f"{'Arrivals':<36}{rate:>18}")
    for key, value in summary.items():
        text = f"{value:.2f}" if isinstance(value, float) else str(value)
        print(f"{key:<36}{text:>18}")
    print("=" * 54)


def plot(results: list[RequestResult], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    done = [r for r in results if r.ok]
    series = {
        "TTFT (ms)": [r.ttft * 1000 for r in done],
        "ITL (ms)": [x * 1000 for r in done for x in r.itls],
        "End-to-end latency (ms)": [r.e2e * 1000 for r in done],
    }
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    for ax, (label, values) in zip(axes, series.items()):
        if values:
            ax.hist(values, bins=40, color="tab:blue", alpha=0.8)
            for q, style in ((50, "--"), (99, ":")):
                ax.axvline(
                    np.percentile(values, q),
                    color="black",
                    linestyle=style,
                    label=f"p{q} {np.percentile(values, q):.0f}",
                )
            ax.legend()
        ax.set_xlabel(label)
        ax.set_ylabel("count")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"latency plot written to {path}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--base-url", default="http://127.0.0.1:8000", help="server URL")
    p.add_argument("--model", default=None, help="model name (default: the server's first)")
    p.add_argument("--api-key", default=None, help="sent as 'Authorization: Bearer KEY'")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", type=int, default=128, help="mean prompt length in tokens")
    p.add_argument("--output-len", type=int, default=64, help="mean output length in tokens")
    p.add_argument(
        "--range-ratio",
        type=float,
        default=0.0,
        help="lengths are uniform in [len*(1-r), len*(1+r)]; 0 = fixed lengths",
    )
    p.add_argument(
        "--request-rate",
        type=float,
        default=float("inf"),
        help="requests per second (default inf: all at once)",
    )
    p.add_argument(
        "--arrival",
        choices=("poisson", "fixed"),
        default="poisson",
        help="inter-arrival times: exponential (Poisson process) or constant",
    )
    p.add_argument("--max-concurrency", type=int, default=None, help="most requests in flight")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--urgent-fraction",
        type=float,
        default=0.0,
        help="this fraction of the requests is urgent (priority -1; the rest 0), its latencies "
        "reported apart",
    )
    p.add_argument(
        "--send-priority",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="send the urgent requests' priority (off: the same split for an fcfs server)",
    )
    p.add_argument("--timeout", type=float, default=600.0, help="per-request timeout (s)")
    p.add_argument("--plot", default="serving_latency.png", help="PNG of latency distributions")
    p.add_argument("--save-json", default=None, help="write the summary and arguments here")
    args = p.parse_args(argv)
    if not 0.0 <= args.range_ratio < 1.0:
        p.error(f"--range-ratio must be in [0, 1), got {args.range_ratio}")
    if args.request_rate <= 0:
        p.error(f"--request-rate must be > 0, got {args.request_rate}")
    if not 0.0 <= args.urgent_fraction <= 1.0:
        p.error(f"--urgent-fraction must be in [0, 1], got {args.urgent_fraction}")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    results, duration = asyncio.run(run(args))
    failures = [r.error for r in results if not r.ok]
    if failures:
        print(f"{len(failures)} requests failed; first error: {failures[0]}")
    summary = summarize(results, duration)
    print_summary(summary, args)
    title = (
        f"{args.num_prompts} requests, in {args.input_len} / out {args.output_len} tokens, "
        f"rate {args.request_rate:g}/s"
    )
    plot(results, args.plot, title)
    if args.save_json:
        with open(args.save_json, "w") as f:
            json.dump(
                {"args": vars(args), "summary": summary, "requests": [asdict(r) for r in results]},
                f,
                indent=1,
                default=str,
            )


if __name__ == "__main__":
    main()
