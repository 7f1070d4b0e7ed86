// The MoE layer's forward on the fused engine (stream-ordered, no host sync):
//   logits = x W_r^T                 cuBLAS, fp32 out
//   top-K routing                    into the saved state (scores, indices, expert offsets)
//   H, A = SwiGLU(x[gather] W1_e^T)  engine varlen-M: gathered x, SwiGLU epilogue (H saved)
//   Y = A W2_e^T                     engine varlen-M: A by TMA (workspace, TK x d)
//   out[t] = sum_k s Y[row(t,k)]     fp32 gather-sum, no atomics
#include "engine/engine.h"
#include "moe/cublas_handles.h"
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
  SMOE_RETURN_IF_ERROR(detail::check_ptr(a.out, fn, "out", 16));
  SMOE_RETURN_IF_ERROR(detail::check_ptr(a.status, fn, "status", 8));
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
       {a.weights.w1, tb.w1, "weights.w1"},
       {a.weights.w2, tb.w2, "weights.w2"}}));
  int sms = 0;
  SMOE_RETURN_IF_ERROR(layer::sm_count(&sms));
  const MoESavedView sv = moe_saved_state_view(s, a.saved);
  const int64_t tk = s.T * s.K;
  profile::mark("begin", stream);

  // Router logits [T][E] = x W_r^T: column-major C (E x T) = op(W_r as d x E)^T * (x as d x T).
  cublasHandle_t h;
  SMOE_RETURN_IF_ERROR(blas::prepare(stream, w.cublas, &h));
  const float one = 1.f, zero = 0.f;
  SMOE_RETURN_IF_ERROR(blas::check(
      cublasGemmEx(h, CUBLAS_OP_T, CUBLAS_OP_N, s.E, static_cast<int>(s.T), s.d, &one, a.weights.w_router,
                   CUDA_R_16BF, s.d, a.x, CUDA_R_16BF, s.d, &zero, w.logits, CUDA_R_32F, s.E,
                   CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
      "moe_forward: router GEMM"));
  profile::mark("router_gemm", stream);

  RoutingProblem rp{s.T, s.E, s.K, DType::kFloat32};
  RoutingOutputs ro{sv.scores, sv.topk_expert, sv.expert_frequency, sv.expert_offset,
                    sv.scatter_idx, sv.reverse_scatter_idx, sv.gather_idx, a.status};
  SMOE_RETURN_IF_ERROR(topk_routing(rp, w.logits, ro, w.routing, w.routing_bytes, stream));
  profile::mark("routing", stream);

  engine::VarlenMArgs up;
  up.num_experts = s.E;
  up.N = 2 * s.n;
  up.K = s.d;
  up.rows = tk;
  up.expert_offset = sv.expert_offset;
  up.A = a.x;
  up.a_rows = s.T;
  up.gather_idx = sv.gather_idx;
  up.B = a.weights.w1;
  up.b_major = engine::WeightMajor::kNK;
  up.epilogue = engine::Epilogue::kSwiGLU;
  up.D = sv.h;
  up.D2 = w.act;
  SMOE_RETURN_IF_ERROR(engine::varlen_m(up, sms, stream));
  profile::mark("up_proj", stream);

  engine::VarlenMArgs down;
  down.num_experts = s.E;
  down.N = s.d;
  down.K = s.n;
  down.rows = tk;
  down.expert_offset = sv.expert_offset;
  down.A = w.act;
  down.a_rows = tk;
  down.B = a.weights.w2;
  down.b_major = engine::WeightMajor::kNK;
  down.epilogue = engine::Epilogue::kStore;
  down.D = w.y;
  SMOE_RETURN_IF_ERROR(engine::varlen_m(down, sms, stream));
  profile::mark("down_proj", stream);

  SMOE_RETURN_IF_ERROR(kernels::aggregate(w.y, sv.scores, sv.reverse_scatter_idx, s.K, s.d, s.T, a.out, stream));
  profile::mark("aggregate", stream);
  return Status{};
}

}  // namespace smoe
