"""Times the fused RMSNorm / SiLU-and-mul + dynamic FP8 quant kernels (kernels/triton_fused_quant.py)
at prefill sizes, over warps per program, against the unfused ops in the same run.

For M tokens of the Llama-3-8B widths (hidden 4096, MLP 14336), per-token and 1x128-group
scales: each kernel's launch as the op makes it (recorded from a real call), then the same
launch with other warp counts, and with register caps (`maxnreg`) that let an SM hold two or more
programs, as microseconds and bandwidth on the bytes it must move (input read once, e4m3 output
and scales written once; the norm also writes the residual sum). The unfused reference is the
eager SiLU-and-mul followed by our FP8 quant op, which is also timed alone.
`_launch` in triton_fused_quant.py is set from this.

    python benchmarks/sweep_fused_quant.py --tokens 4096
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from triton.testing import do_bench_cudagraph

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from v1_engine.kernels import fp8
from v1_engine.kernels import triton_fused_quant as fused_quant

KERNELS = (fused_quant._silu_and_mul_quant_kernel, fused_quant._rms_norm_quant_kernel)
_recorded: dict[str, tuple[tuple, tuple, dict]] = {}


def _record_launches() -> None:
    """Wraps each kernel's `run` so a launch also records its grid and arguments."""
    for kernel in KERNELS:
        launch = kernel.run

        def run(*args, grid, warmup, _kernel=kernel, _launch=launch, **kwargs):
            _recorded[_kernel.fn.__name__] = (grid, args, dict(kwargs))
            return _launch(*args, grid=grid, warmup=warmup, **kwargs)

        kernel.run = run


def time_us(fn) -> float:
    """Mean device time of fn replayed in a CUDA graph, as the engine runs it: a launch from
    Python (tens of us through a custom op) would time the host for the shortest kernels."""
    return do_bench_cudagraph(fn, rep=60) * 1e3


def time_launch(kernel, name: str, **overrides) -> float:
    grid, args, kwargs = _recorded[name]
    launch_keys = ("warmup", "num_warps", "maxnreg")
    kwargs = {k: v for k, v in kwargs.items() if k not in launch_keys} | overrides
    return time_us(lambda: kernel[grid](*args, **kwargs))


def rate(nbytes: int, us: float) -> str:
    return f"{us:7.1f} us {nbytes / us / 1e6:5.2f} TB/s"


def _launches(warps: list[int], caps: list[int]) -> list[dict]:
    """Warp counts, each also with the register caps that let an SM hold more programs."""
    return [{"num_warps": w} for w in warps] + [
        {"num_warps": w, "maxnreg": cap} for w in warps for cap in caps if w * 32 * cap <= 32768
    ]


def _label(launch: dict, recorded: dict) -> str:
    cap = f", maxnreg {launch['maxnreg']}" if "maxnreg" in launch else ""
    default_launch = {k: v for k, v in recorded.items() if k in ("num_warps", "maxnreg")}
    default = " (default)" if launch == default_launch else ""
    return f"{launch['num_warps']:2d} warps{cap}:".ljust(24) + default


def sweep(
    tokens: int, hidden: int, inter: int, group: int | None, warps: list[int], caps: list[int]
) -> None:
    dev, bf16 = torch.device("cuda"), torch.bfloat16
    gen = torch.Generator(device=dev).manual_seed(0)
    gate_up = torch.randn(tokens, 2 * inter, dtype=bf16, device=dev, generator=gen)
    x = torch.randn(tokens, hidden, dtype=bf16, device=dev, generator=gen)
    residual = torch.randn(tokens, hidden, dtype=bf16, device=dev, generator=gen)
    weight = torch.ones(hidden, dtype=bf16, device=dev)
    label = "per-token" if group is None else f"{group}-groups"

    fused_quant.silu_and_mul_quant(gate_up, group)
    grid, _, kwargs = _recorded["_silu_and_mul_quant_kernel"]
    nbytes = gate_up.numel() * 2 + gate_up.numel() // 2
    print(f"SiLU-and-mul + quant, {tokens} x {inter}, {label}: grid {grid}, BLOCK "
          f"{kwargs['BLOCK']}, one-pass group {kwargs['ONE_PASS_GROUP']}")  # fmt: skip
    for launch in _launches(warps, caps):
        us = time_launch(fused_quant._silu_and_mul_quant_kernel, "_silu_and_mul_quant_kernel",
                         **launch)  # fmt: skip
        print(f"  {_label(launch, kwargs)} {rate(nbytes, us)}")

    def unfused():
        y = torch.nn.functional.silu(gate_up[:, :inter]) * gate_up[:, inter:]
        if group is None:
            return fp8.per_token_fp8_quant(y)
        return fp8.per_token_group_fp8_quant(y, group)

    print(f"  unfused (eager SiLU-and-mul, then the quant op): {rate(nbytes, time_us(unfused))}")

    fused_quant.rms_norm_quant(x, residual, weight, 1e-6, group)
    _, _, kwargs = _recorded["_rms_norm_quant_kernel"]
    nbytes = x.numel() * (2 + 2 + 2 + 1)  # x, residual in; residual sum, e4m3 out
    print(f"add + RMSNorm + quant, {tokens} x {hidden}, {label}: BLOCK {kwargs['BLOCK']}, "
          f"one-pass group {kwargs['ONE_PASS_GROUP']}")  # fmt: skip
    # A 4k-wide row gives 32 warps 4 values each: up to 16.
    for launch in _launches([w for w in warps if w <= 16], caps):
        us = time_launch(fused_quant._rms_norm_quant_kernel, "_rms_norm_quant_kernel",
                         **launch)  # fmt: skip
        print(f"  {_label(launch, kwargs)} {rate(nbytes, us)}")

    def quant_alone():
        if group is None:
            return fp8.per_token_fp8_quant(x)
        return fp8.per_token_group_fp8_quant(x, group)

    nbytes = x.numel() * (2 + 1)
    print(f"  the quant op alone on {tokens} x {hidden} (o_proj's input): "
          f"{rate(nbytes, time_us(quant_alone))}")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--intermediate", type=int, default=14336)
    parser.add_argument("--warps", default="4,8,16,32")
    parser.add_argument(
        "--register-caps", default="32,64", help="maxnreg values also timed where they fit"
    )
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("sweep_fused_quant.py times CUDA kernels: no CUDA device here")
    _record_launches()
    warps = [int(w) for w in args.warps.split(",")]
    caps = [int(c) for c in args.register_caps.split(",") if c]
    for group in (None, fp8.BLOCK_SIZE):
        sweep(args.tokens, args.hidden, args.intermediate, group, warps, caps)


if __name__ == "__main__":
    main()
