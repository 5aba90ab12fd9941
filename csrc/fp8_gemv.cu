// FP8 GEMV for decode-sized M (1..8): out[M, N] = (a * scale_a) @ (b * scale_b)^T + bias.
//
// At batch 1 a Llama-3-8B projection reads 17-117 MB of e4m3 weight and does almost no math, so
// the kernel that wins is the one that keeps HBM busy from its first microsecond to its last. A
// CUTLASS warp-specialized kernel pays several microseconds of set-up and drain on a 17 MB
// weight (o_proj: 7.5 us where 3.9 would stream it); this kernel has no prologue beyond address
// arithmetic and a one-barrier epilogue.
//
// Shape of the work: a thread block owns 16 output channels (one m16 tile of the tensor core's
// m16n8k32 e4m3 MMA, the weight rows as its A operand) and its WARPS warps split K between them;
// the activation rows are the MMA's B operand (n = 8 columns: tokens 0..M-1, the rest zero).
// Because a dot product does not care in which order K is visited, each lane loads 16 contiguous
// bytes of its two weight rows (row g and g + 8 of the tile, g = lane / 4) and the same 16 bytes
// of the activation row g, and feeds them to two MMAs: the K permutation is the same for A and
// B, so no shuffle is needed and every load is a 16-byte vector. A warp streams 16 rows x 64
// bytes per step; UNROLL steps are in flight before the first MMA waits on them.
//
// A launch configuration picks warps per block, steps in flight, and the grid: one block per
// 16-row tile, or a persistent grid of one block per SM walking the tiles (CUTLASS's footprint
// on the SMs, for the in-graph comparison of benchmarks/RESULTS.md "FP8 GEMV").
//
// The partial sums of the warps meet in shared memory; the block's first 16 x 8 threads add them,
// apply the per-token / per-channel (or per-tensor) scales and the bias, and store.
//
// Programmatic dependent launch: wait for the predecessor (it wrote a and scale_a) before any
// load, let dependents launch after the main loop (the contract of v1_engine/kernels/pdl.py).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cinttypes>
#include <algorithm>
#include <climits>
#include <cstdint>

#include "scaled_mm.h"
#include "v1engine_kernels.h"

namespace {

constexpr int kRowsPerBlock = 16;  // the MMA's m
constexpr int kMaxTokens = 8;      // the MMA's n
constexpr int kStepBytes = 64;     // K bytes a warp covers per step (4 lanes x 16 bytes)

struct GemvArgs {
  void* out;
  const uint8_t* a;
  const uint8_t* b;
  const float* scale_a;
  const float* scale_b;
  const void* bias;
  int m;
  int n;
  int k;
  int64_t lda;
  int64_t ldb;
  bool scale_a_per_row;
  bool scale_b_per_col;
  int trigger;  // when dependents may launch: 0 at exit, 1 after the main loop, 2 at the start
};

// 16 bytes of a weight row, read once: bypass L1 (nothing else reads it in this kernel).
__device__ __forceinline__ uint4 load_stream(const uint8_t* p) {
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
  return v;
}

// 16 bytes of an activation row: every warp of the SM reads them, so they stay in L1.
__device__ __forceinline__ uint4 load_cached(const uint8_t* p) {
  return __ldg(reinterpret_cast<const uint4*>(p));
}

// acc += A (16 x 32, rows g / g+8 in a0..a3) * B (32 x 8, column g in b0 / b1), e4m3, fp32.
__device__ __forceinline__ void mma_e4m3(float (&acc)[4], uint32_t a0, uint32_t a1, uint32_t a2,
                                         uint32_t a3, uint32_t b0, uint32_t b1) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  asm volatile(
      "mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32 "
      "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
      : "+f"(acc[0]), "+f"(acc[1]), "+f"(acc[2]), "+f"(acc[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
#endif
}

template <typename Out>
__device__ __forceinline__ Out to_out(float v);
template <>
__device__ __forceinline__ __nv_bfloat16 to_out<__nv_bfloat16>(float v) {
  return __float2bfloat16_rn(v);
}
template <>
__device__ __forceinline__ __half to_out<__half>(float v) {
  return __float2half_rn(v);
}
template <typename Out>
__device__ __forceinline__ float from_out(Out v);
template <>
__device__ __forceinline__ float from_out<__nv_bfloat16>(__nv_bfloat16 v) {
  return __bfloat162float(v);
}
template <>
__device__ __forceinline__ float from_out<__half>(__half v) {
  return __half2float(v);
}

template <typename Out, int kWarps, int kUnroll>
__global__ void __launch_bounds__(kWarps * 32) fp8_gemv_kernel(GemvArgs args) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
  if (args.trigger == 2) asm volatile("griddepcontrol.launch_dependents;");
#endif
  __shared__ float partial[kWarps][kRowsPerBlock][kMaxTokens];

  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int g = lane >> 2;  // weight rows g and g + 8; activation row (token) g
  const int t = lane & 3;   // which 16 bytes of the warp's 64-byte step
  const bool has_token = g < args.m;
  const uint8_t* x_row = args.a + static_cast<int64_t>(has_token ? g : 0) * args.lda + t * 16;
  const int steps = args.k / kStepBytes;
  const int tiles = args.n / kRowsPerBlock;

  // One tile of 16 rows per block, or (a persistent launch, fewer blocks than tiles) a block
  // walks the tiles gridDim.x apart.
  for (int tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
    const int n0 = tile * kRowsPerBlock;
    const uint8_t* row_lo = args.b + static_cast<int64_t>(n0 + g) * args.ldb + t * 16;
    const uint8_t* row_hi = row_lo + 8 * args.ldb;

    float acc[4] = {0.f, 0.f, 0.f, 0.f};
    for (int s0 = warp; s0 < steps; s0 += kWarps * kUnroll) {
      uint4 lo[kUnroll], hi[kUnroll], x[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int s = s0 + u * kWarps;
        if (s < steps) {
          const int64_t offset = static_cast<int64_t>(s) * kStepBytes;
          lo[u] = load_stream(row_lo + offset);
          hi[u] = load_stream(row_hi + offset);
          x[u] = has_token ? load_cached(x_row + offset) : make_uint4(0, 0, 0, 0);
        } else {
          lo[u] = hi[u] = x[u] = make_uint4(0, 0, 0, 0);
        }
      }
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        // Bytes 0-7 of each lane's 16 feed one MMA (k = t*4.. and 16+t*4.. of its logical 32),
        // bytes 8-15 the other; A and B see the same permutation of K.
        mma_e4m3(acc, lo[u].x, hi[u].x, lo[u].y, hi[u].y, x[u].x, x[u].y);
        mma_e4m3(acc, lo[u].z, hi[u].z, lo[u].w, hi[u].w, x[u].z, x[u].w);
      }
    }
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    // After the block's last main loop.
    if (args.trigger == 1 && tile + static_cast<int>(gridDim.x) >= tiles) {
      asm volatile("griddepcontrol.launch_dependents;");
    }
#endif

    // Accumulator layout (m16n8 f32): acc[0], acc[1] at (row g, tokens 2t, 2t+1), acc[2],
    // acc[3] at (row g + 8, the same tokens).
    partial[warp][g][2 * t] = acc[0];
    partial[warp][g][2 * t + 1] = acc[1];
    partial[warp][g + 8][2 * t] = acc[2];
    partial[warp][g + 8][2 * t + 1] = acc[3];
    __syncthreads();

    const int idx = threadIdx.x;
    const int row = idx / kMaxTokens;  // consecutive threads: one row's tokens
    const int token = idx % kMaxTokens;
    if (idx < kRowsPerBlock * kMaxTokens && token < args.m) {
      float sum = 0.f;
#pragma unroll
      for (int w = 0; w < kWarps; ++w) sum += partial[w][row][token];
      const int col = n0 + row;
      sum *= args.scale_a[args.scale_a_per_row ? token : 0] *
             args.scale_b[args.scale_b_per_col ? col : 0];
      Out* out = static_cast<Out*>(args.out);
      if (args.bias != nullptr) sum += from_out<Out>(static_cast<const Out*>(args.bias)[col]);
      out[static_cast<int64_t>(token) * args.n + col] = to_out<Out>(sum);
    }
    __syncthreads();  // the next tile overwrites `partial`
  }
}

// (warps per block, steps in flight per warp, blocks per SM) of each configuration id; 0 blocks
// per SM launches one block per 16-row tile, n blocks per SM a persistent grid of n x SMs
// blocks (at most one per tile) that walk the tiles.
constexpr int kConfigs[][3] = {{4, 4, 0}, {8, 4, 0}, {4, 8, 0}, {8, 2, 0},
                               {16, 2, 0}, {8, 4, 1}, {16, 2, 1}};
constexpr int kNumConfigs = sizeof(kConfigs) / sizeof(kConfigs[0]);
constexpr int kMaxDevices = 64;

// The current device's SM count, cached per device (a driver query per launch would cost more
// than the launch).
cudaError_t sm_count(int* count) {
  static int cached[kMaxDevices] = {};
  int device = 0;
  cudaError_t error = cudaGetDevice(&device);
  if (error != cudaSuccess) return error;
  if (device < 0 || device >= kMaxDevices) return cudaErrorInvalidDevice;
  if (cached[device] == 0) {
    error = cudaDeviceGetAttribute(&cached[device], cudaDevAttrMultiProcessorCount, device);
    if (error != cudaSuccess) return error;
  }
  *count = cached[device];
  return cudaSuccess;
}

template <typename Out, int kWarps, int kUnroll, int kBlocksPerSm>
cudaError_t launch(const GemvArgs& args, int pdl, cudaStream_t stream) {
  unsigned blocks = static_cast<unsigned>(args.n / kRowsPerBlock);
  if (kBlocksPerSm > 0) {
    int sms = 0;
    const cudaError_t error = sm_count(&sms);
    if (error != cudaSuccess) return error;
    blocks = std::min(blocks, static_cast<unsigned>(sms * kBlocksPerSm));
  }
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3(blocks);
  config.blockDim = dim3(kWarps * 32);
  config.stream = stream;
  cudaLaunchAttribute attribute = {};
  attribute.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute.val.programmaticStreamSerializationAllowed = 1;
  config.attrs = &attribute;
  config.numAttrs = pdl ? 1 : 0;
  return cudaLaunchKernelEx(&config, fp8_gemv_kernel<Out, kWarps, kUnroll>, args);
}

template <typename Out, int kId>
cudaError_t launch_config(const GemvArgs& args, int pdl, cudaStream_t stream) {
  return launch<Out, kConfigs[kId][0], kConfigs[kId][1], kConfigs[kId][2]>(args, pdl, stream);
}

template <typename Out>
cudaError_t dispatch(const GemvArgs& args, int config, int pdl, cudaStream_t stream) {
  switch (config) {
    case 0:
      return launch_config<Out, 0>(args, pdl, stream);
    case 1:
      return launch_config<Out, 1>(args, pdl, stream);
    case 2:
      return launch_config<Out, 2>(args, pdl, stream);
    case 3:
      return launch_config<Out, 3>(args, pdl, stream);
    case 4:
      return launch_config<Out, 4>(args, pdl, stream);
    case 5:
      return launch_config<Out, 5>(args, pdl, stream);
    default:
      return launch_config<Out, 6>(args, pdl, stream);
  }
}

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

}  // namespace

extern "C" {

int v1e_fp8_gemv_num_configs(void) { return kNumConfigs; }

int v1e_fp8_gemv(void* out, const void* a, const void* b, const float* scale_a,
                 const float* scale_b, const void* bias, int64_t m, int64_t n, int64_t k,
                 int64_t lda, int64_t ldb, int scale_a_per_row, int scale_b_per_col,
                 int out_dtype, int config, int pdl, void* stream) {
  using v1e::set_error;
  if (out == nullptr || a == nullptr || b == nullptr || scale_a == nullptr ||
      scale_b == nullptr) {
    return set_error("v1e_fp8_gemv: out, a, b, scale_a and scale_b must not be null");
  }
  if (m < 1 || m > kMaxTokens) {
    return set_error("v1e_fp8_gemv: m must be in [1, %d], got %" PRId64, kMaxTokens, m);
  }
  if (n <= 0 || n > INT_MAX || n % kRowsPerBlock != 0 || k <= 0 || k > INT_MAX ||
      k % kStepBytes != 0) {
    return set_error("v1e_fp8_gemv: n must be a positive multiple of %d and k of %d, got n=%" PRId64
                     " k=%" PRId64, kRowsPerBlock, kStepBytes, n, k);
  }
  if (lda < k || ldb < k || lda % 16 != 0 || ldb % 16 != 0) {
    return set_error("v1e_fp8_gemv: lda (%" PRId64 ") and ldb (%" PRId64
                     ") must be >= k (%" PRId64 ") and multiples of 16", lda, ldb, k);
  }
  if (!aligned16(a) || !aligned16(b)) {
    return set_error("v1e_fp8_gemv: a (%p) and b (%p) must be 16-byte aligned", a, b);
  }
  if (out_dtype != V1E_DTYPE_BFLOAT16 && out_dtype != V1E_DTYPE_FLOAT16) {
    return set_error("v1e_fp8_gemv: out_dtype code %d is neither bfloat16 (%d) nor float16 (%d)",
                     out_dtype, V1E_DTYPE_BFLOAT16, V1E_DTYPE_FLOAT16);
  }
  if (config < 0 || config >= kNumConfigs) {
    return set_error("v1e_fp8_gemv: config %d is outside [0, %d)", config, kNumConfigs);
  }
  const GemvArgs args{out, static_cast<const uint8_t*>(a), static_cast<const uint8_t*>(b),
                      scale_a, scale_b, bias, static_cast<int>(m), static_cast<int>(n),
                      static_cast<int>(k), lda, ldb, scale_a_per_row != 0,
                      scale_b_per_col != 0, pdl == 1 ? 1 : pdl == 3 ? 2 : 0};
  const auto s = static_cast<cudaStream_t>(stream);
  const cudaError_t error = out_dtype == V1E_DTYPE_BFLOAT16
                                ? dispatch<__nv_bfloat16>(args, config, pdl, s)
                                : dispatch<__half>(args, config, pdl, s);
  if (error != cudaSuccess) set_error("v1e_fp8_gemv: launch failed: %s", cudaGetErrorString(error));
  return error;
}

}  // extern "C"
