// Shared-memory probe for CUTLASS 3.x/4.x GEMM kernels (servescope, docs/cutlass-probe/).
//
// For one (architecture, operand formats, output, tile, dense/grouped, schedule) combination this builds the
// CollectiveEpilogue and CollectiveMainloop exactly as CUTLASS's own examples do (79a/79b/79d for SM120, 72/75 for
// SM100, 48/49/57 for SM90), with StageCountAutoCarveout<sizeof(CollectiveEpilogue::SharedStorage)>, wraps them in
// GemmUniversal, and prints one JSON line with the stage count the builder chose and the sizeof() of every part of
// the kernel's SharedStorage. Only host code reads these constexpr/sizeof values, so no GPU is needed: the file is
// still compiled for the real target (-arch=sm_120a / sm_100a / sm_90a) so every arch-guarded static_assert fires.
//
// run_probe.py generates one translation unit per group of combinations that includes this header and calls
// PROBE(...) for each; a combination that trips a static_assert is then compiled alone and recorded with the
// compiler's reason.
#pragma once

#include <cstdio>
#include <type_traits>

#include "cutlass/cutlass.h"
#include "cutlass/version.h"
#include "cutlass/arch/arch.h"
#include "cute/tensor.hpp"
#include "cutlass/numeric_types.h"
#include "cutlass/gemm/dispatch_policy.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/epilogue/fusion/operations.hpp"
#include "cutlass/gemm/kernel/gemm_universal.hpp"
#include "cutlass/gemm/group_array_problem_shape.hpp"
#include "cutlass/detail/sm100_blockscaled_layout.hpp"
#include "cutlass/device_kernel.h"

namespace probe {

using namespace cute;

// ---- operand formats -------------------------------------------------------------------------------------------
struct nvfp4 { using type = cutlass::nv_float4_t<cutlass::float_e2m1_t>; static constexpr char const* name = "nvfp4"; };
struct mxfp4 { using type = cutlass::mx_float4_t<cutlass::float_e2m1_t>; static constexpr char const* name = "mxfp4"; };
struct mxfp6 { using type = cutlass::mx_float6_t<cutlass::float_e3m2_t>; static constexpr char const* name = "mxfp6"; };
struct mxfp8 { using type = cutlass::mx_float8_t<cutlass::float_e4m3_t>; static constexpr char const* name = "mxfp8"; };
struct bf16  { using type = cutlass::bfloat16_t;    static constexpr char const* name = "bf16"; };
struct fp16  { using type = cutlass::half_t;        static constexpr char const* name = "fp16"; };
struct fp8   { using type = cutlass::float_e4m3_t;  static constexpr char const* name = "fp8"; };
struct fp32  { using type = float;                  static constexpr char const* name = "fp32"; };

// Alignment in elements for a 16-byte TMA access (CUTLASS examples use 32 for 4-bit block-scaled operands, and
// 128 elements for FP6 which TMA moves in 96-byte units: examples/79c).
template <class Fmt> constexpr int operand_alignment() {
  if constexpr (std::is_same_v<Fmt, mxfp6>) { return 128; }
  else if constexpr (std::is_same_v<Fmt, nvfp4> || std::is_same_v<Fmt, mxfp4>) { return 32; }
  else if constexpr (std::is_same_v<Fmt, mxfp8>) { return 16; }
  else { return 128 / cutlass::sizeof_bits<typename Fmt::type>::value; }
}

// ---- epilogues --------------------------------------------------------------------------------------------------
// D = alpha * acc + beta * C, with ElementC = D (WithSource) or void (no C read), or NVFP4 D with a generated
// UE4M3 scale factor per 16 outputs (LinCombBlockScaleFactor, examples/79b and 79d).
template <class Out, bool WithSource> struct LinComb {
  using ElementD = typename Out::type;
  using ElementC = std::conditional_t<WithSource, ElementD, void>;
  using Fusion = cutlass::epilogue::fusion::LinearCombination<ElementD, float, ElementC, float>;
  static constexpr char const* out = Out::name;
  static constexpr bool source = WithSource;
  static constexpr int align_d = 128 / cutlass::sizeof_bits<ElementD>::value;
  static constexpr int align_c = align_d;
};
template <bool WithSource> struct Nvfp4Out {
  using ElementD = cutlass::float_e2m1_t;
  using ElementC = std::conditional_t<WithSource, cutlass::bfloat16_t, void>;
  using Fusion = cutlass::epilogue::fusion::LinCombBlockScaleFactor<
      16, ElementD, float, cutlass::float_ue4m3_t, cutlass::layout::RowMajor, ElementC>;
  static constexpr char const* out = "nvfp4";
  static constexpr bool source = WithSource;
  static constexpr int align_d = 32;
  static constexpr int align_c = WithSource ? 8 : 32;
};

// ---- printing helpers -------------------------------------------------------------------------------------------
template <class T> constexpr long sz() { return static_cast<long>(sizeof(T)); }

#define PROBE_MEMBER_SIZE(Type, member) static_cast<long>(sizeof(decltype(std::declval<Type&>().member)))

template <class Kernel>
void print_kernel_parts() {
#if defined(PROBE_FULL_BUILD)
  // Full build: reference the __global__ kernel so nvcc compiles its body for the target, as a real user build does.
  // This fires the static_asserts inside the kernel (e.g. "Cooperative kernel requires Tile Size to be greater than or
  // equal to 128 along the M-dimension.") that host-only instantiation never reaches. About a minute per kernel.
  std::printf(", \"full_build\": %s", (void*)&cutlass::device_kernel<Kernel> != nullptr ? "true" : "false");
#endif
  using SS = typename Kernel::SharedStorage;
  std::printf(", \"kernel_smem_bytes\": %d", Kernel::SharedStorageSize);
  // Completing Params instantiates the TMA copy types (make_tma_copy for A, B, SFA, SFB, C, D), whose static_asserts
  // reject tiles a real build rejects even though their SharedStorage is well-formed.
  std::printf(", \"kernel_params_bytes\": %ld", sz<typename Kernel::Params>());
  std::printf(", \"kernel_tensors_bytes\": %ld", PROBE_MEMBER_SIZE(SS, tensors));
  std::printf(", \"kernel_pipelines_bytes\": %ld", PROBE_MEMBER_SIZE(SS, pipelines));
  if constexpr (requires(SS& s) { s.tensormaps; }) {
    std::printf(", \"kernel_tensormaps_bytes\": %ld", PROBE_MEMBER_SIZE(SS, tensormaps));
  }
  if constexpr (requires(SS& s) { s.scheduler; }) {
    std::printf(", \"kernel_scheduler_bytes\": %ld", PROBE_MEMBER_SIZE(SS, scheduler));
  }
  if constexpr (requires(SS& s) { s.scheduler_response; }) {
    std::printf(", \"kernel_scheduler_response_bytes\": %ld", PROBE_MEMBER_SIZE(SS, scheduler_response));
  }
  if constexpr (requires(SS& s) { s.clc_response; }) {
    std::printf(", \"kernel_clc_response_bytes\": %ld", PROBE_MEMBER_SIZE(SS, clc_response));
  }
  using PS = typename SS::PipelineStorage;
  std::printf(", \"kernel_pipeline_mainloop_bytes\": %ld", PROBE_MEMBER_SIZE(PS, mainloop));
  std::printf(", \"kernel_pipeline_epi_load_bytes\": %ld", PROBE_MEMBER_SIZE(PS, epi_load));
}

template <class Mainloop>
void print_mainloop_parts() {
  using TS = typename Mainloop::TensorStorage;
  std::printf(", \"stages\": %d", Mainloop::DispatchPolicy::Stages);
  std::printf(", \"mainloop_smem_bytes\": %ld", sz<typename Mainloop::SharedStorage>());
  std::printf(", \"mainloop_tensor_bytes\": %ld", sz<TS>());
  std::printf(", \"mainloop_pipeline_bytes\": %ld", sz<typename Mainloop::PipelineStorage>());
  std::printf(", \"smem_a_bytes\": %ld, \"smem_b_bytes\": %ld", PROBE_MEMBER_SIZE(TS, smem_A),
              PROBE_MEMBER_SIZE(TS, smem_B));
  if constexpr (requires(TS& t) { t.smem_SFA; }) {
    std::printf(", \"smem_sfa_bytes\": %ld, \"smem_sfb_bytes\": %ld", PROBE_MEMBER_SIZE(TS, smem_SFA),
                PROBE_MEMBER_SIZE(TS, smem_SFB));
  }
  if constexpr (requires { typename Mainloop::TensorMapStorage; }) {
    std::printf(", \"mainloop_tensormap_bytes\": %ld", sz<typename Mainloop::TensorMapStorage>());
  }
}

template <class Epilogue>
void print_epilogue_parts() {
  std::printf(", \"epilogue_smem_bytes\": %ld", sz<typename Epilogue::SharedStorage>());
  std::printf(", \"epilogue_tensor_bytes\": %ld", sz<typename Epilogue::TensorStorage>());
  std::printf(", \"epilogue_pipeline_bytes\": %ld", sz<typename Epilogue::PipelineStorage>());
  using ETS = typename Epilogue::TensorStorage;
  if constexpr (requires(ETS& t) { t.collective; t.thread; }) {
    std::printf(", \"epilogue_collective_bytes\": %ld, \"epilogue_fusion_bytes\": %ld",
                PROBE_MEMBER_SIZE(ETS, collective), PROBE_MEMBER_SIZE(ETS, thread));
  }
  if constexpr (requires { typename Epilogue::TensorMapStorage; }) {
    std::printf(", \"epilogue_tensormap_bytes\": %ld", sz<typename Epilogue::TensorMapStorage>());
  }
}

inline void print_head(char const* id, char const* arch, char const* a, char const* b, char const* out, bool source,
                       char const* kernel, char const* schedule, int m, int n, int k, int capacity) {
  std::printf("{\"id\": \"%s\", \"arch\": \"%s\", \"a\": \"%s\", \"b\": \"%s\", \"out\": \"%s\", \"source\": %s, "
              "\"kernel\": \"%s\", \"schedule\": \"%s\", \"tile\": [%d, %d, %d], \"capacity_bytes\": %d",
              id, arch, a, b, out, source ? "true" : "false", kernel, schedule, m, n, k, capacity);
}

// ---- SM120 / SM121 block-scaled (GeForce / RTX PRO Blackwell) ---------------------------------------------------
template <class A, class B, class Epi, int M, int N, int K, bool Grouped, bool Pingpong>
void sm120(char const* id) {
  using Tile = Shape<Int<M>, Int<N>, Int<K>>;
  using Cluster = Shape<_1, _1, _1>;
  using LayoutC = std::conditional_t<Grouped, cutlass::layout::RowMajor*, cutlass::layout::RowMajor>;
  using LayoutA = std::conditional_t<Grouped, cutlass::layout::RowMajor*, cutlass::layout::RowMajor>;
  using LayoutB = std::conditional_t<Grouped, cutlass::layout::ColumnMajor*, cutlass::layout::ColumnMajor>;
  using EpiSchedule = cutlass::epilogue::collective::EpilogueScheduleAuto;
  // Cooperative = KernelScheduleAuto, as examples 79a/79d do (the builder makes it cooperative, dense or ptr-array
  // from the layout tags); ping-pong needs the explicit tag.
  using Schedule = std::conditional_t<Pingpong,
      std::conditional_t<Grouped, cutlass::gemm::KernelPtrArrayTmaWarpSpecializedPingpong,
                                  cutlass::gemm::KernelTmaWarpSpecializedPingpong>,
      cutlass::gemm::collective::KernelScheduleAuto>;
  using CollectiveEpilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm120, cutlass::arch::OpClassBlockScaledTensorOp, Tile, Cluster,
      cutlass::epilogue::collective::EpilogueTileAuto, float, float,
      typename Epi::ElementC, LayoutC, Epi::align_c, typename Epi::ElementD, LayoutC, Epi::align_d,
      EpiSchedule, typename Epi::Fusion>::CollectiveOp;
  using CollectiveMainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm120, cutlass::arch::OpClassBlockScaledTensorOp,
      typename A::type, LayoutA, operand_alignment<A>(), typename B::type, LayoutB, operand_alignment<B>(), float,
      Tile, Cluster,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(sizeof(typename CollectiveEpilogue::SharedStorage))>,
      Schedule>::CollectiveOp;
  using ProblemShape = std::conditional_t<Grouped, cutlass::gemm::GroupProblemShape<Shape<int, int, int>>,
                                          Shape<int, int, int, int>>;
  using Kernel = cutlass::gemm::kernel::GemmUniversal<ProblemShape, CollectiveMainloop, CollectiveEpilogue, void>;
  print_head(id, "sm120", A::name, B::name, Epi::out, Epi::source, Grouped ? "grouped" : "dense",
             Pingpong ? "pingpong" : "cooperative", M, N, K, cutlass::arch::sm120_smem_capacity_bytes);
  print_mainloop_parts<CollectiveMainloop>();
  print_epilogue_parts<CollectiveEpilogue>();
  print_kernel_parts<Kernel>();
  std::printf("}\n");
}

// ---- SM100 block-scaled (B200 / GB200) --------------------------------------------------------------------------
template <class A, class B, class Epi, int M, int N, int K, bool Grouped, bool TwoSm>
void sm100(char const* id) {
  using Tile = Shape<Int<M>, Int<N>, Int<K>>;
  using Cluster = std::conditional_t<TwoSm, Shape<_2, _1, _1>, Shape<_1, _1, _1>>;
  using LayoutC = std::conditional_t<Grouped, cutlass::layout::RowMajor*, cutlass::layout::RowMajor>;
  using LayoutA = std::conditional_t<Grouped, cutlass::layout::RowMajor*, cutlass::layout::RowMajor>;
  using LayoutB = std::conditional_t<Grouped, cutlass::layout::ColumnMajor*, cutlass::layout::ColumnMajor>;
  using Schedule = std::conditional_t<Grouped,
      std::conditional_t<TwoSm, cutlass::gemm::KernelPtrArrayTmaWarpSpecialized2SmBlockScaledSm100,
                                cutlass::gemm::KernelPtrArrayTmaWarpSpecialized1SmBlockScaledSm100>,
      std::conditional_t<TwoSm, cutlass::gemm::KernelTmaWarpSpecialized2SmBlockScaledSm100,
                                cutlass::gemm::KernelTmaWarpSpecialized1SmBlockScaledSm100>>;
  using EpiSchedule = std::conditional_t<Grouped,
      std::conditional_t<TwoSm, cutlass::epilogue::PtrArrayTmaWarpSpecialized2Sm,
                                cutlass::epilogue::PtrArrayTmaWarpSpecialized1Sm>,
      std::conditional_t<TwoSm, cutlass::epilogue::TmaWarpSpecialized2Sm, cutlass::epilogue::TmaWarpSpecialized1Sm>>;
  using CollectiveEpilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm100, cutlass::arch::OpClassBlockScaledTensorOp, Tile, Cluster,  // as examples 72a/75 do
      cutlass::epilogue::collective::EpilogueTileAuto, float, float,
      typename Epi::ElementC, LayoutC, Epi::align_c, typename Epi::ElementD, LayoutC, Epi::align_d,
      EpiSchedule, typename Epi::Fusion>::CollectiveOp;
  using CollectiveMainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm100, cutlass::arch::OpClassBlockScaledTensorOp,
      typename A::type, LayoutA, operand_alignment<A>(), typename B::type, LayoutB, operand_alignment<B>(), float,
      Tile, Cluster,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(sizeof(typename CollectiveEpilogue::SharedStorage))>,
      Schedule>::CollectiveOp;
  using ProblemShape = std::conditional_t<Grouped, cutlass::gemm::GroupProblemShape<Shape<int, int, int>>,
                                          Shape<int, int, int, int>>;
  using Kernel = cutlass::gemm::kernel::GemmUniversal<ProblemShape, CollectiveMainloop, CollectiveEpilogue, void>;
  print_head(id, "sm100", A::name, B::name, Epi::out, Epi::source, Grouped ? "grouped" : "dense",
             TwoSm ? "2sm" : "1sm", M, N, K, cutlass::arch::sm100_smem_capacity_bytes);
  print_mainloop_parts<CollectiveMainloop>();
  print_epilogue_parts<CollectiveEpilogue>();
  print_kernel_parts<Kernel>();
  std::printf("}\n");
}

// ---- SM90 plain BF16 / FP8 (H100 / H200) ------------------------------------------------------------------------
template <class A, class B, class Epi, int M, int N, int K, bool Grouped, bool Pingpong>
void sm90(char const* id) {
  using Tile = Shape<Int<M>, Int<N>, Int<K>>;
  using Cluster = Shape<_1, _1, _1>;
  using LayoutC = std::conditional_t<Grouped, cutlass::layout::RowMajor*, cutlass::layout::RowMajor>;
  using LayoutA = std::conditional_t<Grouped, cutlass::layout::RowMajor*, cutlass::layout::RowMajor>;
  using LayoutB = std::conditional_t<Grouped, cutlass::layout::ColumnMajor*, cutlass::layout::ColumnMajor>;
  using Schedule = std::conditional_t<Grouped,
      std::conditional_t<Pingpong, cutlass::gemm::KernelPtrArrayTmaWarpSpecializedPingpong,
                                   cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperative>,
      std::conditional_t<Pingpong, cutlass::gemm::KernelTmaWarpSpecializedPingpong,
                                   cutlass::gemm::KernelTmaWarpSpecializedCooperative>>;
  using EpiSchedule = std::conditional_t<Grouped,
      std::conditional_t<Pingpong, cutlass::epilogue::PtrArrayTmaWarpSpecializedPingpong,
                                   cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative>,
      std::conditional_t<Pingpong, cutlass::epilogue::TmaWarpSpecialized,
                                   cutlass::epilogue::TmaWarpSpecializedCooperative>>;
  using CollectiveEpilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Tile, Cluster,
      cutlass::epilogue::collective::EpilogueTileAuto, float, float,
      typename Epi::ElementC, LayoutC, Epi::align_c, typename Epi::ElementD, LayoutC, Epi::align_d,
      EpiSchedule, typename Epi::Fusion>::CollectiveOp;
  using CollectiveMainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp,
      typename A::type, LayoutA, operand_alignment<A>(), typename B::type, LayoutB, operand_alignment<B>(), float,
      Tile, Cluster,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(sizeof(typename CollectiveEpilogue::SharedStorage))>,
      Schedule>::CollectiveOp;
  using ProblemShape = std::conditional_t<Grouped, cutlass::gemm::GroupProblemShape<Shape<int, int, int>>,
                                          Shape<int, int, int, int>>;
  using Kernel = cutlass::gemm::kernel::GemmUniversal<ProblemShape, CollectiveMainloop, CollectiveEpilogue, void>;
  print_head(id, "sm90", A::name, B::name, Epi::out, Epi::source, Grouped ? "grouped" : "dense",
             Pingpong ? "pingpong" : "cooperative", M, N, K, cutlass::gemm::collective::detail::sm90_smem_capacity_bytes);
  print_mainloop_parts<CollectiveMainloop>();
  print_epilogue_parts<CollectiveEpilogue>();
  print_kernel_parts<Kernel>();
  std::printf("}\n");
}

}  // namespace probe
