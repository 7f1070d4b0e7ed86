// The MoE layer entry points. This milestone declares them and validates shapes; the GPU layer
// milestone (grouped GEMMs on CUTLASS, fused SwiGLU / dSwiGLU epilogues) implements forward and
// backward. Until then they return kNotImplemented after validating their arguments.
#include "common/check.h"
#include "smoe/smoe.h"

namespace smoe {
namespace {

size_t align_up(size_t x) { return (x + kWorkspaceAlignment - 1) / kWorkspaceAlignment * kWorkspaceAlignment; }

}  // namespace

Status moe_can_implement(const MoEShape& s) {
  using detail::concat;
  using detail::make_status;
  const char* fn = "moe";
  RoutingProblem rp;
  rp.num_tokens = s.T;
  rp.num_experts = s.E;
  rp.top_k = s.K;
  SMOE_RETURN_IF_ERROR(routing_can_implement(rp));
  // 16-byte rows for cp.async / TMA on bf16 operands and 64-wide K tiles.
  if (s.d <= 0 || s.d % 64 != 0)
    return make_status(StatusCode::kInvalidArgument,
                       concat(fn, ": d = ", s.d, " must be a positive multiple of 64"));
  if (s.n <= 0 || s.n % 64 != 0)
    return make_status(StatusCode::kInvalidArgument,
                       concat(fn, ": n = ", s.n, " must be a positive multiple of 64"));
  return Status{};
}

size_t moe_saved_state_size(const MoEShape& s) {
  const size_t tk = static_cast<size_t>(s.T) * s.K;
  size_t bytes = align_up(tk * 2 * s.n * sizeof(bf16));  // H
  bytes += align_up(tk * sizeof(float));                 // scores
  bytes += 4 * align_up(tk * sizeof(int32_t));           // topk expert, scatter, reverse, gather
  bytes += 2 * align_up((s.E + 1) * sizeof(int32_t));    // frequency, offsets
  return bytes;
}

size_t moe_forward_workspace_size(const MoEShape&) { return 0; }
size_t moe_backward_workspace_size(const MoEShape&) { return 0; }

Status moe_forward(const MoEForwardArgs& args, cudaStream_t) {
  SMOE_RETURN_IF_ERROR(moe_can_implement(args.shape));
  return detail::make_status(StatusCode::kNotImplemented,
                             "moe_forward: not implemented yet (GPU layer milestone)");
}

Status moe_backward(const MoEBackwardArgs& args, cudaStream_t) {
  SMOE_RETURN_IF_ERROR(moe_can_implement(args.shape));
  return detail::make_status(StatusCode::kNotImplemented,
                             "moe_backward: not implemented yet (GPU layer milestone)");
}

}  // namespace smoe
