#include "engine/rules.h"

#include "common/check.h"
#include "engine/epilogue/dswiglu.h"
#include "engine/epilogue/store.h"
#include "engine/epilogue/swiglu.h"

namespace smoe {
namespace engine {
namespace {

constexpr int64_t kMaxRows = (int64_t{1} << 31) - 1;

Status rule(const char* fn, const char* name, int64_t v, const char* what) {
  return detail::make_status(StatusCode::kInvalidArgument, detail::concat(fn, ": ", name, " = ", v, " ", what));
}

// Extents are whole 64-element K-steps and 64-column pieces (BK = 64, the TMA boxes).
Status check_extent(const char* fn, const char* name, int v) {
  if (v <= 0 || v % 64 != 0) return rule(fn, name, v, "must be a positive multiple of 64");
  return Status{};
}

// Both groupings: E experts, two extents (varlen-M N, K; varlen-K M, N), grouped rows.
Status check_grouping(const char* fn, int E, const char* x, int vx, const char* y, int vy, int64_t rows) {
  if (E < 1 || E > kMaxExperts) return rule(fn, "num_experts", E, "must be in [1, 512]");
  SMOE_RETURN_IF_ERROR(check_extent(fn, x, vx));
  SMOE_RETURN_IF_ERROR(check_extent(fn, y, vy));
  if (rows < 0 || rows > kMaxRows) return rule(fn, "rows", rows, "must be in [0, 2^31)");
  return Status{};
}

// Gate/up as two tensors: the up-proj (SwiGLU, K-major) or dX~ (store, MN-major, K = 2n).
Status check_two_tensor_weights(const VarlenMArgs& a, const char* fn) {
  if (a.B2 == nullptr) {
    if (a.b_expert_stride != 0) return rule(fn, "b_expert_stride", a.b_expert_stride, "must be 0 without B2");
    return Status{};
  }
  const bool up = a.epilogue == Epilogue::kSwiGLU && a.b_major == WeightMajor::kNK;
  const bool dx = a.epilogue == Epilogue::kStore && a.b_major == WeightMajor::kKN;
  if (!up && !dx)
    return detail::make_status(StatusCode::kInvalidArgument,
                               detail::concat(fn, ": B2 (gate/up as two tensors) is for the SwiGLU up-proj "
                                                  "(K-major) and dX~ (store, MN-major) only"));
  if (dx && a.K % 128 != 0) return rule(fn, "K", a.K, "must be a multiple of 128 with B2 (K = 2n, n % 64 == 0)");
  // A stride below the packed rows would overlap two experts; the extent stays a TMA coordinate.
  const int64_t packed = (up ? a.N : a.K) / 2;
  if (a.b_expert_stride != 0 && a.b_expert_stride < packed)
    return rule(fn, "b_expert_stride", a.b_expert_stride, "must be 0 (packed) or >= the rows of one expert's half");
  if (a.b_expert_stride != 0 && int64_t{a.num_experts} * a.b_expert_stride > kMaxRows)
    return rule(fn, "num_experts * b_expert_stride", int64_t{a.num_experts} * a.b_expert_stride,
                "must be < 2^31 (TMA coordinates)");
  return detail::check_ptr(a.B2, fn, "B2", 16);
}

}  // namespace

Status check_varlen_m(const VarlenMArgs& a) {
  const char* fn = "engine::varlen_m";
  SMOE_RETURN_IF_ERROR(check_grouping(fn, a.num_experts, "N", a.N, "K", a.K, a.rows));
  if (a.a_rows < 0 || a.a_rows > kMaxRows) return rule(fn, "a_rows", a.a_rows, "must be in [0, 2^31)");
  const int64_t weight_rows = int64_t{a.num_experts} * (a.b_major == WeightMajor::kNK ? a.N : a.K);
  if (weight_rows > kMaxRows)
    return rule(fn, "num_experts * weight rows", weight_rows, "must be < 2^31 (TMA coordinates)");
  if (a.epilogue == Epilogue::kSwiGLU) SMOE_RETURN_IF_ERROR(check_swiglu_shape(a, fn));
  SMOE_RETURN_IF_ERROR(check_two_tensor_weights(a, fn));
  if (a.epilogue == Epilogue::kStore) SMOE_RETURN_IF_ERROR(check_store_shape(a, fn));
  // The instantiations: SwiGLU / dSwiGLU gather A (by cp.async), the plain store loads it by TMA.
  const bool gathered_epilogue = a.epilogue != Epilogue::kStore;
  if (gathered_epilogue != (a.gather_idx != nullptr))
    return detail::make_status(
        StatusCode::kInvalidArgument,
        detail::concat(fn, ": gather_idx must be ", gathered_epilogue ? "non-null" : "null",
                       " with the ", gathered_epilogue ? "SwiGLU / dSwiGLU" : "store",
                       " epilogue (gathered A is fused only into those)"));
  if (a.rows == 0) return Status{};  // nothing runs: the pointers are not read
  if (a.gather_idx == nullptr && a.a_rows < a.rows)
    return rule(fn, "a_rows", a.a_rows, "must be >= rows when A is not gathered");
  if (a.gather_idx != nullptr && a.a_rows < 1) return rule(fn, "a_rows", a.a_rows, "must be >= 1 when A is gathered");
  SMOE_RETURN_IF_ERROR(detail::check_ptr(a.expert_offset, fn, "expert_offset", 4));
  SMOE_RETURN_IF_ERROR(detail::check_ptr(a.A, fn, "A", 16));
  SMOE_RETURN_IF_ERROR(detail::check_ptr(a.B, fn, "B", 16));
  if (gathered_epilogue) SMOE_RETURN_IF_ERROR(detail::check_ptr(a.gather_idx, fn, "gather_idx", 4));
  switch (a.epilogue) {
    case Epilogue::kStore: return check_store_pointers(a, fn);
    case Epilogue::kSwiGLU: return check_swiglu_pointers(a, fn);
    case Epilogue::kDSwiGLU: return check_dswiglu_pointers(a, fn);
  }
  return Status{};
}

Status check_varlen_k(const VarlenKArgs& a) {
  const char* fn = "engine::varlen_k";
  SMOE_RETURN_IF_ERROR(check_grouping(fn, a.num_experts, "M", a.M, "N", a.N, a.rows));
  if (a.ld_p < a.M || a.ld_p % 8 != 0) return rule(fn, "ld_p", a.ld_p, "must be >= M and a multiple of 8");
  if (a.ld_q < a.N || a.ld_q % 8 != 0) return rule(fn, "ld_q", a.ld_q, "must be >= N and a multiple of 8");
  if (a.gather_p != nullptr && a.gather_q != nullptr)
    return detail::make_status(StatusCode::kInvalidArgument,
                               "engine::varlen_k: at most one of gather_p / gather_q may be non-null "
                               "(one operand gathered by cp.async, or neither: both contiguous by TMA)");
  SMOE_RETURN_IF_ERROR(detail::check_ptr(a.expert_offset, fn, "expert_offset", 4));
  SMOE_RETURN_IF_ERROR(detail::check_ptr(a.P, fn, "P", 16));
  SMOE_RETURN_IF_ERROR(detail::check_ptr(a.Q, fn, "Q", 16));
  SMOE_RETURN_IF_ERROR(detail::check_ptr(a.D, fn, "D", 16));
  if (a.gather_rows < 0 || a.gather_rows > kMaxRows)
    return rule(fn, "gather_rows", a.gather_rows, "must be in [0, 2^31)");
  if (a.gather_p) SMOE_RETURN_IF_ERROR(detail::check_ptr(a.gather_p, fn, "gather_p", 4));
  if (a.gather_q) SMOE_RETURN_IF_ERROR(detail::check_ptr(a.gather_q, fn, "gather_q", 4));
  return Status{};
}

}  // namespace engine
}  // namespace smoe
