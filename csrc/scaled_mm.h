// Internal interface between the FP8 GEMM entry points (scaled_mm_entry.cu) and the CUTLASS
// kernel instantiations (scaled_mm_*.cu). Plain C++, no CUTLASS types, so the entry file compiles
// in seconds and also without the CUTLASS headers.
#ifndef V1ENGINE_SCALED_MM_H_
#define V1ENGINE_SCALED_MM_H_

#include <cuda_runtime.h>

#include <cstdint>

namespace v1e {

// Tile configurations of the per-tensor / per-channel GEMM (ids of v1e_scaled_mm's `config`).
// The table of which id serves which M lives on the Python side (fp8.SCALED_MM_DISPATCH).
constexpr int kNumScaledMmConfigs = 14;
// Configurations of the block-scaled GEMM, picked here by M (64-row tiles for small M).
constexpr int kNumBlockScaledConfigs = 2;
constexpr int kBlockScaledSmallMMax = 64;

// Records, printf-style, why the calling thread's current FP8 GEMM call fails; the C entry points
// hand it out through v1e_fp8_gemm_error() (scaled_mm_entry.cu owns the storage). Returns
// cudaErrorInvalidValue, the code every such rejection carries.
int set_error(const char* format, ...) __attribute__((format(printf, 1, 2)));

struct ScaledMmParams {
  void* out;
  const void* a;
  const void* b;
  const float* scale_a;
  const float* scale_b;
  const void* bias;  // may be null
  int64_t m, n, k, lda, ldb;
  bool scale_a_per_row;
  bool scale_b_per_col;
  int device;
  int sm_count;
  cudaStream_t stream;
  bool pdl;  // launch with programmatic dependent launch
  // Stream-K configurations: the workspace (zeroed once by its owner, left zero by each call).
  void* workspace = nullptr;
  size_t workspace_bytes = 0;
  // When set, nothing is launched: the configuration's workspace size is stored here.
  size_t* workspace_query = nullptr;
};

struct BlockScaledMmParams {
  void* out;
  const void* a;
  const void* b;
  const float* scale_a;  // M-major: (m, kb) at scale_a[kb * ld_scale_a + m], ld_scale_a >= M
                         // rounded up to 4 (the rows past M are read, never used)
  const float* scale_b;  // [ceil(N/128), K/128] row-major
  int64_t m, n, k, lda, ldb, ld_scale_a;
  int device;
  int sm_count;
  cudaStream_t stream;
  bool pdl;  // launch with programmatic dependent launch
};

// Each returns a cudaError_t value: cudaErrorInvalidValue when CUTLASS rejects the problem, with
// the reason recorded by set_error. kDtype is a v1e_dtype code (bf16 or fp16 output).
template <int kDtype, int kConfig>
int scaled_mm_run(const ScaledMmParams& params);

template <int kDtype, int kConfig>
int block_scaled_mm_run(const BlockScaledMmParams& params);

}  // namespace v1e

#endif  // V1ENGINE_SCALED_MM_H_
