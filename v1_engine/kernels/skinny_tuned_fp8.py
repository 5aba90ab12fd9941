"""The FP8 skinny GEMMs' measured launch tables (kernels/triton_gemv_fp8.py; read by the launch
rules of kernels/fp8_launch.py), per kind: data, kept apart from the kernels as
kernels/skinny_tuned.py is for bf16. `python benchmarks/sweep_skinny_gemm.py --fp8 KIND` prints
a kind's table with the swept entries replaced (`--json F` writes them for `latency.py
--gemm-tables`); paste it here."""

from __future__ import annotations

_BLOCK_S4 = {"mode": "dot_swap", "block_n": 32, "block_k": 128, "num_warps": 4, "num_stages": 4}
_BLOCK_S6 = _BLOCK_S4 | {"num_stages": 6}
_BLOCK_S3 = _BLOCK_S4 | {"num_stages": 3}
_SPLIT2 = _BLOCK_S4 | {"split_k": 2}
_SPLIT4 = _BLOCK_S3 | {"split_k": 4}
_SPLIT8 = _BLOCK_S3 | {"split_k": 8}

_FMA = {"mode": "fma", "num_warps": 4}
_WGMMA_K128 = {"mode": "wgmma", "block_n": 64, "block_k": 128, "num_warps": 4, "num_stages": 4}
_FMA_QKV = _FMA | {"block_n": 16, "block_k": 512, "num_stages": 4}
_FMA_O_PROJ = _FMA_QKV | {"block_n": 8}
_FMA_GATE_UP = _FMA | {"block_n": 8, "block_k": 1024, "num_stages": 6}
_FMA_DOWN = _FMA_GATE_UP | {"num_stages": 3}

FP8_TUNED_LAUNCH: dict[str, dict[tuple[int, int, int], dict[str, int | str] | None]] = {
    "channel": {
        (1, 6144, 4096): _FMA_QKV,
        (2, 6144, 4096): None,
        (4, 6144, 4096): None,
        (8, 6144, 4096): None,
        (16, 6144, 4096): None,
        (1, 4096, 4096): _FMA_O_PROJ,
        (2, 4096, 4096): None,
        (4, 4096, 4096): None,
        (8, 4096, 4096): None,
        (16, 4096, 4096): None,
        (1, 28672, 4096): _FMA_GATE_UP,
        (2, 28672, 4096): None,
        (4, 28672, 4096): None,
        (8, 28672, 4096): None,
        (16, 28672, 4096): None,
        (1, 4096, 14336): _FMA_DOWN,
        (2, 4096, 14336): None,
        (4, 4096, 14336): None,
        (8, 4096, 14336): None,
        (16, 4096, 14336): None,
    },
    "block": {
        # Llama-3-8B
        (1, 6144, 4096): _SPLIT4,
        (2, 6144, 4096): _SPLIT4,
        (4, 6144, 4096): _SPLIT4,
        (8, 6144, 4096): _SPLIT4,
        (16, 6144, 4096): _SPLIT4,
        (32, 6144, 4096): None,
        (64, 6144, 4096): None,
        (1, 4096, 4096): _SPLIT8,
        (2, 4096, 4096): _SPLIT8,
        (4, 4096, 4096): _SPLIT8,
        (8, 4096, 4096): _SPLIT8,
        (16, 4096, 4096): _SPLIT8,
        (32, 4096, 4096): _BLOCK_S6 | {"block_n": 16},
        (64, 4096, 4096): None,
        (1, 28672, 4096): _BLOCK_S4,
        (2, 28672, 4096): _BLOCK_S4,
        (4, 28672, 4096): _BLOCK_S4,
        (8, 28672, 4096): _BLOCK_S4,
        (16, 28672, 4096): _BLOCK_S3,
        (32, 28672, 4096): None,
        (64, 28672, 4096): None,
        (1, 4096, 14336): _SPLIT8,
        (2, 4096, 14336): _SPLIT8,
        (4, 4096, 14336): _SPLIT8,
        (8, 4096, 14336): _SPLIT8,
        (16, 4096, 14336): _SPLIT8,
        (32, 4096, 14336): None,
        (64, 4096, 14336): None,
        # Llama-3-70B (at one GPU's width)
        (1, 10240, 8192): _SPLIT2,
        (2, 10240, 8192): _SPLIT2,
        (4, 10240, 8192): _SPLIT2,
        (8, 10240, 8192): _SPLIT2,
        (16, 10240, 8192): _SPLIT2,
        (64, 10240, 8192): None,
        (1, 8192, 8192): _SPLIT4,
        (2, 8192, 8192): _SPLIT4,
        (4, 8192, 8192): _SPLIT4,
        (8, 8192, 8192): _SPLIT4,
        (16, 8192, 8192): _SPLIT4,
        (64, 8192, 8192): None,
        (1, 57344, 8192): _BLOCK_S6,
        (2, 57344, 8192): _BLOCK_S6,
        (4, 57344, 8192): _BLOCK_S6,
        (8, 57344, 8192): _BLOCK_S6,
        (16, 57344, 8192): _BLOCK_S6,
        (64, 57344, 8192): None,
        (1, 8192, 28672): _SPLIT4,
        (2, 8192, 28672): _SPLIT4,
        (4, 8192, 28672): _SPLIT4,
        (8, 8192, 28672): _SPLIT4,
        (16, 8192, 28672): _SPLIT4,
        (64, 8192, 28672): None,
    },
    "weight_only": {
        (1, 4096, 4096): _FMA_O_PROJ,
        (1, 4096, 14336): _FMA_DOWN,
        (1, 128256, 4096): _FMA_GATE_UP,
    },
    "gated": {
        (1, 28672, 4096): _WGMMA_K128,
    },
    "norm": {
        (1, 6144, 4096): _FMA | {"block_n": 16, "block_k": 512, "num_stages": 3},
    },
    "norm_gated": {
        (1, 28672, 4096): _FMA | {"block_n": 16, "block_k": 256, "num_stages": 3},
    },
}
"""Measured launch configs per kind, keyed by (M bucket, N, K) as skinny_tuned.TUNED_LAUNCH; None
marks a shape where the CUTLASS kernel measured as fast or faster: the ops run the Triton kernel
only for shapes with a config. From `python benchmarks/sweep_skinny_gemm.py --fp8 channel|block
--shapes qkv,o_proj,gate_up,down` on the H200 (2026-12-03, benchmarks/RESULTS.md "FP8 skinny
GEMM sweep"): the per-channel CUTLASS GEMM kept every Llama-3-8B shape (the best Triton config
was 0.89-1.01x of it); the block-scaled one lost every shape, by 1.04-1.34x. Buckets 32 and 64
(M 17..64), `--fp8 block --m 32,64 --seconds 8` (2026-12-03 14:59): Triton keeps o_proj (13.4 vs
15.2 us at 32, 14.5 vs 15.2 at 64); CUTLASS keeps qkv (0.89 / 0.70x), gate_up (0.79 / 0.58x)
and down (0.94 / 0.84x), where the activation tile every program re-reads grows with M.

Split-K, `--fp8 channel|block --m 1,16,64 --split-k 2,4,8 --seconds 12` over the 8B and 70B
shapes (2026-12-03, RESULTS.md "Split-K for the FP8 skinny GEMMs"): block-scaled at M 1 and 16
runs split launches (8B o_proj 14.1 -> 9.1 us, down 36.1 -> 20.2, qkv 15.7 -> 11.8; 70B o_proj
29.8 -> 22.1, down 80.1 -> 65.2, qkv 35.9 -> 28.2) or, on the wide gate_up shapes, unsplit ones
(1.14x); CUTLASS keeps M = 64 (8B o_proj a tie, 15.2 vs 15.1 us). `--m 2,4,8` (same run)
picked the same launches as M = 1 and 16 on every shape swept (all but 8B gate_up, which keeps
its entries). Per-channel CUTLASS still beat every split launch at M 1..64 (best 0.84-0.94x on
8B; 70B qkv 1.02-1.05x, too close to take).

M = 1 entries of the channel kind and of the two decode kinds ("weight_only": bf16 activations
times the e4m3 weight; "gated": gate_up with SiLU-and-mul in the epilogue): the "fma" body, from
`--fp8 channel --modes fma,wgmma --split-k 2,4 --m 1`, `--fp8 gated --m 1` and `--fp8
weight_only --m 1` on an H100 (2026-12-05 09:55 UTC, RESULTS.md "FP8 batch-1 decode measured on
an H100"; no H200 was lent that session): 1.03-1.10x CUTLASS on every Llama-3-8B shape (qkv 11.5
vs 12.5 us, o_proj 8.9 vs 9.4, gate_up 41.1 vs 42.2, down 22.7 vs 24.1; gated gate_up 41.3 vs
CUTLASS + SiLU-quant 45.4; weight_only down 22.8 vs 24.1), the wgmma body nowhere first. In
the engine (same call) FP8 batch-1 decode went 3.451 -> 3.377 ms with the channel entries, 3.287
with the fp8_gated_mlp pass on top. M 2..64 are not swept for these bodies (no entry: CUTLASS,
or the block kind's dot_swap).

Re-swept at M = 1 on the H200 (2026-12-05 13:30 UTC, RESULTS.md "FP8 batch-1 decode on the
H200: ..."; `--fp8 channel --modes fma --shapes qkv,o_proj,gate_up,down`, `--fp8 gated`,
`--fp8 weight_only --shapes down`): qkv, o_proj and down (both kinds) kept their H100 launches
(8.9 vs CUTLASS 10.0 us, 7.0 vs 7.5, 16.7 vs 17.6); channel gate_up moved to block_n 8 (30.6
vs 30.7; the H100's block_n 4 took 33.0 there); the gated gate_up to the wgmma body (30.0 us
against CUTLASS + SiLU-quant 33.8; the H100's fma launch took 32.0). Engine FP8 batch 1 2.558
-> 2.510 ms. weight_only o_proj was not re-swept.

The "norm" kinds (the add + RMSNorm before qkv / gate_up folded into the GEMM; the
fp8_norm_linear pass): `--fp8 norm --shapes qkv --m 1` and `--fp8 norm_gated --shapes gate_up
--m 1` on an H100 (2026-12-06 00:05 UTC, RESULTS.md "The add + RMSNorm folded into the FP8
GEMM measured"; no H200 was lent): qkv 12.5 us against 12.9 for the norm-quant kernel and the
channel GEMM, gate_up 44.2 against 46.3 for the norm-quant kernel and the gated GEMM. Engine FP8
batch 1 3.372 -> 3.297 ms with them, 3.213 -> 3.117 with the FP8 LM head. Not swept on the
H200.

weight_only (1, 128256, 4096), the rescored FP8 LM head's scoring GEMM at batch 1: the launch
`--fp8 channel --modes fma --shapes lm_head --m 1` measured best for the same shape's channel
kind on an H100 (168.5 us against CUTLASS 173.3; RESULTS.md "The FP8 LM head"), taken for the
weight-only body, which differs only by reading bf16 activations; not swept as weight_only."""
