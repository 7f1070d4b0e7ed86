// The one CUTLASS ptr-array grouped GEMM template behind every instantiation (.cu per config).
// Included only by src/gemm/grouped_gemm_tt.cu: CUTLASS headers stay out of the rest.
#pragma once

#include <cstdint>

#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/epilogue/fusion/operations.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/dispatch_policy.hpp"
#include "cutlass/gemm/group_array_problem_shape.hpp"
#include "cutlass/gemm/kernel/gemm_universal.hpp"

#include "common/check.h"
#include "gemm/grouped_gemm.h"

namespace smoe {
namespace gemm {
namespace impl {

using namespace cute;

// LayoutA / LayoutB in CUTLASS's (M,K) x (K,N) convention; D is always row-major bf16, no C.
template <class LayoutA, class LayoutB, class TileShape, class ClusterShape>
struct GroupedGemm {
  using Element = cutlass::bfloat16_t;
  using LayoutD = cutlass::layout::RowMajor;
  using ProblemShape = cutlass::gemm::GroupProblemShape<Shape<int, int, int>>;
  using UnderlyingShape = typename ProblemShape::UnderlyingProblemShape;
  static constexpr int kAlign = 8;  // 16-byte rows for TMA

  using CollectiveEpilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
      cutlass::epilogue::collective::EpilogueTileAuto, float, float, void, LayoutD*, kAlign,
      Element, LayoutD*, kAlign, cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative,
      cutlass::epilogue::fusion::LinearCombination<Element, float, void, float>>::CollectiveOp;

  using CollectiveMainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Element, LayoutA*, kAlign, Element,
      LayoutB*, kAlign, float, TileShape, ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(
          sizeof(typename CollectiveEpilogue::SharedStorage))>,
      cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperative>::CollectiveOp;

  using Kernel = cutlass::gemm::kernel::GemmUniversal<ProblemShape, CollectiveMainloop,
                                                      CollectiveEpilogue>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
  using StrideA = typename Kernel::InternalStrideA;
  using StrideB = typename Kernel::InternalStrideB;
  using StrideD = typename Kernel::InternalStrideD;

  // Device arrays of one call, carved from the front of the workspace.
  struct Arrays {
    UnderlyingShape* shapes;
    const Element** a;
    const Element** b;
    Element** d;
    StrideA* sa;
    StrideB* sb;
    StrideD* sd;
    char* cutlass_ws;
  };

  static size_t align(size_t x) { return ::smoe::detail::align_workspace(x); }

  static size_t arrays_bytes(int groups) {
    return align(sizeof(UnderlyingShape) * groups) + 3 * align(sizeof(void*) * groups) +
           align(sizeof(StrideA) * groups) + align(sizeof(StrideB) * groups) +
           align(sizeof(StrideD) * groups);
  }

  static Arrays carve(void* ws, int groups) {
    char* p = static_cast<char*>(ws);
    Arrays r;
    r.shapes = reinterpret_cast<UnderlyingShape*>(p);
    p += align(sizeof(UnderlyingShape) * groups);
    r.a = reinterpret_cast<const Element**>(p);
    p += align(sizeof(void*) * groups);
    r.b = reinterpret_cast<const Element**>(p);
    p += align(sizeof(void*) * groups);
    r.d = reinterpret_cast<Element**>(p);
    p += align(sizeof(void*) * groups);
    r.sa = reinterpret_cast<StrideA*>(p);
    p += align(sizeof(StrideA) * groups);
    r.sb = reinterpret_cast<StrideB*>(p);
    p += align(sizeof(StrideB) * groups);
    r.sd = reinterpret_cast<StrideD*>(p);
    p += align(sizeof(StrideD) * groups);
    r.cutlass_ws = p;
    return r;
  }

  static typename Gemm::Arguments arguments(const Arrays& r, int groups, int sm_count) {
    cutlass::KernelHardwareInfo hw;
    hw.device_id = 0;
    hw.sm_count = sm_count;
    typename Gemm::Arguments args;
    args.mode = cutlass::gemm::GemmUniversalMode::kGrouped;
    args.problem_shape = {groups, r.shapes, nullptr};  // device shapes only: no host sync
    args.mainloop = {r.a, r.sa, r.b, r.sb};
    auto& fusion = args.epilogue.thread;
    fusion.alpha = 1.0f;
    fusion.beta = 0.0f;
    fusion.alpha_ptr = nullptr;
    fusion.beta_ptr = nullptr;
    fusion.alpha_ptr_array = nullptr;
    fusion.beta_ptr_array = nullptr;
    fusion.dAlpha = {_0{}, _0{}, 0};
    fusion.dBeta = {_0{}, _0{}, 0};
    args.epilogue.ptr_C = nullptr;
    args.epilogue.dC = nullptr;
    args.epilogue.ptr_D = r.d;
    args.epilogue.dD = r.sd;
    args.hw_info = hw;
    return args;
  }

  static size_t workspace_size(int groups, int sm_count) {
    Arrays r = carve(nullptr, groups);
    return arrays_bytes(groups) + align(Gemm::get_workspace_size(arguments(r, groups, sm_count)));
  }

  // Launch after the setup kernel filled the arrays.
  static Status run(void* ws, size_t ws_bytes, int groups, int sm_count, cudaStream_t stream) {
    const size_t need = workspace_size(groups, sm_count);
    if (ws_bytes < need)
      return ::smoe::detail::make_status(StatusCode::kWorkspaceTooSmall,
                                 ::smoe::detail::concat("grouped GEMM: workspace_bytes = ", ws_bytes,
                                                " < required ", need));
    Arrays r = carve(ws, groups);
    typename Gemm::Arguments args = arguments(r, groups, sm_count);
    Gemm gemm;
    cutlass::Status s = gemm.can_implement(args);
    if (s != cutlass::Status::kSuccess)
      return ::smoe::detail::make_status(StatusCode::kInvalidArgument,
                                 ::smoe::detail::concat("grouped GEMM: CUTLASS can_implement failed: ",
                                                cutlassGetStatusString(s)));
    s = gemm.initialize(args, r.cutlass_ws, stream);
    if (s != cutlass::Status::kSuccess)
      return ::smoe::detail::make_status(StatusCode::kCudaError,
                                 ::smoe::detail::concat("grouped GEMM: initialize failed: ",
                                                cutlassGetStatusString(s)));
    s = gemm.run(stream);
    if (s != cutlass::Status::kSuccess)
      return ::smoe::detail::make_status(StatusCode::kCudaError,
                                 ::smoe::detail::concat("grouped GEMM: run failed: ",
                                                cutlassGetStatusString(s)));
    SMOE_CHECK_LAUNCH("grouped GEMM");
    return Status{};
  }
};

// Stride values: leading dimensions of packed row/column-major operands. The static unit-stride
// mode is skipped; the batch mode is 0.
template <class Stride>
__device__ __forceinline__ Stride packed_ld(int64_t ld) {
  Stride s{};
  if constexpr (cute::is_static_v<cute::remove_cvref_t<decltype(cute::get<0>(s))>>) {
    cute::get<1>(s) = ld;
  } else {
    cute::get<0>(s) = ld;
  }
  return s;
}

// varlen-K setup: one thread per expert. A = P^T (column-major, ld ld_p), B = Q (row-major, ld N).
template <class G>
__global__ void setup_varlen_k(int E, int M, int N, int64_t ld_p, const int32_t* __restrict__ off,
                               const bf16* P, const bf16* Q, bf16* D, typename G::Arrays r) {
  const int e = blockIdx.x * blockDim.x + threadIdx.x;
  if (e >= E) return;
  using El = typename G::Element;
  const int64_t o = off[e];
  const int k = off[e + 1] - off[e];
  r.shapes[e] = k > 0 ? make_shape(M, N, k) : make_shape(0, 0, 0);
  r.a[e] = reinterpret_cast<const El*>(P) + o * ld_p;
  r.b[e] = reinterpret_cast<const El*>(Q) + o * N;
  r.d[e] = reinterpret_cast<El*>(D) + static_cast<int64_t>(e) * M * N;
  r.sa[e] = packed_ld<typename G::StrideA>(ld_p);
  r.sb[e] = packed_ld<typename G::StrideB>(N);
  r.sd[e] = packed_ld<typename G::StrideD>(N);
}

// Zero D_e of experts without rows (their grouped problem is empty, so nothing else writes it).
__global__ void zero_empty_experts(int E, int64_t per_expert, const int32_t* __restrict__ off,
                                   bf16* D);

template <class G>
Status run_varlen_k(const VarlenKArgs& a, void* ws, size_t ws_bytes, int sm_count,
                    cudaStream_t stream) {
  typename G::Arrays r = G::carve(ws, a.num_experts);
  setup_varlen_k<G><<<(a.num_experts + 127) / 128, 128, 0, stream>>>(
      a.num_experts, a.M, a.N, a.ld_p > 0 ? a.ld_p : a.M, a.expert_offset, a.P, a.Q, a.D, r);
  SMOE_CHECK_LAUNCH("setup_varlen_k");
  SMOE_RETURN_IF_ERROR(G::run(ws, ws_bytes, a.num_experts, sm_count, stream));
  const int64_t per = static_cast<int64_t>(a.M) * a.N;
  dim3 grid(static_cast<unsigned>((per / 8 + 255) / 256 < 1024 ? (per / 8 + 255) / 256 : 1024),
            static_cast<unsigned>(a.num_experts));
  zero_empty_experts<<<grid, 256, 0, stream>>>(a.num_experts, per, a.expert_offset, a.D);
  SMOE_CHECK_LAUNCH("zero_empty_experts");
  return Status{};
}

}  // namespace impl
}  // namespace gemm
}  // namespace smoe
