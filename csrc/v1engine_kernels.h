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

#define V1E_ABI_VERSION 1

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
 * stream:       the cudaStream_t to launch on.
 *
 * Returns cudaErrorInvalidValue for a bad argument, else the launch status.
 */
V1E_API int v1e_reshape_and_cache(const void* key, const void* value, void* kv_cache,
                                  const int64_t* slot_mapping, int64_t num_tokens,
                                  int64_t num_kv_heads, int64_t head_size, int64_t key_row_stride,
                                  int64_t value_row_stride, int64_t num_blocks, int64_t block_size,
                                  int dtype, void* stream);

#ifdef __cplusplus
}
#endif

#endif /* V1ENGINE_KERNELS_H_ */
