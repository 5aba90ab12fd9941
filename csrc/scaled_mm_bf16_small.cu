// Instantiates the bf16-output per-channel FP8 GEMM tile configurations 0 1 2 7 (see
// scaled_mm_sm90.cuh); split across files so each nvcc job stays at a few kernels.
#include "scaled_mm_sm90.cuh"

namespace v1e {
template int scaled_mm_run<V1E_DTYPE_BFLOAT16, 0>(const ScaledMmParams&);
template int scaled_mm_run<V1E_DTYPE_BFLOAT16, 1>(const ScaledMmParams&);
template int scaled_mm_run<V1E_DTYPE_BFLOAT16, 2>(const ScaledMmParams&);
template int scaled_mm_run<V1E_DTYPE_BFLOAT16, 7>(const ScaledMmParams&);
}  // namespace v1e
