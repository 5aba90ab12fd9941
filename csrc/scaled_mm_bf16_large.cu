// Instantiates the bf16-output per-channel FP8 GEMM tile configurations 3 4 5 6 (see
// scaled_mm_sm90.cuh); split across files so each nvcc job stays at a few kernels.
#include "scaled_mm_sm90.cuh"

namespace v1e {
template int scaled_mm_run<V1E_DTYPE_BFLOAT16, 3>(const ScaledMmParams&);
template int scaled_mm_run<V1E_DTYPE_BFLOAT16, 4>(const ScaledMmParams&);
template int scaled_mm_run<V1E_DTYPE_BFLOAT16, 5>(const ScaledMmParams&);
template int scaled_mm_run<V1E_DTYPE_BFLOAT16, 6>(const ScaledMmParams&);
}  // namespace v1e
