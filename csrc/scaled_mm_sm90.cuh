// CUTLASS 3.x FP8 GEMMs for sm_90a: warp-specialized, TMA-fed, persistent kernels.
//
// Included only by the scaled_mm_*.cu instantiation files (each holds a few kernels, since every
// CUTLASS kernel costs seconds of nvcc time); scaled_mm_entry.cu reaches them through scaled_mm.h.
//
// Per-tensor / per-channel GEMM: D = (acc * scale_a) * scale_b + bias, with the scales applied by
// an epilogue visitor tree on the fp32 accumulator. A scale with one value per row of D is a
// column-vector broadcast (Sm90ColBroadcast) and one per column a row-vector broadcast
// (Sm90RowBroadcast); both take a runtime flag that turns them into a scalar broadcast, so one
// kernel serves per-tensor and per-token/per-channel scales.
//
// Swap AB: for small M the kernel computes D^T[N, M] = b[N, K] . a[M, K]^T, so the large N fills
// the 64-row wgmma tile and M becomes the narrow tile N; D^T is written column-major, which is D
// row-major. The roles of the broadcasts swap with it.
#ifndef V1ENGINE_SCALED_MM_SM90_CUH_
#define V1ENGINE_SCALED_MM_SM90_CUH_

#include <cuda_fp16.h>

#include <cute/tensor.hpp>
#include <cutlass/cutlass.h>
#include <cutlass/detail/blockwise_scale_layout.hpp>
#include <cutlass/epilogue/collective/collective_builder.hpp>
#include <cutlass/epilogue/fusion/sm90_visitor_compute_tma_warpspecialized.hpp>
#include <cutlass/epilogue/fusion/sm90_visitor_load_tma_warpspecialized.hpp>
#include <cutlass/epilogue/fusion/sm90_visitor_tma_warpspecialized.hpp>
#include <cutlass/gemm/collective/collective_builder.hpp>
#include <cutlass/gemm/device/gemm_universal_adapter.h>
#include <cutlass/gemm/dispatch_policy.hpp>
#include <cutlass/gemm/kernel/gemm_universal.hpp>
#include <type_traits>

#include "scaled_mm.h"
#include "stream_k_sm90.cuh"
#include "v1engine_kernels.h"

namespace v1e {
namespace sm90 {

using namespace cute;

using ElementAB = cutlass::float_e4m3_t;
using ElementAcc = float;
constexpr int kAlignmentAB = 16;  // elements: 16 bytes of e4m3 (TMA)

template <int kDtype>
using OutputElement =
    std::conditional_t<kDtype == V1E_DTYPE_BFLOAT16, cutlass::bfloat16_t, cutlass::half_t>;

// One tile configuration of the per-channel GEMM. Stream-K configurations (cooperative only)
// take a workspace; the others none. A stream-K configuration's split tiles add their partials
// in a fixed order (kOrdered: the same result every run) or atomically in arrival order.
template <class TileShape_, class ClusterShape_, bool kCooperative_, bool kSwapAB_,
          bool kStreamK_ = false, bool kOrdered_ = true>
struct TileConfig {
  using TileShape = TileShape_;
  using ClusterShape = ClusterShape_;
  static constexpr bool kCooperative = kCooperative_;
  static constexpr bool kSwapAB = kSwapAB_;
  static constexpr bool kStreamK = kStreamK_;
  static constexpr bool kOrdered = kOrdered_;
  static_assert(!kStreamK || kCooperative, "CUTLASS runs stream-K in cooperative kernels only");
};

// The configuration ids of v1e_scaled_mm. Pingpong kernels overlap one warp group's epilogue with
// the other's MMAs (best when K loops are short); cooperative ones split a 128-row tile over two
// warp groups (best for large tiles).
template <int kConfig>
struct ConfigById;
template <>  // M <= 16: swapped, M fills a 16-wide tile
struct ConfigById<0> : TileConfig<Shape<_64, _16, _256>, Shape<_1, _1, _1>, false, true> {};
template <>  // M <= 32
struct ConfigById<1> : TileConfig<Shape<_64, _32, _256>, Shape<_1, _1, _1>, false, true> {};
template <>  // M <= 64
struct ConfigById<2> : TileConfig<Shape<_64, _64, _256>, Shape<_1, _1, _1>, false, true> {};
template <>  // M <= 128
struct ConfigById<3> : TileConfig<Shape<_64, _128, _128>, Shape<_1, _2, _1>, false, false> {};
template <>  // M <= 256
struct ConfigById<4> : TileConfig<Shape<_128, _128, _128>, Shape<_2, _1, _1>, false, false> {};
template <>  // large M
struct ConfigById<5> : TileConfig<Shape<_128, _256, _128>, Shape<_2, _1, _1>, true, false> {};
template <>  // large M, alternative
struct ConfigById<6> : TileConfig<Shape<_128, _128, _128>, Shape<_1, _2, _1>, true, false> {};
template <>  // 64 < M <= 128, alternative: swapped
struct ConfigById<7> : TileConfig<Shape<_64, _128, _128>, Shape<_1, _1, _1>, false, true> {};
// Decode-sized M with stream-K: every CTA the same share of K steps, so short weights (the 8B
// o_proj has 32 tiles of 128 rows) and wave remainders (gate_up: 224 tiles on 132 SMs) keep
// every SM streaming. Swapped, cooperative (two warp groups on the 128 weight rows).
template <>  // M <= 16
struct ConfigById<8>
    : TileConfig<Shape<_128, _16, _128>, Shape<_1, _1, _1>, true, true, true> {};
template <>  // M <= 64
struct ConfigById<9>
    : TileConfig<Shape<_128, _64, _128>, Shape<_1, _1, _1>, true, true, true> {};
template <>  // 8 with the partials added in arrival order
struct ConfigById<10>
    : TileConfig<Shape<_128, _16, _128>, Shape<_1, _1, _1>, true, true, true, false> {};
template <>  // 9 with the partials added in arrival order
struct ConfigById<11>
    : TileConfig<Shape<_128, _64, _128>, Shape<_1, _1, _1>, true, true, true, false> {};
// M <= 16 with 256-deep K steps (config 0's depth, which won the decode rows among the
// data-parallel tiles): half the pipeline iterations of 8, twice the bytes per TMA load.
template <>
struct ConfigById<12>
    : TileConfig<Shape<_128, _16, _256>, Shape<_1, _1, _1>, true, true, true> {};
template <>  // 12 with the partials added in arrival order
struct ConfigById<13>
    : TileConfig<Shape<_128, _16, _256>, Shape<_1, _1, _1>, true, true, true, false> {};

template <class ElementD, class Config>
struct ScaledMmKernel {
  static constexpr bool kSwapAB = Config::kSwapAB;
  using TileShape = typename Config::TileShape;
  using ClusterShape = typename Config::ClusterShape;
  using MainloopSchedule =
      std::conditional_t<Config::kCooperative,
                         cutlass::gemm::KernelTmaWarpSpecializedCooperativeFP8FastAccum,
                         cutlass::gemm::KernelTmaWarpSpecializedPingpongFP8FastAccum>;
  using EpilogueSchedule = std::conditional_t<Config::kCooperative,
                                              cutlass::epilogue::TmaWarpSpecializedCooperative,
                                              cutlass::epilogue::TmaWarpSpecialized>;

  using LayoutA = cutlass::layout::RowMajor;     // the kernel's A: [M', K], K contiguous
  using LayoutB = cutlass::layout::ColumnMajor;  // the kernel's B: [N', K], K contiguous
  using LayoutD =
      std::conditional_t<kSwapAB, cutlass::layout::ColumnMajor, cutlass::layout::RowMajor>;
  static constexpr int kAlignmentD = 128 / cutlass::sizeof_bits<ElementD>::value;

  // Broadcasts in the kernel's frame: per row of D' (M') and per column of D' (N'). The bool
  // stride selects vector (true) or scalar (false) broadcast at run time.
  using RowOfDScale = cutlass::epilogue::fusion::Sm90ColBroadcast<0, TileShape, float, float,
                                                                  Stride<bool, _0, _0>>;
  using ColOfDScale = cutlass::epilogue::fusion::Sm90RowBroadcast<0, TileShape, float, float,
                                                                  Stride<_0, bool, _0>>;
  using Bias = std::conditional_t<
      kSwapAB,
      cutlass::epilogue::fusion::Sm90ColBroadcast<0, TileShape, ElementD, float,
                                                  Stride<_1, _0, _0>>,
      cutlass::epilogue::fusion::Sm90RowBroadcast<0, TileShape, ElementD, float,
                                                  Stride<_0, _1, _0>>>;
  using Accum = cutlass::epilogue::fusion::Sm90AccFetch;
  using Multiply = cutlass::epilogue::fusion::Sm90Compute<cutlass::multiplies, float, float,
                                                          cutlass::FloatRoundStyle::round_to_nearest>;
  using MultiplyAdd =
      cutlass::epilogue::fusion::Sm90Compute<cutlass::multiply_add, ElementD, float,
                                             cutlass::FloatRoundStyle::round_to_nearest>;
  // D' = row_scale * (acc * col_scale) + bias
  using ScaledByCol = cutlass::epilogue::fusion::Sm90EVT<Multiply, ColOfDScale, Accum>;
  using Epilogue =
      cutlass::epilogue::fusion::Sm90EVT<MultiplyAdd, RowOfDScale, ScaledByCol, Bias>;

  using CollectiveEpilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
      cutlass::epilogue::collective::EpilogueTileAuto, ElementAcc, float, void, LayoutD,
      kAlignmentD, ElementD, LayoutD, kAlignmentD, EpilogueSchedule, Epilogue>::CollectiveOp;

  using CollectiveMainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, ElementAB, LayoutA, kAlignmentAB,
      ElementAB, LayoutB, kAlignmentAB, ElementAcc, TileShape, ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(
          sizeof(typename CollectiveEpilogue::SharedStorage))>,
      MainloopSchedule>::CollectiveOp;

  using Scheduler = std::conditional_t<Config::kStreamK, ResettingStreamKTag,
                                       cutlass::gemm::PersistentScheduler>;
  using GemmKernel =
      cutlass::gemm::kernel::GemmUniversal<Shape<int, int, int, int>, CollectiveMainloop,
                                           CollectiveEpilogue, Scheduler>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<GemmKernel>;
};

// Checks the CUTLASS arguments part by part (check_arguments) and launches; no workspace, no host
// sync. `what` names the GEMM in messages.
template <class Gemm>
int launch_gemm(typename Gemm::Arguments& args, cudaStream_t stream, bool pdl,
                const char* what) {
  const size_t workspace = Gemm::get_workspace_size(args);
  if (workspace != 0) {
    return set_error("%s: the CUTLASS kernel asks for a %zu-byte workspace, none is passed", what,
                     workspace);
  }
  const int checked = check_arguments<Gemm>(args, what);
  if (checked != cudaSuccess) return checked;
  Gemm gemm;
  const cutlass::Status init = gemm.initialize(args, nullptr, stream);
  if (init != cutlass::Status::kSuccess) {
    return set_error("%s: CUTLASS initialize failed (TMA descriptor setup): %s", what,
                     cutlass::cutlassGetStatusString(init));
  }
  return launch_status(gemm.run(stream, nullptr, pdl), what);
}

template <class ElementD, class Config>
int run_scaled_mm(const ScaledMmParams& p) {
  using Kernel = ScaledMmKernel<ElementD, Config>;
  using Gemm = typename Kernel::Gemm;
  using GemmKernel = typename Kernel::GemmKernel;
  using StrideA = typename GemmKernel::StrideA;
  using StrideB = typename GemmKernel::StrideB;
  using StrideD = typename GemmKernel::StrideD;

  const auto* a = static_cast<const ElementAB*>(p.a);
  const auto* b = static_cast<const ElementAB*>(p.b);
  const auto* bias = static_cast<const ElementD*>(p.bias);
  // In the kernel's frame: A' [M', K] and B' [N', K]; swapped, A' = b and B' = a.
  const int m_k = static_cast<int>(Config::kSwapAB ? p.n : p.m);
  const int n_k = static_cast<int>(Config::kSwapAB ? p.m : p.n);
  const ElementAB* a_k = Config::kSwapAB ? b : a;
  const ElementAB* b_k = Config::kSwapAB ? a : b;
  const int64_t lda_k = Config::kSwapAB ? p.ldb : p.lda;
  const int64_t ldb_k = Config::kSwapAB ? p.lda : p.ldb;
  const float* row_scale = Config::kSwapAB ? p.scale_b : p.scale_a;
  const float* col_scale = Config::kSwapAB ? p.scale_a : p.scale_b;
  const bool row_vector = Config::kSwapAB ? p.scale_b_per_col : p.scale_a_per_row;
  const bool col_vector = Config::kSwapAB ? p.scale_a_per_row : p.scale_b_per_col;

  StrideA stride_a = make_stride(lda_k, _1{}, int64_t(0));
  StrideB stride_b = make_stride(ldb_k, _1{}, int64_t(0));
  StrideD stride_d;
  if constexpr (Config::kSwapAB) {
    stride_d = make_stride(_1{}, p.n, int64_t(0));  // D' = D^T [N, M], column-major
  } else {
    stride_d = make_stride(p.n, _1{}, int64_t(0));
  }

  typename Kernel::Epilogue::Arguments epilogue_args{
      {row_scale, 0.0f, {row_vector, _0{}, _0{}}},                    // RowOfDScale
      {{col_scale, 0.0f, {_0{}, col_vector, _0{}}}, {}, {}},          // acc * ColOfDScale
      {bias, ElementD(0.0f), {}},                                     // bias (null: zero)
      {}};                                                            // multiply-add

  cutlass::KernelHardwareInfo hw_info;
  hw_info.device_id = p.device;
  hw_info.sm_count = p.sm_count;

  typename Gemm::Arguments args{cutlass::gemm::GemmUniversalMode::kGemm,
                                {m_k, n_k, static_cast<int>(p.k), 1},
                                {a_k, stride_a, b_k, stride_b},
                                {epilogue_args, nullptr, stride_d,
                                 static_cast<ElementD*>(p.out), stride_d},
                                hw_info};
  if constexpr (Config::kStreamK) {
    args.scheduler.decomposition_mode = GemmKernel::TileScheduler::DecompositionMode::StreamK;
    using ReductionMode = typename GemmKernel::TileScheduler::ReductionMode;
    args.scheduler.reduction_mode =
        Config::kOrdered ? ReductionMode::Deterministic : ReductionMode::Nondeterministic;
    if (p.workspace_query != nullptr) {
      size_t partials = 0;
      return stream_k_workspace<Gemm>(args, p.workspace_query, &partials,
                                      "v1e_scaled_mm_workspace_size");
    }
    return launch_stream_k<Gemm>(args, p.workspace, p.workspace_bytes, p.device, p.stream, p.pdl,
                                 "v1e_scaled_mm");
  } else {
    if (p.workspace_query != nullptr) {
      *p.workspace_query = 0;
      return cudaSuccess;
    }
    return launch_gemm<Gemm>(args, p.stream, p.pdl, "v1e_scaled_mm");
  }
}

// ---------------------------------------------------------------------------------------------
// Block-scaled GEMM: 1x128 activation groups, 128x128 weight blocks, scales applied to each K
// block's partial sum in fp32 inside the mainloop.
// ---------------------------------------------------------------------------------------------

constexpr int kScaleBlock = 128;

template <class ElementD, bool kSmallM>
struct BlockScaledMmKernel {
  using TileShape =
      std::conditional_t<kSmallM, Shape<_64, _128, _128>, Shape<_128, _128, _128>>;
  using ClusterShape = Shape<_1, _1, _1>;
  using MainloopSchedule =
      std::conditional_t<kSmallM, cutlass::gemm::KernelTmaWarpSpecializedPingpongFP8BlockScaledAccum,
                         cutlass::gemm::KernelTmaWarpSpecializedCooperativeFP8BlockScaledAccum>;
  using EpilogueSchedule = std::conditional_t<kSmallM, cutlass::epilogue::TmaWarpSpecialized,
                                              cutlass::epilogue::TmaWarpSpecializedCooperative>;
  // Activation scales M-major (the only SFA major sm90 takes), weight scales K-major, which is
  // the [N/128, K/128] row-major layout checkpoints store.
  using ScaleConfig = cutlass::detail::Sm90BlockwiseScaleConfig<1, kScaleBlock, kScaleBlock,
                                                                cute::GMMA::Major::MN,
                                                                cute::GMMA::Major::K>;
  using LayoutSFA = decltype(ScaleConfig::deduce_layoutSFA());
  using LayoutSFB = decltype(ScaleConfig::deduce_layoutSFB());
  using LayoutA = cutlass::layout::RowMajor;
  using LayoutB = cutlass::layout::ColumnMajor;
  using LayoutD = cutlass::layout::RowMajor;
  static constexpr int kAlignmentD = 128 / cutlass::sizeof_bits<ElementD>::value;

  using Fusion = cutlass::epilogue::fusion::LinearCombination<ElementD, float, void, float>;
  using CollectiveEpilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
      cutlass::epilogue::collective::EpilogueTileAuto, ElementAcc, float, void, LayoutD,
      kAlignmentD, ElementD, LayoutD, kAlignmentD, EpilogueSchedule, Fusion>::CollectiveOp;

  using CollectiveMainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, ElementAB,
      cute::tuple<LayoutA, LayoutSFA>, kAlignmentAB, ElementAB, cute::tuple<LayoutB, LayoutSFB>,
      kAlignmentAB, ElementAcc, TileShape, ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(
          sizeof(typename CollectiveEpilogue::SharedStorage))>,
      MainloopSchedule>::CollectiveOp;

  using GemmKernel =
      cutlass::gemm::kernel::GemmUniversal<Shape<int, int, int, int>, CollectiveMainloop,
                                           CollectiveEpilogue,
                                           cutlass::gemm::PersistentScheduler>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<GemmKernel>;
};

template <class ElementD, bool kSmallM>
int run_block_scaled_mm(const BlockScaledMmParams& p) {
  using Kernel = BlockScaledMmKernel<ElementD, kSmallM>;
  using Gemm = typename Kernel::Gemm;
  using GemmKernel = typename Kernel::GemmKernel;
  using StrideA = typename GemmKernel::StrideA;
  using StrideB = typename GemmKernel::StrideB;
  using StrideD = typename GemmKernel::StrideD;
  const int m = static_cast<int>(p.m), n = static_cast<int>(p.n), k = static_cast<int>(p.k);

  // The scale layouts CUTLASS derives assume dense scale tensors; SFA's K-block stride is
  // replaced by the caller's padded leading dimension. Scale A is loaded with TMA, and the
  // mainloop's can_implement demands that its M extent, not only its strides, be a multiple of
  // 4 floats (16 bytes): the layout spans M rounded up to 4, rows the caller's padding holds
  // (ld_scale_a >= that). Rows past M only scale accumulator rows the epilogue never stores.
  const int sfa_m = (m + 3) / 4 * 4;
  const int ld_sfa = static_cast<int>(p.ld_scale_a);
  if (ld_sfa < sfa_m) {
    return set_error("v1e_block_scaled_mm: ld_scale_a (%d) must be >= m rounded up to 4 (%d)",
                     ld_sfa, sfa_m);
  }
  const auto sfa_dense = Kernel::ScaleConfig::tile_atom_to_shape_SFA(make_shape(sfa_m, n, k, 1));
  const int k_blocks = k / kScaleBlock;
  typename Kernel::LayoutSFA layout_sfa = make_layout(
      shape(sfa_dense),
      make_stride(make_stride(_0{}, _1{}), make_stride(_0{}, ld_sfa), ld_sfa * k_blocks));
  const auto problem = make_shape(m, n, k, 1);
  typename Kernel::LayoutSFB layout_sfb = Kernel::ScaleConfig::tile_atom_to_shape_SFB(problem);

  StrideA stride_a = make_stride(p.lda, _1{}, int64_t(0));
  StrideB stride_b = make_stride(p.ldb, _1{}, int64_t(0));
  StrideD stride_d = make_stride(p.n, _1{}, int64_t(0));

  cutlass::KernelHardwareInfo hw_info;
  hw_info.device_id = p.device;
  hw_info.sm_count = p.sm_count;

  typename Gemm::Arguments args{
      cutlass::gemm::GemmUniversalMode::kGemm,
      {m, n, k, 1},
      {static_cast<const ElementAB*>(p.a), stride_a, static_cast<const ElementAB*>(p.b), stride_b,
       p.scale_a, layout_sfa, p.scale_b, layout_sfb},
      {{}, nullptr, stride_d, static_cast<ElementD*>(p.out), stride_d},
      hw_info};
  args.epilogue.thread.alpha = 1.0f;
  args.epilogue.thread.beta = 0.0f;
  return launch_gemm<Gemm>(args, p.stream, p.pdl, "v1e_block_scaled_mm");
}

}  // namespace sm90

template <int kDtype, int kConfig>
int scaled_mm_run(const ScaledMmParams& params) {
  return sm90::run_scaled_mm<sm90::OutputElement<kDtype>, sm90::ConfigById<kConfig>>(params);
}

template <int kDtype, int kConfig>
int block_scaled_mm_run(const BlockScaledMmParams& params) {
  return sm90::run_block_scaled_mm<sm90::OutputElement<kDtype>, kConfig == 0>(params);
}

}  // namespace v1e

#endif  // V1ENGINE_SCALED_MM_SM90_CUH_
