// Instantiates the block-scaled FP8 GEMMs (64-row tiles for small M, 128-row tiles otherwise)
// for bf16 and fp16 output (see scaled_mm_sm90.cuh).
#include "scaled_mm_sm90.cuh"

namespace v1e {
template int block_scaled_mm_run<V1E_DTYPE_BFLOAT16, 0>(const BlockScaledMmParams&);
template int block_scaled_mm_run<V1E_DTYPE_BFLOAT16, 1>(const BlockScaledMmParams&);
template int block_scaled_mm_run<V1E_DTYPE_FLOAT16, 0>(const BlockScaledMmParams&);
template int block_scaled_mm_run<V1E_DTYPE_FLOAT16, 1>(const BlockScaledMmParams&);
}  // namespace v1e
