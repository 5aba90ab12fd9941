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
// The workspace: CUTLASS's stream-K fixup keeps a lock per split output tile that must be zero
// when the kernel starts, and CUTLASS zeroes it with a memset before every launch. A memset
// between two kernels of a decode CUDA graph would cut its programmatic-dependent-launch chain,
// so the scheduler below has the unit that finishes a split tile set the tile's lock back to zero
// (every other unit of the tile has arrived by then and none reads it again). The caller zeroes
// the workspace once when it allocates it; calls on one stream may then share it.
#include <cute/tensor.hpp>
#include <cutlass/cutlass.h>
#include <cutlass/epilogue/collective/collective_builder.hpp>
#include <cutlass/epilogue/thread/linear_combination.h>
#include <cutlass/gemm/collective/collective_builder.hpp>
#include <cutlass/gemm/device/gemm_universal_adapter.h>
#include <cutlass/gemm/dispatch_policy.hpp>
#include <cutlass/gemm/kernel/gemm_universal.hpp>
#include <cutlass/gemm/kernel/sm90_tile_scheduler_stream_k.hpp>

#include "gemm_sm90.h"
#include "scaled_mm.h"
#include "v1engine_kernels.h"

namespace v1e {
namespace sm90_gemm {

using namespace cute;

// The stream-K scheduler of CUTLASS with self-resetting locks (see the file comment).
template <class TileShape, class ClusterShape>
class ResettingStreamK
    : public cutlass::gemm::kernel::detail::PersistentTileSchedulerSm90StreamK<TileShape,
                                                                                ClusterShape> {
  using Base =
      cutlass::gemm::kernel::detail::PersistentTileSchedulerSm90StreamK<TileShape, ClusterShape>;

 public:
  using Base::Base;
  using typename Base::BarrierType;
  using typename Base::Params;
  using typename Base::WorkTileInfo;

  // The kernel asks this after each work unit's main loop, to let its dependents launch
  // (programmatic dependent launch) once every CTA is on its last unit. CUTLASS 4.2's version
  // does not compile under CUTLASS_ENABLE_GDC_FOR_SM90 (it binds a member to a non-const
  // reference inside a const function); saying "last" after the first unit releases the
  // dependents a unit earlier, which only lets them launch and wait sooner: they still wait for
  // this grid to complete before touching memory.
  CUTLASS_DEVICE bool is_last_tile(WorkTileInfo const&, uint32_t = 1) const { return true; }

  template <class FrgTensorC>
  CUTLASS_DEVICE static void fixup(Params const& params, WorkTileInfo const& work_tile_info,
                                   FrgTensorC& accumulators, uint32_t num_barriers,
                                   uint32_t barrier_idx) {
    Base::fixup(params, work_tile_info, accumulators, num_barriers, barrier_idx);
    if (!Base::requires_fixup(params, work_tile_info) ||
        !Base::compute_epilogue(work_tile_info, params)) {
      return;
    }
    // This unit finished the tile: its wait in fixup saw every peer's arrival. Locate the lock
    // as Base::fixup_helper does (separate reduction is disabled in this CUTLASS, so the
    // reduction tiles are the split-K tiles or the stream-K tiles).
    using ElementAccumulator = typename FrgTensorC::value_type;
    static_assert(cute::is_same_v<ElementAccumulator, float>);
    if (threadIdx.x % cutlass::NumThreadsPerWarpGroup != 0) {
      return;
    }
    const uint32_t reduction_tiles =
        params.divmod_splits_.divisor > 1 ? params.units_per_problem_ : params.sk_tiles_;
    const uint64_t reduction_bytes = Params::get_reduction_workspace_size(
        reduction_tiles, cutlass::gemm::to_gemm_coord(TileShape{}),
        sizeof_bits<ElementAccumulator>::value, 1);
    BarrierType* locks = reinterpret_cast<BarrierType*>(
        reinterpret_cast<uint8_t*>(params.reduction_workspace_) + reduction_bytes);
    const uint64_t lock_idx =
        Base::output_tile_index(params, work_tile_info) * num_barriers + barrier_idx;
    locks[lock_idx] = 0;
  }
};

struct ResettingStreamKTag {};

}  // namespace sm90_gemm
}  // namespace v1e

namespace cutlass::gemm::kernel::detail {
template <class TileShape, class ClusterShape, uint32_t SchedulerPipelineStageCount>
struct TileSchedulerSelector<v1e::sm90_gemm::ResettingStreamKTag, arch::Sm90, TileShape,
                             ClusterShape, SchedulerPipelineStageCount> {
  using Scheduler = v1e::sm90_gemm::ResettingStreamK<TileShape, ClusterShape>;
};
}  // namespace cutlass::gemm::kernel::detail

namespace v1e {
namespace sm90_gemm {

using Element = cutlass::bfloat16_t;
using ElementAcc = float;
constexpr int kAlignment = 8;  // elements: 16 bytes of bf16 (TMA)
constexpr int kMaxDevices = 64;

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
                                           CollectiveEpilogue, ResettingStreamKTag>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<GemmKernel>;
};

// Tile shapes by configuration id: (weight rows, activation rows, K step). See gemm_sm90.h.
template <int kConfig>
struct TileById;
template <>
struct TileById<0> {
  using type = Shape<_128, _16, _128>;
};
template <>
struct TileById<1> {
  using type = Shape<_128, _32, _128>;
};
template <>
struct TileById<2> {
  using type = Shape<_128, _64, _64>;
};
template <>
struct TileById<3> {
  using type = Shape<_128, _64, _128>;
};
template <>
struct TileById<4> {
  using type = Shape<_128, _128, _64>;
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
      args.scheduler.decomposition_mode = Decomposition::StreamK;
      break;
    case kGemmSplitK:
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
  args.scheduler.reduction_mode = Scheduler::ReductionMode::Deterministic;
  return args;
}

template <int kConfig>
int workspace_size(const GemmParams& p, size_t* bytes) {
  using Gemm = typename GemmKernelOf<typename TileById<kConfig>::type>::Gemm;
  auto args = make_arguments<kConfig>(p);
  *bytes = Gemm::get_workspace_size(args);
  return cudaSuccess;
}

template <int kConfig>
int run(const GemmParams& p) {
  using Kernel = GemmKernelOf<typename TileById<kConfig>::type>;
  using Gemm = typename Kernel::Gemm;
  using GemmKernel = typename Kernel::GemmKernel;
  auto args = make_arguments<kConfig>(p);
  const int m = static_cast<int>(p.m), n = static_cast<int>(p.n), k = static_cast<int>(p.k);

  const size_t needed = Gemm::get_workspace_size(args);
  if (needed > p.workspace_bytes) {
    return set_error("v1e_gemm: the kernel needs a %zu-byte workspace, %zu bytes were passed",
                     needed, p.workspace_bytes);
  }
  if (!GemmKernel::CollectiveMainloop::can_implement(args.problem_shape, args.mainloop)) {
    return set_error("v1e_gemm: the CUTLASS mainloop rejects m=%d n=%d k=%d (a TMA-loaded "
                     "operand has an extent or stride that is not a multiple of 16 bytes)",
                     m, n, k);
  }
  if (!GemmKernel::CollectiveEpilogue::can_implement(args.problem_shape, args.epilogue)) {
    return set_error("v1e_gemm: the CUTLASS epilogue rejects m=%d n=%d k=%d", m, n, k);
  }
  if (!GemmKernel::can_implement(args)) {
    return set_error("v1e_gemm: CUTLASS can_implement rejects m=%d n=%d k=%d (tile scheduler "
                     "arguments)", m, n, k);
  }
  // No initialize(): it would zero the workspace with a memset before the launch (see the file
  // comment); the locks are left zero by the previous call instead.
  // The kernel's shared memory limit, raised once per device (a function attribute is set in
  // the current device's context).
  static bool raised[kMaxDevices] = {};
  cudaError_t attribute = cudaSuccess;
  if (p.device < 0 || p.device >= kMaxDevices || !raised[p.device]) {
    attribute = cudaFuncSetAttribute(cutlass::device_kernel<GemmKernel>,
                                     cudaFuncAttributeMaxDynamicSharedMemorySize,
                                     GemmKernel::SharedStorageSize);
    if (attribute == cudaSuccess && p.device >= 0 && p.device < kMaxDevices) {
      raised[p.device] = true;
    }
  }
  if (attribute != cudaSuccess) {
    set_error("v1e_gemm: cannot raise the kernel's shared memory to %d bytes: %s",
              static_cast<int>(GemmKernel::SharedStorageSize), cudaGetErrorString(attribute));
    return attribute;
  }
  typename GemmKernel::Params params = GemmKernel::to_underlying_arguments(args, p.workspace);
  if (Gemm::run(params, p.stream, nullptr, p.pdl) != cutlass::Status::kSuccess) {
    const cudaError_t error = cudaGetLastError();
    set_error("v1e_gemm: kernel launch failed: %s",
              cudaGetErrorString(error != cudaSuccess ? error : cudaErrorLaunchFailure));
    return error != cudaSuccess ? error : cudaErrorLaunchFailure;
  }
  const cudaError_t error = cudaGetLastError();
  if (error != cudaSuccess) {
    set_error("v1e_gemm: kernel launch failed: %s", cudaGetErrorString(error));
  }
  return error;
}

}  // namespace sm90_gemm

int gemm_run(const GemmParams& params, int config) {
  switch (config) {
    case 0:
      return sm90_gemm::run<0>(params);
    case 1:
      return sm90_gemm::run<1>(params);
    case 2:
      return sm90_gemm::run<2>(params);
    case 3:
      return sm90_gemm::run<3>(params);
    case 4:
      return sm90_gemm::run<4>(params);
    default:
      return set_error("v1e_gemm: config %d has no kernel", config);
  }
}

int gemm_workspace_size(const GemmParams& params, int config, size_t* bytes) {
  switch (config) {
    case 0:
      return sm90_gemm::workspace_size<0>(params, bytes);
    case 1:
      return sm90_gemm::workspace_size<1>(params, bytes);
    case 2:
      return sm90_gemm::workspace_size<2>(params, bytes);
    case 3:
      return sm90_gemm::workspace_size<3>(params, bytes);
    case 4:
      return sm90_gemm::workspace_size<4>(params, bytes);
    default:
      return set_error("v1e_gemm: config %d has no kernel", config);
  }
}

}  // namespace v1e
