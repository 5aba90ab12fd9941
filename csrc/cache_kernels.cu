// Paged KV-cache writes: reshape_and_cache copies each new token's K and V rows into its slot.
//
// The copy never looks at element values, so the kernel is templated on a copy *word* rather than
// on the dtype: the widest of 16/8/4/2 bytes that divides every row size, row stride and base
// address. Aligned bf16/fp16/fp32 rows with head sizes 64/128 therefore move as 16-byte vectors.
#include <cuda_runtime.h>

#include <climits>
#include <cstdint>

#include "v1engine_kernels.h"

namespace {

constexpr int kMaxThreadsPerBlock = 512;
constexpr int kWarpSize = 32;

// One thread block per token: the block copies the token's K row and V row, word by word.
template <typename Word>
__global__ void reshape_and_cache_kernel(const Word* __restrict__ key,
                                         const Word* __restrict__ value,
                                         Word* __restrict__ kv_cache,
                                         const int64_t* __restrict__ slot_mapping,
                                         int64_t words_per_token,  // strides below: in words
                                         int64_t key_row_stride,
                                         int64_t value_row_stride, int64_t num_slots) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  // Programmatic dependent launch (a no-op when launched without it): let the next kernel start,
  // then wait for the previous one's writes (K/V come from it) before touching memory.
  asm volatile("griddepcontrol.launch_dependents;");
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
  const int64_t token = blockIdx.x;
  const int64_t slot = slot_mapping[token];
  // Negative slots are padding tokens; slots past the cache would be a caller bug, and skipping
  // them keeps that bug from corrupting memory.
  if (slot < 0 || slot >= num_slots) return;

  const Word* key_row = key + token * key_row_stride;
  const Word* value_row = value + token * value_row_stride;
  Word* key_dst = kv_cache + slot * words_per_token;
  Word* value_dst = key_dst + num_slots * words_per_token;  // plane 1 of [2, num_slots, H*D]
  for (int64_t i = threadIdx.x; i < words_per_token; i += blockDim.x) {
    key_dst[i] = key_row[i];
    value_dst[i] = value_row[i];
  }
}

int element_size(int dtype) {
  switch (dtype) {
    case V1E_DTYPE_FLOAT16:
    case V1E_DTYPE_BFLOAT16:
      return 2;
    case V1E_DTYPE_FLOAT32:
      return 4;
    default:
      return 0;
  }
}

// The widest copy word (16, 8, 4 or 2 bytes) that divides every value OR-ed into `bits`.
int widest_word(uint64_t bits) {
  for (int word = 16; word > 2; word /= 2) {
    if (bits % word == 0) return word;
  }
  return 2;
}

// Sizes of one token's row and the two row strides, in bytes.
struct RowBytes {
  int64_t row;
  int64_t key_stride;
  int64_t value_stride;
};

template <typename Word>
cudaError_t launch(const void* key, const void* value, void* kv_cache,
                   const int64_t* slot_mapping, int64_t num_tokens, int64_t num_slots,
                   int word_bytes, const RowBytes& bytes, int pdl, cudaStream_t stream) {
  const int64_t words_per_token = bytes.row / word_bytes;
  int64_t threads = (words_per_token + kWarpSize - 1) / kWarpSize * kWarpSize;
  if (threads > kMaxThreadsPerBlock) threads = kMaxThreadsPerBlock;
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3(static_cast<unsigned>(num_tokens));
  config.blockDim = dim3(static_cast<unsigned>(threads));
  config.stream = stream;
  cudaLaunchAttribute attribute = {};
  attribute.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute.val.programmaticStreamSerializationAllowed = 1;
  config.attrs = &attribute;
  config.numAttrs = pdl ? 1 : 0;
  return cudaLaunchKernelEx(&config, reshape_and_cache_kernel<Word>,
                            static_cast<const Word*>(key), static_cast<const Word*>(value),
                            static_cast<Word*>(kv_cache), slot_mapping, words_per_token,
                            bytes.key_stride / word_bytes, bytes.value_stride / word_bytes,
                            num_slots);
}

}  // namespace

extern "C" {

int v1e_abi_version(void) { return V1E_ABI_VERSION; }

const char* v1e_error_string(int code) {
  return cudaGetErrorString(static_cast<cudaError_t>(code));
}

int v1e_reshape_and_cache(const void* key, const void* value, void* kv_cache,
                          const int64_t* slot_mapping, int64_t num_tokens, int64_t num_kv_heads,
                          int64_t head_size, int64_t key_row_stride, int64_t value_row_stride,
                          int64_t num_blocks, int64_t block_size, int dtype, int pdl,
                          void* stream) {
  const int elem = element_size(dtype);
  const int64_t row = num_kv_heads * head_size;
  if (num_tokens == 0) return cudaSuccess;
  if (elem == 0 || num_tokens < 0 || num_tokens > INT_MAX || num_kv_heads <= 0 ||
      head_size <= 0 || key_row_stride < row || value_row_stride < row || num_blocks <= 0 ||
      block_size <= 0 || key == nullptr || value == nullptr || kv_cache == nullptr ||
      slot_mapping == nullptr) {
    return cudaErrorInvalidValue;
  }

  const RowBytes bytes{row * elem, key_row_stride * elem, value_row_stride * elem};
  const uint64_t bits = static_cast<uint64_t>(bytes.row) |
                        static_cast<uint64_t>(bytes.key_stride) |
                        static_cast<uint64_t>(bytes.value_stride) |
                        reinterpret_cast<uintptr_t>(key) | reinterpret_cast<uintptr_t>(value) |
                        reinterpret_cast<uintptr_t>(kv_cache);
  const int word = widest_word(bits);
  const int64_t num_slots = num_blocks * block_size;
  const auto s = static_cast<cudaStream_t>(stream);
  switch (word) {
    case 16:
      return launch<uint4>(key, value, kv_cache, slot_mapping, num_tokens, num_slots, word,
                           bytes, pdl, s);
    case 8:
      return launch<uint2>(key, value, kv_cache, slot_mapping, num_tokens, num_slots, word,
                           bytes, pdl, s);
    case 4:
      return launch<uint32_t>(key, value, kv_cache, slot_mapping, num_tokens, num_slots, word,
                              bytes, pdl, s);
    default:
      return launch<uint16_t>(key, value, kv_cache, slot_mapping, num_tokens, num_slots, word,
                              bytes, pdl, s);
  }
}

}  // extern "C"
