"""The bf16 skinny GEMM's measured launch table (kernels/triton_gemv.py; read by the launch rules
of kernels/skinny_launch.py): data, kept apart from the kernel. `python
benchmarks/sweep_skinny_gemm.py` prints it with the swept entries replaced; paste that here."""

from __future__ import annotations

TUNED_LAUNCH: dict[tuple[int, int, int], dict[str, int | str] | None] = {
    (1, 6144, 4096): {"mode": "fma", "block_n": 8, "block_k": 256, "num_warps": 4, "num_stages": 4},
    (2, 6144, 4096): {
        "mode": "dot_swap",
        "block_n": 64,
        "block_k": 256,
        "num_warps": 4,
        "num_stages": 4,
    },
    (4, 6144, 4096): {
        "mode": "dot_swap",
        "block_n": 64,
        "block_k": 256,
        "num_warps": 4,
        "num_stages": 4,
    },
    (8, 6144, 4096): {
        "mode": "dot_swap",
        "block_n": 64,
        "block_k": 256,
        "num_warps": 4,
        "num_stages": 4,
    },
    (16, 6144, 4096): {
        "mode": "dot_swap",
        "block_n": 64,
        "block_k": 128,
        "num_warps": 4,
        "num_stages": 6,
    },
    (32, 6144, 4096): {
        "mode": "dot_swap",
        "block_n": 64,
        "block_k": 128,
        "num_warps": 4,
        "num_stages": 6,
    },
    (64, 6144, 4096): None,
    (1, 4096, 4096): {"mode": "fma", "block_n": 8, "block_k": 256, "num_warps": 4, "num_stages": 4},
    (2, 4096, 4096): {"mode": "fma", "block_n": 4, "block_k": 512, "num_warps": 4, "num_stages": 3},
    (4, 4096, 4096): {
        "mode": "dot_swap",
        "block_n": 64,
        "block_k": 128,
        "num_warps": 4,
        "num_stages": 6,
    },
    (8, 4096, 4096): {
        "mode": "dot_swap",
        "block_n": 64,
        "block_k": 128,
        "num_warps": 4,
        "num_stages": 6,
    },
    (16, 4096, 4096): {
        "mode": "dot_swap",
        "block_n": 64,
        "block_k": 128,
        "num_warps": 4,
        "num_stages": 6,
    },
    (32, 4096, 4096): {
        "mode": "dot_swap",
        "block_n": 64,
        "block_k": 128,
        "num_warps": 4,
        "num_stages": 6,
    },
    (64, 4096, 4096): None,
    (1, 28672, 4096): {
        "mode": "fma",
        "block_n": 4,
        "block_k": 512,
        "num_warps": 4,
        "num_stages": 6,
    },
    (2, 28672, 4096): {
        "mode": "dot_swap",
        "block_n": 64,
        "block_k": 128,
        "num_warps": 4,
        "num_stages": 4,
    },
    (4, 28672, 4096): {
        "mode": "dot_swap",
        "block_n": 64,
        "block_k": 128,
        "num_warps": 4,
        "num_stages": 4,
    },
    (8, 28672, 4096): {
        "mode": "dot_swap",
        "block_n": 64,
        "block_k": 128,
        "num_warps": 4,
        "num_stages": 4,
    },
    (16, 28672, 4096): {
        "mode": "dot_swap",
        "block_n": 64,
        "block_k": 128,
        "num_warps": 4,
        "num_stages": 4,
    },
    (32, 28672, 4096): None,
    (64, 28672, 4096): {
        "mode": "dot",
        "block_n": 64,
        "block_k": 128,
        "num_warps": 4,
        "num_stages": 3,
    },
    (1, 4096, 14336): {
        "mode": "fma",
        "block_n": 4,
        "block_k": 512,
        "num_warps": 4,
        "num_stages": 3,
    },
    (2, 4096, 14336): {
        "mode": "fma",
        "block_n": 8,
        "block_k": 256,
        "num_warps": 4,
        "num_stages": 6,
    },
    (4, 4096, 14336): {
        "mode": "dot_swap",
        "block_n": 64,
        "block_k": 256,
        "num_warps": 4,
        "num_stages": 4,
    },
    (8, 4096, 14336): {
        "mode": "dot_swap",
        "block_n": 64,
        "block_k": 256,
        "num_warps": 4,
        "num_stages": 4,
    },
    (16, 4096, 14336): {
        "mode": "dot_swap",
        "block_n": 64,
        "block_k": 256,
        "num_warps": 4,
        "num_stages": 4,
    },
    (32, 4096, 14336): {
        "mode": "dot_swap",
        "block_n": 64,
        "block_k": 128,
        "num_warps": 4,
        "num_stages": 6,
        "split_k": 2,
    },
    (64, 4096, 14336): {
        "mode": "dot_swap",
        "block_n": 64,
        "block_k": 128,
        "num_warps": 4,
        "num_stages": 6,
        "split_k": 2,
    },
    (1, 128256, 4096): {
        "mode": "fma",
        "block_n": 4,
        "block_k": 512,
        "num_warps": 4,
        "num_stages": 6,
    },
    (2, 128256, 4096): {
        "mode": "dot_swap",
        "block_n": 64,
        "block_k": 128,
        "num_warps": 4,
        "num_stages": 3,
    },
    (4, 128256, 4096): {
        "mode": "dot_swap",
        "block_n": 64,
        "block_k": 128,
        "num_warps": 4,
        "num_stages": 3,
    },
    (8, 128256, 4096): {
        "mode": "dot_swap",
        "block_n": 64,
        "block_k": 128,
        "num_warps": 4,
        "num_stages": 3,
    },
    (16, 128256, 4096): {
        "mode": "dot_swap",
        "block_n": 64,
        "block_k": 128,
        "num_warps": 4,
        "num_stages": 3,
    },
    (32, 128256, 4096): {
        "mode": "dot_swap",
        "block_n": 64,
        "block_k": 128,
        "num_warps": 4,
        "num_stages": 6,
    },
    (64, 128256, 4096): {
        "mode": "dot",
        "block_n": 64,
        "block_k": 128,
        "num_warps": 4,
        "num_stages": 6,
    },
}
"""Measured launch configs keyed by (M bucket, N, K), M bucket = M rounded up to a power of two;
None marks a shape where F.linear measured faster, so the op keeps it there.
benchmarks/sweep_skinny_gemm.py prints this table; the op runs the kernel only for shapes in it
(`default_launch` serves explicit calls of `skinny_gemm` on other shapes).
Measured on the H200 (2026-12-02, Llama-3-8B shapes, `sweep_skinny_gemm.py --seconds 16`): every
entry for M <= 16 beat cuBLAS, by 1-20% (o_proj and down most: cuBLAS runs them split-K with two
extra kernels); benchmarks/RESULTS.md "Skinny GEMM sweep". Buckets 32 and 64 (2026-12-03,
`--m 32,64 --seconds 8`): cuBLAS's own tiles fit there, and the kernel won only o_proj at 32
(1.11x), lm_head (1.01-1.03x) and down at 64 (1.00x); the other shapes stay on F.linear.
M = 1 again with split-K launches (2026-12-04, `--m 1 --split-k 2,4,8 --shapes qkv,o_proj,down
--seconds 30 --write-table`): no split won; qkv and o_proj took fma 8 x 256 (0.1 us better)."""
