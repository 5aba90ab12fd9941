// bf16 GEMM for decode-sized M on sm_90a: out[M, N] = a[M, K] . b[N, K]^T (an nn.Linear without
// bias), CUTLASS warp-specialized TMA kernels with a stream-K tile scheduler.
//
// Why: at M = 16..128 a Llama layer's projections are weight-streaming problems (the weight is
// read once, the activation rows are few), and what decides their speed is that every SM pulls
// weight bytes until the end. With 128-row weight tiles, the 8B qkv (N = 6144) has 48 output
// tiles and o_proj 32 for 132 SMs; cuBLAS's pick runs them at 60-70% of HBM. Stream-K gives
// every CTA the same number of K steps, splitting output tiles across CTAs where needed; the
// split tiles meet through a workspace in global memory.
//
// Swapped operands: the kernel computes D^T[N, M] = b[N, K] . a[M, K]^T, so the weight fills the
// 128-row wgmma tile and M is the narrow tile N; D^T column-major is out row-major.
//
// The workspace: stream_k_sm90.cuh's scheduler leaves its locks zero after every call, so the
// caller zeroes it once and calls ordered on one stream share it (no memset in the graph).
#include <tuple>
#include <type_traits>
#include <utility>

#include <cute/tensor.hpp>
#include <cutlass/cutlass.h>
#include <cutlass/epilogue/collective/collective_builder.hpp>
#include <cutlass/epilogue/thread/linear_combination.h>
#include <cutlass/gemm/collective/collective_builder.hpp>
#include <cutlass/gemm/device/gemm_universal_adapter.h>
#include <cutlass/gemm/dispatch_policy.hpp>
#include <cutlass/gemm/kernel/gemm_universal.hpp>

#include "gemm_sm90.h"
#include "scaled_mm.h"
#include "stream_k_sm90.cuh"
#include "v1engine_kernels.h"

namespace v1e {
namespace sm90_gemm {

using namespace cute;

using Element = cutlass::bfloat16_t;
using ElementAcc = float;
constexpr int kAlignment = 8;  // elements: 16 bytes of bf16 (TMA)

template <class TileShape_>
struct GemmKernelOf {
  using TileShape = TileShape_;
  using ClusterShape = Shape<_1, _1, _1>;
  using LayoutA = cutlass::layout::RowMajor;     // the weight [N, K], K contiguous
  using LayoutB = cutlass::layout::ColumnMajor;  // the activation [M, K], K contiguous
  using LayoutD = cutlass::layout::ColumnMajor;  // D^T [N, M] column-major = out [M, N]

  using Fusion = cutlass::epilogue::fusion::LinearCombination<Element, float, void, float>;
  using CollectiveEpilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
      cutlass::epilogue::collective::EpilogueTileAuto, ElementAcc, float, void, LayoutD,
      kAlignment, Element, LayoutD, kAlignment,
      cutlass::epilogue::TmaWarpSpecializedCooperative, Fusion>::CollectiveOp;

  using CollectiveMainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Element, LayoutA, kAlignment, Element,
      LayoutB, kAlignment, ElementAcc, TileShape, ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(
          sizeof(typename CollectiveEpilogue::SharedStorage))>,
      cutlass::gemm::KernelTmaWarpSpecializedCooperative>::CollectiveOp;

  using GemmKernel =
      cutlass::gemm::kernel::GemmUniversal<Shape<int, int, int, int>, CollectiveMainloop,
                                           CollectiveEpilogue, sm90::ResettingStreamKTag>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<GemmKernel>;
};

// Tile shapes by configuration id: (weight rows, activation rows, K step). See gemm_sm90.h.
using TileShapes = std::tuple<Shape<_128, _16, _128>, Shape<_128, _32, _128>,
                              Shape<_128, _64, _64>, Shape<_128, _64, _128>,
                              Shape<_128, _128, _64>>;
static_assert(std::tuple_size_v<TileShapes> == kNumGemmConfigs);
template <int kConfig>
struct TileById {
  using type = std::tuple_element_t<kConfig, TileShapes>;
};

template <int kConfig>
typename GemmKernelOf<typename TileById<kConfig>::type>::Gemm::Arguments make_arguments(
    const GemmParams& p) {
  using Kernel = GemmKernelOf<typename TileById<kConfig>::type>;
  using GemmKernel = typename Kernel::GemmKernel;
  using StrideA = typename GemmKernel::StrideA;
  using StrideB = typename GemmKernel::StrideB;
  using StrideD = typename GemmKernel::StrideD;
  using Scheduler = typename GemmKernel::TileScheduler;

  StrideA stride_a = make_stride(p.ldb, _1{}, int64_t(0));  // the weight
  StrideB stride_b = make_stride(p.lda, _1{}, int64_t(0));  // the activation
  StrideD stride_d = make_stride(_1{}, p.n, int64_t(0));

  cutlass::KernelHardwareInfo hw_info;
  hw_info.device_id = p.device;
  hw_info.sm_count = p.sm_count;

  typename Kernel::Gemm::Arguments args{
      cutlass::gemm::GemmUniversalMode::kGemm,
      {static_cast<int>(p.n), static_cast<int>(p.m), static_cast<int>(p.k), 1},
      {static_cast<const Element*>(p.b), stride_a, static_cast<const Element*>(p.a), stride_b},
      {{}, nullptr, stride_d, static_cast<Element*>(p.out), stride_d},
      hw_info};
  args.epilogue.thread.alpha = 1.0f;
  args.epilogue.thread.beta = 0.0f;
  using Decomposition = typename Scheduler::DecompositionMode;
  switch (p.decomposition) {
    case kGemmStreamK:
    case kGemmStreamKUnordered:
      args.scheduler.decomposition_mode = Decomposition::StreamK;
      break;
    case kGemmSplitK:
    case kGemmSplitKUnordered:
      args.scheduler.decomposition_mode = Decomposition::SplitK;
      args.scheduler.splits = p.splits;
      break;
    case kGemmDataParallel:
      args.scheduler.decomposition_mode = Decomposition::DataParallel;
      break;
    default:
      args.scheduler.decomposition_mode = Decomposition::Heuristic;
      break;
  }
  const bool unordered =
      p.decomposition == kGemmStreamKUnordered || p.decomposition == kGemmSplitKUnordered;
  args.scheduler.reduction_mode = unordered ? Scheduler::ReductionMode::Nondeterministic
                                            : Scheduler::ReductionMode::Deterministic;
  return args;
}

template <int kConfig>
int workspace_size(const GemmParams& p, size_t* bytes) {
  using Gemm = typename GemmKernelOf<typename TileById<kConfig>::type>::Gemm;
  auto args = make_arguments<kConfig>(p);
  size_t partials = 0;
  return sm90::stream_k_workspace<Gemm>(args, bytes, &partials, "v1e_gemm_workspace_size");
}

template <int kConfig>
int run(const GemmParams& p) {
  using Gemm = typename GemmKernelOf<typename TileById<kConfig>::type>::Gemm;
  auto args = make_arguments<kConfig>(p);
  return sm90::launch_stream_k<Gemm>(args, p.workspace, p.workspace_bytes, p.device, p.stream,
                                     p.pdl, "v1e_gemm");
}

// Calls body(std::integral_constant<int, config>{}) for a configuration id.
template <class Body, int... kConfigs>
int with_config(int config, Body&& body, std::integer_sequence<int, kConfigs...>) {
  int result = cudaSuccess;
  const bool found =
      ((config == kConfigs && (result = body(std::integral_constant<int, kConfigs>{}), true)) ||
       ...);
  return found ? result : set_error("v1e_gemm: config %d has no kernel", config);
}

template <class Body>
int with_config(int config, Body&& body) {
  return with_config(config, body, std::make_integer_sequence<int, kNumGemmConfigs>{});
}

}  // namespace sm90_gemm

int gemm_run(const GemmParams& params, int config) {
  return sm90_gemm::with_config(
      config, [&](auto id) { return sm90_gemm::run<decltype(id)::value>(params); });
}

int gemm_workspace_size(const GemmParams& params, int config, size_t* bytes) {
  return sm90_gemm::with_config(config, [&](auto id) {
    return sm90_gemm::workspace_size<decltype(id)::value>(params, bytes);
  });
}

}  // namespace v1e
