// CUTLASS's sm90 stream-K tile scheduler made fit for CUDA graphs with programmatic dependent
// launch, and the launch path for kernels that use it. Included by the CUTLASS instantiation
// files (gemm_sm90.cu, scaled_mm_sm90.cuh).
//
// CUTLASS's stream-K fixup keeps a lock per split output tile that must be zero when the kernel
// starts, and CUTLASS zeroes it with a memset before every launch (GemmUniversalAdapter::
// initialize). A memset between two kernels of a decode CUDA graph would cut its programmatic-
// dependent-launch chain, so the scheduler below has the unit that finishes a split tile set the
// tile's lock back to zero (every other unit of the tile has arrived by then, and none reads it
// again), and `launch_stream_k` launches without the memset. The caller zeroes the workspace
// once when it allocates it; calls ordered on one stream may then share it.
#ifndef V1ENGINE_STREAM_K_SM90_CUH_
#define V1ENGINE_STREAM_K_SM90_CUH_

#include <cute/tensor.hpp>
#include <cutlass/cutlass.h>
#include <cutlass/device_kernel.h>
#include <cutlass/gemm/kernel/sm90_tile_scheduler_stream_k.hpp>
#include <cutlass/gemm/kernel/tile_scheduler.hpp>

#include "scaled_mm.h"

namespace v1e {
namespace sm90 {

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

}  // namespace sm90
}  // namespace v1e

namespace cutlass::gemm::kernel::detail {
template <class TileShape, class ClusterShape, uint32_t SchedulerPipelineStageCount>
struct TileSchedulerSelector<v1e::sm90::ResettingStreamKTag, arch::Sm90, TileShape,
                             ClusterShape, SchedulerPipelineStageCount> {
  using Scheduler = v1e::sm90::ResettingStreamK<TileShape, ClusterShape>;
};
}  // namespace cutlass::gemm::kernel::detail


namespace v1e {
namespace sm90 {

constexpr int kMaxDevices = 64;

// Launches a GEMM whose tile scheduler is ResettingStreamK: checks the arguments part by part
// (so a rejection names the part that refused, see set_error), then launches with the caller's
// workspace and without CUTLASS's workspace memset. `what` names the GEMM in messages.
template <class Gemm>
int launch_stream_k(typename Gemm::Arguments& args, void* workspace, size_t workspace_bytes,
                    int device, cudaStream_t stream, bool pdl, const char* what) {
  using GemmKernel = typename Gemm::GemmKernel;
  const auto& shape = args.problem_shape;
  const int m = get<0>(shape), n = get<1>(shape), k = get<2>(shape);
  const size_t needed = Gemm::get_workspace_size(args);
  if (needed > workspace_bytes || (needed > 0 && workspace == nullptr)) {
    return set_error("%s: the kernel needs a %zu-byte workspace, %zu bytes were passed", what,
                     needed, workspace == nullptr ? size_t(0) : workspace_bytes);
  }
  if (!GemmKernel::CollectiveMainloop::can_implement(shape, args.mainloop)) {
    return set_error("%s: the CUTLASS mainloop rejects m=%d n=%d k=%d (a TMA-loaded operand has "
                     "an extent or stride that is not a multiple of 16 bytes)",
                     what, m, n, k);
  }
  if (!GemmKernel::CollectiveEpilogue::can_implement(shape, args.epilogue)) {
    return set_error("%s: the CUTLASS epilogue rejects m=%d n=%d k=%d", what, m, n, k);
  }
  if (!GemmKernel::can_implement(args)) {
    return set_error("%s: CUTLASS can_implement rejects m=%d n=%d k=%d (tile scheduler "
                     "arguments)", what, m, n, k);
  }
  // The kernel's shared memory limit, raised once per device (a function attribute is set in
  // the current device's context).
  static bool raised[kMaxDevices] = {};
  if (device < 0 || device >= kMaxDevices || !raised[device]) {
    const cudaError_t error = cudaFuncSetAttribute(cutlass::device_kernel<GemmKernel>,
                                                   cudaFuncAttributeMaxDynamicSharedMemorySize,
                                                   GemmKernel::SharedStorageSize);
    if (error != cudaSuccess) {
      set_error("%s: cannot raise the kernel's shared memory to %d bytes: %s", what,
                static_cast<int>(GemmKernel::SharedStorageSize), cudaGetErrorString(error));
      return error;
    }
    if (device >= 0 && device < kMaxDevices) raised[device] = true;
  }
  typename GemmKernel::Params params = GemmKernel::to_underlying_arguments(args, workspace);
  if (Gemm::run(params, stream, nullptr, pdl) != cutlass::Status::kSuccess) {
    const cudaError_t error = cudaGetLastError();
    set_error("%s: kernel launch failed: %s", what,
              cudaGetErrorString(error != cudaSuccess ? error : cudaErrorLaunchFailure));
    return error != cudaSuccess ? error : cudaErrorLaunchFailure;
  }
  const cudaError_t error = cudaGetLastError();
  if (error != cudaSuccess) {
    set_error("%s: kernel launch failed: %s", what, cudaGetErrorString(error));
  }
  return error;
}

}  // namespace sm90
}  // namespace v1e

#endif  // V1ENGINE_STREAM_K_SM90_CUH_
