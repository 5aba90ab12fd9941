// Internal interface between the bf16 GEMM's C entry points (scaled_mm_entry.cu) and its CUTLASS
// kernels (gemm_sm90.cu). Plain C++, no CUTLASS types.
#ifndef V1ENGINE_GEMM_SM90_H_
#define V1ENGINE_GEMM_SM90_H_

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

namespace v1e {

// Tile configurations of v1e_gemm (weight rows x activation rows x K step, all cooperative
// stream-K kernels): 0: 128x16x128, 1: 128x32x128, 2: 128x64x64, 3: 128x64x128,
// 4: 128x128x64. The table of which id serves which M lives on the Python side
// (kernels/gemm_cutlass.py).
constexpr int kNumGemmConfigs = 5;

// How the stream-K scheduler cuts the problem (v1e_gemm's `decomposition`).
// Split tiles add their partial sums in a fixed order (each waits for the one before), so results
// are the same run to run; the unordered variants let a tile's partials add atomically as they
// arrive (less waiting, float sums in arrival order).
enum GemmDecomposition {
  kGemmHeuristic = 0,         // CUTLASS's choice between data-parallel and stream-K
  kGemmStreamK = 1,           // every CTA the same share of K steps
  kGemmSplitK = 2,            // every output tile split into `splits` K slices
  kGemmDataParallel = 3,      // one CTA per output tile, no reduction
  kGemmStreamKUnordered = 4,  // stream-K, partials added in arrival order
  kGemmSplitKUnordered = 5    // split-K, partials added in arrival order
};
constexpr int kNumGemmDecompositions = 6;

struct GemmParams {
  void* out;        // [m, n], row stride n
  const void* a;    // the activation [m, k], rows lda apart
  const void* b;    // the weight [n, k], rows ldb apart
  int64_t m, n, k, lda, ldb;
  int decomposition;
  int splits;
  void* workspace;  // zeroed once by its owner; the kernels leave it zero
  size_t workspace_bytes;
  int device;
  int sm_count;
  cudaStream_t stream;
  bool pdl;
};

int gemm_run(const GemmParams& params, int config);
int gemm_workspace_size(const GemmParams& params, int config, size_t* bytes);

}  // namespace v1e

#endif  // V1ENGINE_GEMM_SM90_H_
