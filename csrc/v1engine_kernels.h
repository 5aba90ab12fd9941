/*
 * C ABI of libv1engine_kernels.so: plain pointers, sizes and a cudaStream_t passed as void*.
 *
 * The library links no libtorch and carries a static CUDA runtime, so one build works with any
 * torch >= 2.11. Python binds these entry points with ctypes (v1_engine/kernels/_C.py) and
 * registers them as torch.library custom ops. Every entry point returns a cudaError_t value
 * (0 = success); v1e_error_string turns it into text.
 *
 * Bump V1E_ABI_VERSION whenever a signature or a meaning changes: the loader refuses a library
 * whose v1e_abi_version() differs from the one it was written for.
 */
#ifndef V1ENGINE_KERNELS_H_
#define V1ENGINE_KERNELS_H_

#include <stdint.h>

#define V1E_ABI_VERSION 7

#if defined(_WIN32)
#define V1E_API __declspec(dllexport)
#else
#define V1E_API __attribute__((visibility("default")))
#endif

#ifdef __cplusplus
extern "C" {
#endif

/* Element type codes shared with Python (v1_engine/kernels/_C.py). */
enum v1e_dtype {
  V1E_DTYPE_FLOAT16 = 0,
  V1E_DTYPE_BFLOAT16 = 1,
  V1E_DTYPE_FLOAT32 = 2,
};

/* The ABI version this library was built with (V1E_ABI_VERSION). */
V1E_API int v1e_abi_version(void);

/* Text of a code returned by any v1e_* entry point (the CUDA runtime's message). */
V1E_API const char* v1e_error_string(int code);

/*
 * Writes new keys and values into a paged KV cache.
 *
 * key, value:   [num_tokens, num_kv_heads, head_size]; each row's heads are dense, rows are
 *               key_row_stride / value_row_stride ELEMENTS apart (a slice of a fused qkv tensor).
 * kv_cache:     dense [2, num_blocks, block_size, num_kv_heads, head_size]; index 0 = K, 1 = V.
 * slot_mapping: int64 [num_tokens] on the device; token t goes to slot
 *               slot_mapping[t] = block * block_size + offset. A negative slot (padding) is
 *               skipped, and so is a slot >= num_blocks * block_size (no out-of-bounds write).
 * dtype:        a v1e_dtype code; all three tensors share it.
 * pdl:          nonzero launches with programmatic dependent launch (sm_90+): the kernel may
 *               start while the previous one drains and waits for its writes before any access.
 * stream:       the cudaStream_t to launch on.
 *
 * Returns cudaErrorInvalidValue for a bad argument, else the launch status.
 */
V1E_API int v1e_reshape_and_cache(const void* key, const void* value, void* kv_cache,
                                  const int64_t* slot_mapping, int64_t num_tokens,
                                  int64_t num_kv_heads, int64_t head_size, int64_t key_row_stride,
                                  int64_t value_row_stride, int64_t num_blocks, int64_t block_size,
                                  int dtype, int pdl, void* stream);

/* 1 when the library holds the CUTLASS FP8 GEMMs below; 0 when it was built without the CUTLASS
 * headers (then v1e_scaled_mm and v1e_block_scaled_mm return cudaErrorNotSupported). */
V1E_API int v1e_has_fp8_gemm(void);

/* Number of tile configurations v1e_scaled_mm accepts (config ids 0 .. n-1). */
V1E_API int v1e_scaled_mm_num_configs(void);

/* The workspace v1e_scaled_mm needs for an m x n x k problem in this configuration, in *bytes:
 * 0 except for the stream-K configurations (8-13). Failures are recorded for
 * v1e_fp8_gemm_error(). */
V1E_API int v1e_scaled_mm_workspace_size(int64_t m, int64_t n, int64_t k, int out_dtype,
                                         int config, int64_t* bytes);

/* Why the calling thread's last v1e_scaled_mm / v1e_block_scaled_mm call failed: the argument
 * check or the CUTLASS check (mainloop, epilogue, kernel, initialize) that refused it, or the
 * launch error; "" after a success. Valid until the thread's next FP8 GEMM call. */
V1E_API const char* v1e_fp8_gemm_error(void);

/*
 * out[M, N] = (a[M, K] * scale_a) @ (b[N, K] * scale_b)^T + bias, e4m3 x e4m3 with fp32
 * accumulation (sm_90a, CUTLASS warp-specialized TMA kernels; scales and bias in the epilogue).
 *
 * out:      [M, N] row-major, dense (row stride N), of out_dtype (V1E_DTYPE_BFLOAT16/FLOAT16).
 * a:        e4m3 [M, K], K contiguous, rows lda elements apart.
 * b:        e4m3 [N, K] (the nn.Linear weight layout), K contiguous, rows ldb elements apart.
 * scale_a:  fp32, M values when scale_a_per_row, else 1 (per tensor).
 * scale_b:  fp32, N values when scale_b_per_col, else 1.
 * bias:     [N] of out_dtype, or NULL.
 * config:   tile configuration id in [0, v1e_scaled_mm_num_configs()); the caller picks it by M.
 * workspace: for the stream-K configurations (8-13), at least v1e_scaled_mm_workspace_size
 *           bytes, 256-byte aligned, a multiple of 256 bytes, ZEROED ONCE by its owner: its
 *           last 1 MiB holds the split tiles' locks, which every call leaves zero, the rest is
 *           scratch; so calls ordered on one stream may share it (with v1e_gemm too),
 *           concurrent calls may not (csrc/stream_k_sm90.cuh). Others take none (NULL, 0).
 * pdl:      nonzero launches with programmatic dependent launch (as v1e_reshape_and_cache).
 * K, N, lda, ldb must be multiples of 16 and a, b, out 16-byte aligned (TMA).
 *
 * Returns cudaErrorInvalidValue for a bad argument or a problem the kernel cannot run, else the
 * launch status.
 */
V1E_API int v1e_scaled_mm(void* out, const void* a, const void* b, const float* scale_a,
                          const float* scale_b, const void* bias, int64_t m, int64_t n, int64_t k,
                          int64_t lda, int64_t ldb, int scale_a_per_row, int scale_b_per_col,
                          int out_dtype, int config, void* workspace, int64_t workspace_bytes,
                          int pdl, void* stream);

/*
 * out[M, N] from block-scaled e4m3 operands (the DeepSeek-V3 layout), fp32 accumulation with the
 * scales applied per 128-wide K block (CUTLASS blockwise-scaling mainloop, sm_90a).
 *
 * a:        e4m3 [M, K], K contiguous, rows lda elements apart.
 * b:        e4m3 [N, K], K contiguous, rows ldb elements apart.
 * scale_a:  fp32, one per 1x128 group of a, stored M-major: value (m, kb) at
 *           scale_a[kb * ld_scale_a + m], with ld_scale_a a multiple of 4 and >= M rounded up
 *           to 4 (TMA loads the scales of M rounded up to 4 rows; the extra ones are unused).
 * scale_b:  fp32 [ceil(N/128), K/128] row-major (one per 128x128 block of b).
 * K must be a multiple of 128; N, lda, ldb multiples of 16.
 */
V1E_API int v1e_block_scaled_mm(void* out, const void* a, const void* b, const float* scale_a,
                                const float* scale_b, int64_t m, int64_t n, int64_t k,
                                int64_t lda, int64_t ldb, int64_t ld_scale_a, int out_dtype,
                                int pdl, void* stream);

/* Number of launch configurations v1e_fp8_gemv accepts (config ids 0 .. n-1). */
V1E_API int v1e_fp8_gemv_num_configs(void);

/*
 * The same product as v1e_scaled_mm for decode-sized M (1..8), by a GEMV-shaped kernel: each
 * block streams 16 rows of b through the tensor cores' m16n8k32 e4m3 MMA with the activation
 * rows as its 8 columns (csrc/fp8_gemv.cu). Arguments as v1e_scaled_mm without the workspace
 * (it needs none), except: m in [1, 8];
 * n a multiple of 16, k of 64; a and b 16-byte aligned (out and bias need no alignment); config
 * in [0, v1e_fp8_gemv_num_configs()) picks warps per block and loads in flight; pdl 1 launches
 * with PDL and lets dependents launch after the main loop, 2 with PDL and dependents only at
 * exit, 3 with PDL and dependents at the start, 0 without. Needs sm_89+.
 * Failures are recorded for v1e_fp8_gemm_error().
 */
V1E_API int v1e_fp8_gemv(void* out, const void* a, const void* b, const float* scale_a,
                         const float* scale_b, const void* bias, int64_t m, int64_t n, int64_t k,
                         int64_t lda, int64_t ldb, int scale_a_per_row, int scale_b_per_col,
                         int out_dtype, int config, int pdl, void* stream);

/* Number of tile configurations v1e_gemm accepts (config ids 0 .. n-1). */
V1E_API int v1e_gemm_num_configs(void);

/*
 * The workspace v1e_gemm needs for an m x n x k problem with this config and decomposition, in
 * *bytes (0 when no tile is split). Failures are recorded for v1e_fp8_gemm_error().
 */
V1E_API int v1e_gemm_workspace_size(int64_t m, int64_t n, int64_t k, int config,
                                    int decomposition, int splits, int64_t* bytes);

/*
 * out[M, N] = a[M, K] @ b[N, K]^T in bf16 with fp32 accumulation, for decode-sized M: CUTLASS
 * cooperative TMA kernels with a stream-K tile scheduler, the weight b as the 128-row tile
 * (csrc/gemm_sm90.cu). out [M, N] dense; a rows lda apart, b rows ldb apart, K contiguous;
 * n, k, lda, ldb multiples of 8; out, a, b 16-byte aligned. config in
 * [0, v1e_gemm_num_configs()); decomposition 0 heuristic, 1 stream-K, 2 split-K into `splits`
 * slices, 3 data-parallel, 4 / 5 stream-K / split-K with the split tiles' partials added in
 * arrival order (1 and 2 add them in a fixed order: the same result every run). workspace: as v1e_scaled_mm's (at least v1e_gemm_workspace_size
 * bytes, zeroed once by its owner, shared by calls ordered on one stream). pdl as
 * v1e_scaled_mm. Failures are recorded for v1e_fp8_gemm_error().
 */
V1E_API int v1e_gemm(void* out, const void* a, const void* b, int64_t m, int64_t n, int64_t k,
                     int64_t lda, int64_t ldb, int dtype, int config, int decomposition,
                     int splits, void* workspace, int64_t workspace_bytes, int pdl,
                     void* stream);

#ifdef __cplusplus
}
#endif

#endif /* V1ENGINE_KERNELS_H_ */
