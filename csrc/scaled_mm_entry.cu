// C entry points of the FP8 GEMMs: argument checks, then a switch to the kernel instantiation of
// the requested tile configuration and output type (scaled_mm_*.cu). Built without CUTLASS
// (V1E_WITH_CUTLASS undefined), the entries exist and report cudaErrorNotSupported.
//
// Every rejection also records its reason (which argument, which CUTLASS check) for
// v1e_fp8_gemm_error(): the status code alone cannot tell a caller what to fix.
#include <cuda_runtime.h>

#include <cinttypes>
#include <climits>
#include <cstdarg>
#include <cstdint>
#include <cstdio>

#include "gemm_sm90.h"
#include "scaled_mm.h"
#include "v1engine_kernels.h"

namespace {

// The reason the calling thread's last FP8 GEMM call failed ("" after a success).
thread_local char last_error[512] = "";

}  // namespace

int v1e::set_error(const char* format, ...) {
  va_list args;
  va_start(args, format);
  vsnprintf(last_error, sizeof(last_error), format, args);
  va_end(args);
  return cudaErrorInvalidValue;
}

namespace {

constexpr int64_t kTmaElements = 16;  // 16-byte rows of e4m3

bool is_output_dtype(int dtype) {
  return dtype == V1E_DTYPE_BFLOAT16 || dtype == V1E_DTYPE_FLOAT16;
}

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

#ifdef V1E_WITH_CUTLASS

constexpr int kMaxDevices = 64;

// The current device and its SM count (cached: the persistent tile scheduler sizes its grid by
// it, and querying the device on every call would cost a driver round trip).
cudaError_t current_device(int* device, int* sm_count) {
  static int cached_sm_count[kMaxDevices] = {};
  cudaError_t error = cudaGetDevice(device);
  if (error != cudaSuccess) return error;
  if (*device < 0 || *device >= kMaxDevices) return cudaErrorInvalidDevice;
  if (cached_sm_count[*device] == 0) {
    error = cudaDeviceGetAttribute(&cached_sm_count[*device], cudaDevAttrMultiProcessorCount,
                                   *device);
    if (error != cudaSuccess) return error;
  }
  *sm_count = cached_sm_count[*device];
  return cudaSuccess;
}

// current_device with a failure recorded for v1e_fp8_gemm_error().
int query_device(int* device, int* sm_count) {
  const cudaError_t error = current_device(device, sm_count);
  if (error != cudaSuccess) {
    v1e::set_error("cannot query the current device: %s", cudaGetErrorString(error));
  }
  return error;
}

#endif  // V1E_WITH_CUTLASS

// Sizes shared by both GEMMs; the kernels index with int, so every extent must fit one.
// Returns cudaSuccess, or cudaErrorInvalidValue with the first violated requirement recorded.
int check_problem(const char* what, const void* out, const void* a, const void* b, int64_t m,
                  int64_t n, int64_t k, int64_t lda, int64_t ldb, int dtype) {
  using v1e::set_error;
  if (out == nullptr || a == nullptr || b == nullptr) {
    return set_error("%s: out, a and b must not be null", what);
  }
  if (m <= 0 || n <= 0 || k <= 0 || m > INT_MAX || n > INT_MAX || k > INT_MAX) {
    return set_error("%s: m, n, k must be in [1, INT_MAX], got m=%" PRId64 " n=%" PRId64
                     " k=%" PRId64, what, m, n, k);
  }
  if (!is_output_dtype(dtype)) {
    return set_error("%s: out_dtype code %d is neither bfloat16 (%d) nor float16 (%d)", what,
                     dtype, V1E_DTYPE_BFLOAT16, V1E_DTYPE_FLOAT16);
  }
  if (n % kTmaElements != 0 || k % kTmaElements != 0) {
    return set_error("%s: n (%" PRId64 ") and k (%" PRId64 ") must be multiples of 16 (TMA)",
                     what, n, k);
  }
  if (lda < k || ldb < k || lda % kTmaElements != 0 || ldb % kTmaElements != 0) {
    return set_error("%s: lda (%" PRId64 ") and ldb (%" PRId64 ") must be >= k (%" PRId64
                     ") and multiples of 16", what, lda, ldb, k);
  }
  if (!aligned16(out) || !aligned16(a) || !aligned16(b)) {
    return set_error("%s: out (%p), a (%p) and b (%p) must be 16-byte aligned", what, out, a, b);
  }
  return cudaSuccess;
}

// A stream-K workspace (csrc/stream_k_sm90.cuh): none (0 bytes), or a non-null, 256-byte aligned
// buffer of a multiple of 256 bytes.
int check_workspace(const char* what, const void* workspace, int64_t workspace_bytes) {
  if (workspace_bytes == 0) return cudaSuccess;
  if (workspace_bytes < 0 || workspace_bytes % 256 != 0 || workspace == nullptr ||
      reinterpret_cast<uintptr_t>(workspace) % 256 != 0) {
    return v1e::set_error("%s: a workspace of %" PRId64 " bytes at %p: it must be none (0 bytes) "
                          "or non-null, 256-byte aligned and a multiple of 256 bytes", what,
                          workspace_bytes, workspace);
  }
  return cudaSuccess;
}

// The arguments of v1e_gemm / v1e_gemm_workspace_size; records the first violated requirement.
int check_gemm(int64_t m, int64_t n, int64_t k, int64_t lda, int64_t ldb, int config,
               int decomposition, int splits) {
  using v1e::set_error;
  constexpr int64_t kTmaBf16 = 8;  // 16-byte rows of bf16
  if (m <= 0 || n <= 0 || k <= 0 || m > INT_MAX || n > INT_MAX || k > INT_MAX) {
    return set_error("v1e_gemm: m, n, k must be in [1, INT_MAX], got m=%" PRId64 " n=%" PRId64
                     " k=%" PRId64, m, n, k);
  }
  if (n % kTmaBf16 != 0 || k % kTmaBf16 != 0) {
    return set_error("v1e_gemm: n (%" PRId64 ") and k (%" PRId64 ") must be multiples of 8 (TMA)",
                     n, k);
  }
  if (lda < k || ldb < k || lda % kTmaBf16 != 0 || ldb % kTmaBf16 != 0) {
    return set_error("v1e_gemm: lda (%" PRId64 ") and ldb (%" PRId64 ") must be >= k (%" PRId64
                     ") and multiples of 8", lda, ldb, k);
  }
  if (config < 0 || config >= v1e::kNumGemmConfigs) {
    return set_error("v1e_gemm: config %d is outside [0, %d)", config, v1e::kNumGemmConfigs);
  }
  if (decomposition < 0 || decomposition >= v1e::kNumGemmDecompositions) {
    return set_error("v1e_gemm: decomposition %d is outside [0, %d) (0 heuristic, 1 stream-K, "
                     "2 split-K, 3 data-parallel, 4 stream-K unordered, 5 split-K unordered)",
                     decomposition, v1e::kNumGemmDecompositions);
  }
  if ((decomposition == v1e::kGemmSplitK || decomposition == v1e::kGemmSplitKUnordered) &&
      splits < 1) {
    return set_error("v1e_gemm: split-K needs splits >= 1, got %d", splits);
  }
  return cudaSuccess;
}

#ifdef V1E_WITH_CUTLASS

template <int kDtype>
int dispatch_scaled_mm(const v1e::ScaledMmParams& params, int config) {
  switch (config) {
    case 0:
      return v1e::scaled_mm_run<kDtype, 0>(params);
    case 1:
      return v1e::scaled_mm_run<kDtype, 1>(params);
    case 2:
      return v1e::scaled_mm_run<kDtype, 2>(params);
    case 3:
      return v1e::scaled_mm_run<kDtype, 3>(params);
    case 4:
      return v1e::scaled_mm_run<kDtype, 4>(params);
    case 5:
      return v1e::scaled_mm_run<kDtype, 5>(params);
    case 6:
      return v1e::scaled_mm_run<kDtype, 6>(params);
    case 7:
      return v1e::scaled_mm_run<kDtype, 7>(params);
    case 8:
      return v1e::scaled_mm_run<kDtype, 8>(params);
    case 9:
      return v1e::scaled_mm_run<kDtype, 9>(params);
    case 10:
      return v1e::scaled_mm_run<kDtype, 10>(params);
    case 11:
      return v1e::scaled_mm_run<kDtype, 11>(params);
    case 12:
      return v1e::scaled_mm_run<kDtype, 12>(params);
    case 13:
      return v1e::scaled_mm_run<kDtype, 13>(params);
    default:
      return v1e::set_error("v1e_scaled_mm: config %d has no kernel", config);
  }
}

template <int kDtype>
int dispatch_block_scaled_mm(const v1e::BlockScaledMmParams& params) {
  if (params.m <= v1e::kBlockScaledSmallMMax) {
    return v1e::block_scaled_mm_run<kDtype, 0>(params);
  }
  return v1e::block_scaled_mm_run<kDtype, 1>(params);
}

#endif  // V1E_WITH_CUTLASS

}  // namespace

extern "C" {

int v1e_has_fp8_gemm(void) {
#ifdef V1E_WITH_CUTLASS
  return 1;
#else
  return 0;
#endif
}

int v1e_scaled_mm_num_configs(void) { return v1e::kNumScaledMmConfigs; }

const char* v1e_fp8_gemm_error(void) { return last_error; }

int v1e_scaled_mm_workspace_size(int64_t m, int64_t n, int64_t k, int out_dtype, int config,
                                 int64_t* bytes) {
  last_error[0] = '\0';
  if (bytes == nullptr) {
    return v1e::set_error("v1e_scaled_mm_workspace_size: bytes must not be null");
  }
  // Fake aligned operands: only the sizes matter to the question.
  const int status = check_problem("v1e_scaled_mm_workspace_size", bytes, bytes, bytes, m, n, k,
                                   k, k, out_dtype);
  if (status != cudaSuccess) return status;
  if (config < 0 || config >= v1e::kNumScaledMmConfigs) {
    return v1e::set_error("v1e_scaled_mm_workspace_size: config %d is outside [0, %d)", config,
                          v1e::kNumScaledMmConfigs);
  }
#ifdef V1E_WITH_CUTLASS
  size_t size = 0;
  // Placeholder operands: the sizing builds TMA descriptors (host-side, never used), and their
  // encoding wants plausible addresses; nothing is read from them.
  void* const placeholder = reinterpret_cast<void*>(uintptr_t(1) << 20);
  const float* const scales = static_cast<const float*>(placeholder);
  v1e::ScaledMmParams params{placeholder, placeholder, placeholder, scales, scales, nullptr,
                             m, n, k, k, k, true, true, 0, 0, nullptr, false};
  params.workspace_query = &size;
  const int device_status = query_device(&params.device, &params.sm_count);
  if (device_status != cudaSuccess) return device_status;
  const int result = out_dtype == V1E_DTYPE_BFLOAT16
                         ? dispatch_scaled_mm<V1E_DTYPE_BFLOAT16>(params, config)
                         : dispatch_scaled_mm<V1E_DTYPE_FLOAT16>(params, config);
  *bytes = static_cast<int64_t>(size);
  return result;
#else
  v1e::set_error("the library was built without the CUTLASS headers");
  return cudaErrorNotSupported;
#endif
}

int v1e_scaled_mm(void* out, const void* a, const void* b, const float* scale_a,
                  const float* scale_b, const void* bias, int64_t m, int64_t n, int64_t k,
                  int64_t lda, int64_t ldb, int scale_a_per_row, int scale_b_per_col,
                  int out_dtype, int config, void* workspace, int64_t workspace_bytes, int pdl,
                  void* stream) {
  last_error[0] = '\0';
  const int status = check_problem("v1e_scaled_mm", out, a, b, m, n, k, lda, ldb, out_dtype);
  if (status != cudaSuccess) return status;
  if (scale_a == nullptr || scale_b == nullptr) {
    return v1e::set_error("v1e_scaled_mm: scale_a and scale_b must not be null");
  }
  if (config < 0 || config >= v1e::kNumScaledMmConfigs) {
    return v1e::set_error("v1e_scaled_mm: config %d is outside [0, %d)", config,
                          v1e::kNumScaledMmConfigs);
  }
  const int workspace_status = check_workspace("v1e_scaled_mm", workspace, workspace_bytes);
  if (workspace_status != cudaSuccess) return workspace_status;
#ifdef V1E_WITH_CUTLASS
  v1e::ScaledMmParams params{out, a, b, scale_a, scale_b, bias, m, n, k, lda, ldb,
                             scale_a_per_row != 0, scale_b_per_col != 0, 0, 0,
                             static_cast<cudaStream_t>(stream), pdl != 0};
  params.workspace = workspace;
  params.workspace_bytes = static_cast<size_t>(workspace_bytes);
  const int device_status = query_device(&params.device, &params.sm_count);
  if (device_status != cudaSuccess) return device_status;
  if (out_dtype == V1E_DTYPE_BFLOAT16) {
    return dispatch_scaled_mm<V1E_DTYPE_BFLOAT16>(params, config);
  }
  return dispatch_scaled_mm<V1E_DTYPE_FLOAT16>(params, config);
#else
  (void)bias;
  (void)workspace;
  (void)scale_a_per_row;
  (void)scale_b_per_col;
  (void)pdl;
  (void)stream;
  v1e::set_error("the library was built without the CUTLASS headers");
  return cudaErrorNotSupported;
#endif
}

int v1e_block_scaled_mm(void* out, const void* a, const void* b, const float* scale_a,
                        const float* scale_b, int64_t m, int64_t n, int64_t k, int64_t lda,
                        int64_t ldb, int64_t ld_scale_a, int out_dtype, int pdl,
                        void* stream) {
  last_error[0] = '\0';
  const int status =
      check_problem("v1e_block_scaled_mm", out, a, b, m, n, k, lda, ldb, out_dtype);
  if (status != cudaSuccess) return status;
  if (scale_a == nullptr || scale_b == nullptr) {
    return v1e::set_error("v1e_block_scaled_mm: scale_a and scale_b must not be null");
  }
  if (k % 128 != 0) {
    return v1e::set_error("v1e_block_scaled_mm: k (%" PRId64 ") must be a multiple of 128", k);
  }
  const int64_t padded_m = (m + 3) / 4 * 4;
  if (ld_scale_a < padded_m || ld_scale_a % 4 != 0 || ld_scale_a * (k / 128) > INT_MAX) {
    return v1e::set_error("v1e_block_scaled_mm: ld_scale_a (%" PRId64
                          ") must be a multiple of 4, >= m rounded up to 4 (%" PRId64
                          "), and ld_scale_a * k / 128 must fit an int",
                          ld_scale_a, padded_m);
  }
  if (!aligned16(scale_a)) {
    return v1e::set_error("v1e_block_scaled_mm: scale_a (%p) must be 16-byte aligned (TMA)",
                          static_cast<const void*>(scale_a));
  }
#ifdef V1E_WITH_CUTLASS
  v1e::BlockScaledMmParams params{out, a, b, scale_a, scale_b, m, n, k, lda, ldb, ld_scale_a,
                                  0, 0, static_cast<cudaStream_t>(stream), pdl != 0};
  const int device_status = query_device(&params.device, &params.sm_count);
  if (device_status != cudaSuccess) return device_status;
  if (out_dtype == V1E_DTYPE_BFLOAT16) {
    return dispatch_block_scaled_mm<V1E_DTYPE_BFLOAT16>(params);
  }
  return dispatch_block_scaled_mm<V1E_DTYPE_FLOAT16>(params);
#else
  (void)pdl;
  (void)stream;
  v1e::set_error("the library was built without the CUTLASS headers");
  return cudaErrorNotSupported;
#endif
}

int v1e_gemm_num_configs(void) { return v1e::kNumGemmConfigs; }

int v1e_gemm_workspace_size(int64_t m, int64_t n, int64_t k, int config, int decomposition,
                            int splits, int64_t* bytes) {
  last_error[0] = '\0';
  if (bytes == nullptr) return v1e::set_error("v1e_gemm_workspace_size: bytes must not be null");
  const int status = check_gemm(m, n, k, k, k, config, decomposition, splits);
  if (status != cudaSuccess) return status;
#ifdef V1E_WITH_CUTLASS
  v1e::GemmParams params{};
  // Placeholder operands: the sizing builds TMA descriptors (host-side, never used), and their
  // encoding wants plausible addresses; nothing is read from them.
  params.out = reinterpret_cast<void*>(uintptr_t(1) << 20);
  params.a = params.b = params.out;
  params.m = m;
  params.n = n;
  params.k = k;
  params.lda = params.ldb = k;
  params.decomposition = decomposition;
  params.splits = splits;
  const int device_status = query_device(&params.device, &params.sm_count);
  if (device_status != cudaSuccess) return device_status;
  size_t size = 0;
  const int result = v1e::gemm_workspace_size(params, config, &size);
  *bytes = static_cast<int64_t>(size);
  return result;
#else
  v1e::set_error("the library was built without the CUTLASS headers");
  return cudaErrorNotSupported;
#endif
}

int v1e_gemm(void* out, const void* a, const void* b, int64_t m, int64_t n, int64_t k,
             int64_t lda, int64_t ldb, int dtype, int config, int decomposition, int splits,
             void* workspace, int64_t workspace_bytes, int pdl, void* stream) {
  last_error[0] = '\0';
  if (out == nullptr || a == nullptr || b == nullptr) {
    return v1e::set_error("v1e_gemm: out, a and b must not be null");
  }
  if (dtype != V1E_DTYPE_BFLOAT16) {
    return v1e::set_error("v1e_gemm: dtype code %d is not bfloat16 (%d), the one type it has",
                          dtype, V1E_DTYPE_BFLOAT16);
  }
  const int status = check_gemm(m, n, k, lda, ldb, config, decomposition, splits);
  if (status != cudaSuccess) return status;
  if (!aligned16(out) || !aligned16(a) || !aligned16(b)) {
    return v1e::set_error("v1e_gemm: out (%p), a (%p) and b (%p) must be 16-byte aligned", out,
                          a, b);
  }
  const int workspace_status = check_workspace("v1e_gemm", workspace, workspace_bytes);
  if (workspace_status != cudaSuccess) return workspace_status;
#ifdef V1E_WITH_CUTLASS
  v1e::GemmParams params{out, a, b, m, n, k, lda, ldb, decomposition, splits, workspace,
                         static_cast<size_t>(workspace_bytes), 0, 0,
                         static_cast<cudaStream_t>(stream), pdl != 0};
  const int device_status = query_device(&params.device, &params.sm_count);
  if (device_status != cudaSuccess) return device_status;
  return v1e::gemm_run(params, config);
#else
  (void)pdl;
  (void)stream;
  v1e::set_error("the library was built without the CUTLASS headers");
  return cudaErrorNotSupported;
#endif
}

}  // extern "C"
