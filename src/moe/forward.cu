// The MoE layer's forward on the fused engine (stream-ordered, no host sync):
//   logits = x W_r^T                 cuBLAS, fp32 out
//   routing                          into the saved state (scores, indices, expert offsets): top-K
//                                    softmax, top-K + token rounding, or the caller's (no router GEMM)
//   H, A = SwiGLU(x[gather] W1_e^T)  engine varlen-M: gathered x, SwiGLU epilogue (H saved)
//   Y = A W2_e^T                     engine varlen-M: A by TMA (workspace, TK x d)
//   out[t] = sum_k s Y[row(t,k)]     fp32 gather-sum, no atomics
#include "engine/engine.h"
#include "moe/cublas_handles.h"
#include "moe/expert_gemms.h"
#include "moe/layer_common.h"
#include "moe/layer_kernels.h"
#include "moe/memory_plan.h"
#include "moe/profile.h"
#include "smoe/smoe.h"

namespace smoe {

Status moe_forward(const MoEForwardArgs& a, cudaStream_t stream) {
  const char* fn = "moe_forward";
  const MoEShape& s = a.shape;
  SMOE_RETURN_IF_ERROR(layer::check_common(fn, s, a.x, a.weights, a.saved, a.saved_bytes));
  if (s.T > 0) SMOE_RETURN_IF_ERROR(detail::check_ptr(a.out, fn, "out", 16));
  SMOE_RETURN_IF_ERROR(detail::check_ptr(a.status, fn, "status", 8));
  const bool provided = s.router == MoERouter::kProvided;
  if (provided && s.T > 0) {
    SMOE_RETURN_IF_ERROR(detail::check_ptr(a.routed_expert, fn, "routed_expert (router = kProvided)", 4));
    SMOE_RETURN_IF_ERROR(detail::check_ptr(a.routed_scores, fn, "routed_scores (router = kProvided)", 4));
  }
  const plan::ForwardWs w = plan::forward_ws(s, a.workspace);
  SMOE_RETURN_IF_ERROR(layer::check_buffer(a.workspace, a.workspace_bytes, w.total, fn, "workspace",
                                           "workspace_bytes", "moe_forward_workspace_size"));
  const layer::TensorBytes tb(s);
  SMOE_RETURN_IF_ERROR(layer::check_disjoint(
      fn,
      {{a.out, tb.tokens, "out"},
       {a.saved, a.saved_bytes, "saved"},
       {a.workspace, a.workspace_bytes, "workspace"},
       {a.status, sizeof(DeviceStatus), "status"}},
      {{a.x, tb.tokens, "x"},
       {a.weights.w_router, tb.router, "weights.w_router"},
       {a.weights.w1, a.weights.w3 ? tb.w1 / 2 : tb.w1, "weights.w1"},
       {a.weights.w2, tb.w2, "weights.w2"},
       {a.weights.w3, tb.w1 / 2, "weights.w3"},
       {a.routed_expert, tb.slots, "routed_expert"},
       {a.routed_scores, tb.slots, "routed_scores"}}));
  int sms = 0;
  SMOE_RETURN_IF_ERROR(layer::sm_count(&sms));
  const MoESavedView sv = moe_saved_state_view(s, a.saved);
  const int64_t rows = moe_row_capacity(s);
  // The stamp is cleared first and written last: a forward that stops half way leaves none.
  void* stamp = plan::saved_layout(s, a.saved).stamp;
  SMOE_RETURN_IF_ERROR(kernels::clear_saved_stamp(stamp, stream));
  const uint64_t saved_need = moe_saved_state_size(s);
  const bool two = a.weights.w3 != nullptr;  // gate/up as two tensors: H in halves
  const uint64_t hash = plan::saved_shape_hash(s, two);
  profile::mark("begin", stream);

  if (!provided && s.T > 0) {
    cublasHandle_t h;
    SMOE_RETURN_IF_ERROR(blas::prepare(stream, w.cublas, &h));
    SMOE_RETURN_IF_ERROR(
        blas::router_logits(h, s.T, s.d, s.E, a.weights.w_router, a.x, w.logits, "moe_forward: router GEMM"));
    profile::mark("router_gemm", stream);
  }

  const RoutingProblem rp{s.T, s.E, s.K, DType::kFloat32};
  RoutingOutputs ro{sv.scores, sv.topk_expert, sv.expert_frequency, sv.expert_offset,
                    sv.scatter_idx, sv.reverse_scatter_idx, sv.gather_idx, a.status, sv.token_offset};
  if (s.router == MoERouter::kTopKSoftmax) {
    SMOE_RETURN_IF_ERROR(topk_routing(rp, w.logits, ro, w.routing, w.routing_bytes, stream));
  } else if (provided) {
    SMOE_RETURN_IF_ERROR(provided_routing(rp, a.routed_expert, a.routed_scores, ro, w.routing,
                                          w.routing_bytes, stream));
  } else {
    TokenRoundingOutputs to;
    to.scores = sv.scores;
    to.entry_expert = sv.entry_expert;
    to.token_offset = sv.token_offset;
    to.topk_expert = sv.topk_expert;
    to.topk_score = sv.topk_score;
    to.expert_frequency = sv.expert_frequency;
    to.expert_offset = sv.expert_offset;
    to.scatter_idx = sv.scatter_idx;
    to.reverse_scatter_idx = sv.reverse_scatter_idx;
    to.gather_idx = sv.gather_idx;
    to.status = a.status;
    SMOE_RETURN_IF_ERROR(token_rounding_routing(plan::rounding_problem(s, a.rounding_seed), w.logits, to,
                                                w.routing, w.routing_bytes, stream));
  }
  profile::mark("routing", stream);
  if (s.T == 0)  // the saved state holds the (empty) routing; nothing to compute
    return kernels::write_saved_stamp(stamp, plan::kSavedMagic, hash, saved_need, stream);

  // The GEMMs are sized for the row capacity; the scheduler reads the actual rows per expert from
  // expert_offset on the device (rows past expert_offset[E] are never touched).
  const layer::ExpertRows er{s.E, s.d, s.n, rows, sv.expert_offset, sv.gather_idx, s.T};
  const layer::GateUp gu = layer::gate_up_of(a.weights);
  SMOE_RETURN_IF_ERROR(engine::varlen_m(layer::up_proj_args(er, a.x, gu, sv.h, w.act), sms, stream));
  profile::mark("up_proj", stream);
  SMOE_RETURN_IF_ERROR(engine::varlen_m(layer::down_proj_args(er, w.act, a.weights.w2, w.y), sms, stream));
  profile::mark("down_proj", stream);

  SMOE_RETURN_IF_ERROR(kernels::aggregate(w.y, sv.scores, sv.reverse_scatter_idx, sv.token_offset, s.d, s.T, s.K,
                                          sms, a.out, stream));
  profile::mark("aggregate", stream);
  return kernels::write_saved_stamp(stamp, plan::kSavedMagic, hash, saved_need, stream);
}

}  // namespace smoe
