// The layer's shape rules and size queries (memory_plan.h has the layouts), and the profile hook.
#include "common/check.h"
#include "engine/engine.h"
#include "moe/cublas_handles.h"
#include "moe/layer_common.h"
#include "moe/memory_plan.h"
#include "moe/profile.h"
#include "smoe/smoe.h"

namespace smoe {

namespace profile {
namespace {
Recorder* g_recorder = nullptr;
}
void set_recorder(Recorder* r) { g_recorder = r; }
Recorder* recorder() { return g_recorder; }
}  // namespace profile

Status moe_can_implement(const MoEShape& s) {
  using detail::concat;
  using detail::make_status;
  const char* fn = "moe";
  RoutingProblem rp{s.T, s.E, s.K, DType::kFloat32};
  SMOE_RETURN_IF_ERROR(routing_can_implement(rp));
  if (s.router != MoERouter::kTopKSoftmax && s.router != MoERouter::kTokenRounding &&
      s.router != MoERouter::kProvided)
    return make_status(StatusCode::kInvalidArgument,
                       concat(fn, ": router = ", static_cast<int>(s.router),
                              " must be kTopKSoftmax, kTokenRounding or kProvided"));
  int64_t rows = s.T * s.K;
  if (s.router == MoERouter::kTokenRounding) {
    SMOE_RETURN_IF_ERROR(token_rounding_can_implement(plan::rounding_problem(s, 0)));
    rows = token_rounding_capacity(plan::rounding_problem(s, 0));
  }
  // 64: the GEMM K-tile and 16-byte rows for TMA; SwiGLU pairs need n even anyway.
  if (s.d <= 0 || s.d % 64 != 0)
    return make_status(StatusCode::kInvalidArgument, concat(fn, ": d = ", s.d, " must be a positive multiple of 64"));
  if (s.n <= 0 || s.n % 64 != 0)
    return make_status(StatusCode::kInvalidArgument, concat(fn, ": n = ", s.n, " must be a positive multiple of 64"));
  // Every buffer the size queries add up must be far from overflowing: each product below 2^56
  // bytes (64 PiB), so a sum of a few dozen never wraps.
  constexpr int64_t kMaxBytes = int64_t{1} << 56;
  int64_t bytes = 0;
  // rows <= 2^31-1: T*K by routing_can_implement, the rounding capacity by token_rounding_can_implement.
  const int64_t wide = 2 * static_cast<int64_t>(s.n) > s.d ? 2 * static_cast<int64_t>(s.n) : s.d;
  if (!detail::checked_product({rows, wide, 4}, kMaxBytes, &bytes))
    return make_status(StatusCode::kInvalidArgument,
                       concat(fn, ": rows * max(2n, d) = ", rows, " * ", wide,
                              " is too large (per-row buffers would exceed 2^56 bytes; rows = T*K or the "
                              "token-rounding capacity)"));
  if (!detail::checked_product({s.E, 2 * static_cast<int64_t>(s.n), s.d, 4}, kMaxBytes, &bytes))
    return make_status(StatusCode::kInvalidArgument,
                       concat(fn, ": E * 2n * d = ", s.E, " * ", 2 * static_cast<int64_t>(s.n), " * ", s.d,
                              " is too large (weights would exceed 2^56 bytes)"));
  if (!detail::checked_product({s.T, s.E, 4}, kMaxBytes, &bytes))
    return make_status(StatusCode::kInvalidArgument,
                       concat(fn, ": T * E = ", s.T, " * ", s.E, " is too large (router logits)"));
  return Status{};
}

int moe_token_rounding_tile(const MoEShape&) { return engine::kRowTile; }

Status moe_init() {
  int sms = 0;
  SMOE_RETURN_IF_ERROR(layer::sm_count(&sms));  // a Hopper GPU is current
  return blas::init_current_device();
}

int64_t moe_row_capacity(const MoEShape& s) {
  if (!moe_can_implement(s).ok()) return 0;
  return s.router == MoERouter::kTokenRounding ? token_rounding_capacity(plan::rounding_problem(s, 0))
                                               : s.T * s.K;
}

size_t moe_saved_state_size(const MoEShape& s) {
  if (!moe_can_implement(s).ok()) return 0;  // forward/backward report the broken rule
  return plan::saved_layout(s, nullptr).bytes;
}
MoESavedView moe_saved_state_view(const MoEShape& s, void* saved) { return plan::saved_layout(s, saved).v; }
size_t moe_forward_workspace_size(const MoEShape& s) {
  if (!moe_can_implement(s).ok()) return 0;
  return plan::forward_ws(s, nullptr).total;
}
size_t moe_backward_workspace_size(const MoEShape& s, bool consume_saved) {
  if (!moe_can_implement(s).ok()) return 0;
  return plan::backward_ws(s, nullptr, consume_saved).total;
}

}  // namespace smoe
