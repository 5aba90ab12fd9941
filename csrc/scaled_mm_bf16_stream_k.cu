// Instantiates the bf16-output per-channel FP8 GEMM's stream-K tile configurations 8-13 (see
// scaled_mm_sm90.cuh); split across files so each nvcc job stays at a few kernels.
#include "scaled_mm_sm90.cuh"

namespace v1e {
template int scaled_mm_run<V1E_DTYPE_BFLOAT16, 8>(const ScaledMmParams&);
template int scaled_mm_run<V1E_DTYPE_BFLOAT16, 9>(const ScaledMmParams&);
template int scaled_mm_run<V1E_DTYPE_BFLOAT16, 10>(const ScaledMmParams&);
template int scaled_mm_run<V1E_DTYPE_BFLOAT16, 11>(const ScaledMmParams&);
template int scaled_mm_run<V1E_DTYPE_BFLOAT16, 12>(const ScaledMmParams&);
template int scaled_mm_run<V1E_DTYPE_BFLOAT16, 13>(const ScaledMmParams&);
}  // namespace v1e
