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
//
// Sharing needs one more thing. CUTLASS places a call's locks right behind its float partials,
// and the partials' size depends on the problem, so one call's locks could land on bytes another
// call left partials in. The last kLockRegionBytes of the caller's workspace are therefore
// reserved for locks: each call's partials are placed to end exactly where that region begins,
// so every call's locks fall inside it, and nothing but locks (all left zero) is ever written
// there.
#ifndef V1ENGINE_STREAM_K_SM90_CUH_
#define V1ENGINE_STREAM_K_SM90_CUH_

#include <cute/tensor.hpp>
#include <cutlass/cutlass.h>
#include <cutlass/device_kernel.h>
#include <cutlass/gemm/kernel/sm90_tile_scheduler_stream_k.hpp>
#include <cutlass/gemm/kernel/tile_scheduler.hpp>

#include <cstdint>

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
    // as Base::fixup_helper does and set it back to zero.
    static_assert(cute::is_same_v<typename FrgTensorC::value_type, float>);
    if (threadIdx.x % cutlass::NumThreadsPerWarpGroup != 0) {
      return;
    }
    BarrierType* locks = reinterpret_cast<BarrierType*>(
        reinterpret_cast<uint8_t*>(params.reduction_workspace_) + reduction_bytes(params));
    const uint64_t lock_idx =
        Base::output_tile_index(params, work_tile_info) * num_barriers + barrier_idx;
    locks[lock_idx] = 0;
  }

  // Bytes of float partials in front of the locks in the workspace (separate reduction is
  // disabled in this CUTLASS, so the reduction tiles are the split-K or the stream-K tiles).
  CUTLASS_HOST_DEVICE static uint64_t reduction_bytes(Params const& params) {
    const uint32_t reduction_tiles =
        params.divmod_splits_.divisor > 1 ? params.units_per_problem_ : params.sk_tiles_;
    return Params::get_reduction_workspace_size(
        reduction_tiles, cutlass::gemm::to_gemm_coord(TileShape{}), sizeof_bits<float>::value,
        1);
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

// Checks the CUTLASS arguments part by part, so a rejection names the part that refused (see
// set_error). `what` names the GEMM in messages.
template <class Gemm>
int check_arguments(typename Gemm::Arguments& args, const char* what) {
  using GemmKernel = typename Gemm::GemmKernel;
  const auto& shape = args.problem_shape;
  const int m = get<0>(shape), n = get<1>(shape), k = get<2>(shape);
  if (!GemmKernel::CollectiveMainloop::can_implement(shape, args.mainloop)) {
    return set_error(
        "%s: the CUTLASS mainloop rejects m=%d n=%d k=%d: a TMA-loaded operand (A, B, or the "
        "block-scaled kernel's M-major scale A) has an extent or stride that is not a multiple "
        "of 16 bytes",
        what, m, n, k);
  }
  if (!GemmKernel::CollectiveEpilogue::can_implement(shape, args.epilogue)) {
    return set_error(
        "%s: the CUTLASS epilogue rejects m=%d n=%d k=%d (output rows not 16-byte aligned)", what,
        m, n, k);
  }
  const cutlass::Status can = Gemm::can_implement(args);
  if (can != cutlass::Status::kSuccess) {
    return set_error("%s: CUTLASS can_implement rejects m=%d n=%d k=%d (problem mode or tile "
                     "scheduler): %s",
                     what, m, n, k, cutlass::cutlassGetStatusString(can));
  }
  return cudaSuccess;
}

// The CUDA status of a launch CUTLASS reported as `run`, with the reason recorded on failure.
inline int launch_status(cutlass::Status run, const char* what) {
  cudaError_t error = cudaGetLastError();
  if (run != cutlass::Status::kSuccess && error == cudaSuccess) {
    error = cudaErrorLaunchFailure;
  }
  if (error != cudaSuccess) {
    set_error("%s: kernel launch failed: %s", what, cudaGetErrorString(error));
  }
  return error;
}

// The tail of a stream-K workspace reserved for locks (see the file comment): 256k locks, two
// per split output tile.
constexpr size_t kLockRegionBytes = size_t(1) << 20;

// The workspace a ResettingStreamK GEMM needs from the caller: its float partials followed by
// the lock region (0 when no tile is split). Sets *partials to the partials' bytes. Returns
// cudaSuccess, or cudaErrorInvalidValue with the reason recorded.
template <class Gemm>
int stream_k_workspace(typename Gemm::Arguments& args, size_t* needed, size_t* partials,
                       const char* what) {
  using GemmKernel = typename Gemm::GemmKernel;
  *needed = *partials = 0;
  const size_t cutlass_bytes = Gemm::get_workspace_size(args);
  if (cutlass_bytes == 0) {
    return cudaSuccess;
  }
  if (GemmKernel::CollectiveEpilogue::get_workspace_size(args.problem_shape, args.epilogue) !=
      0) {
    return set_error("%s: the epilogue asks for a workspace of its own", what);
  }
  // Only the sizes matter here; nothing dereferences the placeholder address.
  const auto params =
      GemmKernel::to_underlying_arguments(args, reinterpret_cast<void*>(uintptr_t(256)));
  *partials = GemmKernel::TileScheduler::reduction_bytes(params.scheduler);
  if (cutlass_bytes - *partials > kLockRegionBytes) {
    return set_error("%s: the problem needs %zu bytes of locks, more than the %zu reserved", what,
                     cutlass_bytes - *partials, kLockRegionBytes);
  }
  *needed = *partials + kLockRegionBytes;
  return cudaSuccess;
}

// Launches a GEMM whose tile scheduler is ResettingStreamK: checks the arguments part by part
// (so a rejection names the part that refused, see set_error), then launches with its partials
// placed in front of the caller's lock region and without CUTLASS's workspace memset. `what`
// names the GEMM in messages.
template <class Gemm>
int launch_stream_k(typename Gemm::Arguments& args, void* workspace, size_t workspace_bytes,
                    int device, cudaStream_t stream, bool pdl, const char* what) {
  using GemmKernel = typename Gemm::GemmKernel;
  size_t needed = 0, partials = 0;
  const int sized = stream_k_workspace<Gemm>(args, &needed, &partials, what);
  if (sized != cudaSuccess) return sized;
  if (needed > workspace_bytes || (needed > 0 && workspace == nullptr)) {
    return set_error("%s: the kernel needs a %zu-byte workspace, %zu bytes were passed", what,
                     needed, workspace == nullptr ? size_t(0) : workspace_bytes);
  }
  void* placed = needed == 0 ? nullptr
                             : static_cast<uint8_t*>(workspace) + workspace_bytes -
                                   kLockRegionBytes - partials;
  const int checked = check_arguments<Gemm>(args, what);
  if (checked != cudaSuccess) return checked;
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
  typename GemmKernel::Params params = GemmKernel::to_underlying_arguments(args, placed);
  return launch_status(Gemm::run(params, stream, nullptr, pdl), what);
}

}  // namespace sm90
}  // namespace v1e

#endif  // V1ENGINE_STREAM_K_SM90_CUH_
