// The MoE layer's backward on the fused engine (SonicMoE's rewrite: no Y, no dY; nothing of size
// T*K*d is held from the forward):
//   dA' = dO[gather] W2_e            engine varlen-M, dSwiGLU + dS epilogue: dH, A' = s*A and
//                                    per-column-tile partial dS (deterministic)
//   dS[t,k] = sum of the partials    fixed order
//   dW2_e = dO[gather]_e^T A'_e      engine varlen-K, dO gathered in its loads
//   router: dl, dense bf16 dlogits (src/routing/router_backward.cu); dW_r = dlogits^T x (cuBLAS,
//                                    fp32 out -> bf16); token rounding recomputes the logits and
//                                    adds dlogits W_r to dx by cuBLAS;
//                                    provided routing has no router: dS goes to the caller's dscores
//   dW1_e = dH_e^T x[gather]_e       engine varlen-K, x gathered in its loads
//   dX~ = dH W1_e                    engine varlen-M, dH by TMA
//   dx[t] = sum over t's entries of dX~[row] (+ dl W_r[e] for top-K, + dlogits W_r for rounding)
#include "engine/engine.h"
#include "moe/cublas_handles.h"
#include "moe/da_proj.h"
#include "moe/expert_gemms.h"
#include "moe/layer_common.h"
#include "moe/layer_kernels.h"
#include "moe/memory_plan.h"
#include "moe/profile.h"
#include "routing/router_backward.h"
#include "smoe/smoe.h"

namespace smoe {

Status moe_backward(const MoEBackwardArgs& a, cudaStream_t stream) {
  const char* fn = "moe_backward";
  const MoEShape& s = a.shape;
  SMOE_RETURN_IF_ERROR(layer::check_common(fn, s, a.x, a.weights, a.saved, a.saved_bytes));
  if (s.T > 0) {  // T = 0: the token tensors may be null
    SMOE_RETURN_IF_ERROR(detail::check_ptr(a.dout, fn, "dout", 16));
    SMOE_RETURN_IF_ERROR(detail::check_ptr(a.dx, fn, "dx", 16));
  }
  const bool provided = s.router == MoERouter::kProvided;
  if (provided) {
    if (s.T * s.K > 0) SMOE_RETURN_IF_ERROR(detail::check_ptr(a.dscores, fn, "dscores (router = kProvided)", 4));
  } else {
    SMOE_RETURN_IF_ERROR(detail::check_ptr(a.dw_router, fn, "dw_router", 16));
  }
  SMOE_RETURN_IF_ERROR(detail::check_ptr(a.dw1, fn, "dw1", 16));
  SMOE_RETURN_IF_ERROR(detail::check_ptr(a.dw2, fn, "dw2", 16));
  const bool two = a.weights.w3 != nullptr;  // gate/up as two tensors: dw1 (gate) and dw3 (up)
  if (two) {
    SMOE_RETURN_IF_ERROR(detail::check_ptr(a.dw3, fn, "dw3 (weights.w3 is set)", 16));
  } else if (a.dw3 != nullptr) {
    return detail::make_status(StatusCode::kInvalidArgument,
                               "moe_backward: dw3 must be null when weights.w3 is (interleaved w1: dw1 holds both)");
  }
  const layer::TensorBytes tb(s);
  const size_t w1_bytes = two ? tb.w1 / 2 : tb.w1;  // w1 / dw1; w3 / dw3 the same with two tensors
  SMOE_RETURN_IF_ERROR(layer::check_disjoint(
      fn,
      {{a.dx, tb.tokens, "dx"},
       {a.dw_router, tb.router, "dw_router"},
       {a.dscores, tb.slots, "dscores"},
       {a.dw1, w1_bytes, "dw1"},
       {a.dw2, tb.w2, "dw2"},
       {a.dw3, two ? w1_bytes : 0, "dw3"},
       {a.workspace, a.workspace_bytes, "workspace"},
       // consume_saved writes the saved state: then it is an output, disjoint from the inputs too.
       {a.consume_saved ? a.saved : nullptr, a.consume_saved ? a.saved_bytes : 0, "saved (consume_saved)"}},
      {{a.x, tb.tokens, "x"},
       {a.weights.w_router, tb.router, "weights.w_router"},
       {a.weights.w1, w1_bytes, "weights.w1"},
       {a.weights.w2, tb.w2, "weights.w2"},
       {a.weights.w3, two ? w1_bytes : 0, "weights.w3"},
       {a.dout, tb.tokens, "dout"},
       {a.consume_saved ? nullptr : a.saved, a.consume_saved ? 0 : a.saved_bytes, "saved"}}));
  const plan::BackwardWs w = plan::backward_ws(s, a.workspace, a.consume_saved);
  SMOE_RETURN_IF_ERROR(layer::check_buffer(a.workspace, a.workspace_bytes, w.total, fn, "workspace",
                                           "workspace_bytes", "moe_backward_workspace_size"));
  if (a.status != nullptr) SMOE_RETURN_IF_ERROR(detail::check_ptr(a.status, fn, "status", 8));
  int sms = 0;
  SMOE_RETURN_IF_ERROR(layer::sm_count(&sms));
  const MoESavedView sv = moe_saved_state_view(s, const_cast<void*>(a.saved));
  const int64_t rows = moe_row_capacity(s);  // the GEMMs read the actual rows from expert_offset
  float* dS = provided ? a.dscores : w.dS;  // by entry; provided: the caller's [T][K] slots
  profile::mark("begin", stream);
  // The stamp first: when it does not match, expert_offset below is all zeros (no GEMM row, so no
  // saved index is read), the index-reading kernels skip on `valid`, and the end NaN-fills every
  // gradient.
  SMOE_RETURN_IF_ERROR(kernels::check_saved(plan::saved_layout(s, const_cast<void*>(a.saved)).stamp,
                                            plan::kSavedMagic, plan::saved_shape_hash(s, two),
                                            moe_saved_state_size(s), sv.expert_offset, s.E, w.valid,
                                            w.expert_offset, a.status, stream));
  // consume_saved spends the state (dH goes over H below): its stamp is cleared before dA' launches,
  // once dA' is prepared (layer::run_da_proj), so a second backward on it meets no stamp, as after a forward
  // that stopped half way, while a call refused before dA' leaves the state as it was.
  auto spend_saved = [&]() -> Status {
    return a.consume_saved ? kernels::clear_saved_stamp(plan::saved_layout(s, const_cast<void*>(a.saved)).stamp, stream)
                           : Status{};
  };
  const int32_t* expert_offset = w.expert_offset;
  const int32_t* valid = w.valid;
  const int32_t* nnz = expert_offset + s.E;
  auto nan_if_invalid = [&]() -> Status {  // the router gradient or dscores, by routing mode
    return kernels::nan_fill_if_invalid(valid,
                                        {{a.dx, tb.tokens},
                                         {a.dw1, w1_bytes},
                                         {a.dw2, tb.w2},
                                         {two ? a.dw3 : nullptr, w1_bytes},
                                         {provided ? nullptr : a.dw_router, tb.router},
                                         {provided ? a.dscores : nullptr, tb.slots}},
                                        stream);
  };
  if (s.T == 0) {  // no token: every weight gradient is zero (they are overwritten, never accumulated)
    SMOE_RETURN_IF_ERROR(spend_saved());
    if (a.x_ready != nullptr) SMOE_CUDA_RETURN(cudaStreamWaitEvent(stream, a.x_ready, 0));
    SMOE_CUDA_RETURN(cudaMemsetAsync(a.dw1, 0, w1_bytes, stream));
    if (two) SMOE_CUDA_RETURN(cudaMemsetAsync(a.dw3, 0, w1_bytes, stream));
    SMOE_CUDA_RETURN(cudaMemsetAsync(a.dw2, 0, tb.w2, stream));
    if (!provided) SMOE_CUDA_RETURN(cudaMemsetAsync(a.dw_router, 0, tb.router, stream));
    return nan_if_invalid();
  }

  const layer::ExpertRows er{s.E, s.d, s.n, rows, expert_offset, sv.gather_idx, s.T};
  // W1 [E][2n][d]; two tensors: H (saved) and dH in halves (gate columns [0, n), up [n, 2n)), and
  // dX~'s K-tiles [0, n) from w1, [n, 2n) from w3.
  const layer::GateUp gu = layer::gate_up_of(a.weights);
  // consume_saved: dH in place over H. The dA' epilogue is H's one reader, and it reads each element
  // before the tile that owns the element writes it (the same lanes: load_row / apply_row), so the
  // bits are those of a separate dH (GpuEngine's in-place checks, every dA' instance).
  bf16* const dH = a.consume_saved ? sv.h : w.dH;
  const layer::DSwiGLUIo io{sv.h, sv.scores, sv.scatter_idx, dH, w.a_prime, w.ds_partial};
  const engine::VarlenMArgs da = layer::da_proj_args(er, a.dout, a.weights.w2, gu.halves, io);
  SMOE_RETURN_IF_ERROR(layer::run_da_proj(da, sms, stream, spend_saved));
  SMOE_RETURN_IF_ERROR(kernels::ds_rowsum(w.ds_partial, engine::ds_partial_tiles(s.n), sv.scatter_idx, rows,
                                          nnz, dS, stream, valid));
  profile::mark("dA_proj", stream);

  // dW2: the engine reads dO gathered in its loads.
  SMOE_RETURN_IF_ERROR(engine::varlen_k(layer::dw2_args(er, a.dout, w.a_prime, a.dw2), sms, stream));
  profile::mark("dW2", stream);

  // x may still be arriving (MoEBackwardArgs::x_ready, expert parallelism): nothing above reads it.
  if (a.x_ready != nullptr) SMOE_CUDA_RETURN(cudaStreamWaitEvent(stream, a.x_ready, 0));
  if (!provided) {
    cublasHandle_t h;
    SMOE_RETURN_IF_ERROR(blas::prepare(stream, w.cublas, &h));
    const float one = 1.f, zero = 0.f;
    if (s.router == MoERouter::kTopKSoftmax) {
      SMOE_RETURN_IF_ERROR(routing::router_backward(dS, sv.scores, sv.topk_expert, s.K, s.E, s.T, w.dl,
                                                    w.dlogits, stream, valid));
    } else {
      // Token rounding: padded scores are softmax-over-E values, so every logit gets a gradient.
      // The logits are recomputed (the same cuBLAS call as forward) instead of held: T*E*4 bytes
      // would be the largest saved tensor after H at small n.
      SMOE_RETURN_IF_ERROR(blas::router_logits(h, s.T, s.d, s.E, a.weights.w_router, a.x, w.logits,
                                               "moe_backward: router GEMM (token rounding recompute)"));
      SMOE_RETURN_IF_ERROR(routing::router_backward_tr(dS, sv.entry_expert, sv.token_offset, sv.topk_expert,
                                                       sv.topk_score, w.logits, s.K, s.E, s.T, w.dlogits,
                                                       stream, valid));
      // dx_router [T][d] = dlogits W_r: column-major C (d x T) = (W_r as d x E) * (dlogits as E x T).
      SMOE_RETURN_IF_ERROR(blas::check(
          cublasGemmEx(h, CUBLAS_OP_N, CUBLAS_OP_N, s.d, static_cast<int>(s.T), s.E, &one, a.weights.w_router,
                       CUDA_R_16BF, s.d, w.dlogits, CUDA_R_16BF, s.E, &zero, w.dx_router, CUDA_R_32F, s.d,
                       CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
          "moe_backward: router input gradient GEMM (token rounding)"));
    }
    // dW_r [E][d] = dlogits^T x: column-major C (d x E) = (x as d x T) * (dlogits as E x T)^T.
    SMOE_RETURN_IF_ERROR(blas::check(
        cublasGemmEx(h, CUBLAS_OP_N, CUBLAS_OP_T, s.d, s.E, static_cast<int>(s.T), &one, a.x, CUDA_R_16BF,
                     s.d, w.dlogits, CUDA_R_16BF, s.E, &zero, w.dwr32, CUDA_R_32F, s.d,
                     CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
        "moe_backward: router weight gradient GEMM"));
    SMOE_RETURN_IF_ERROR(kernels::f32_to_bf16(w.dwr32, a.dw_router, static_cast<int64_t>(s.E) * s.d, stream));
  }
  profile::mark("router_bwd", stream);

  // dW1 = dH^T x[gather] over [E][2n][d], x gathered in the engine's loads; with two tensors one
  // call per half (dw1 gate, dw3 up).
  for (int half = 0; half < (two ? 2 : 1); ++half)
    SMOE_RETURN_IF_ERROR(
        engine::varlen_k(layer::dw1_args(er, dH, a.x, two, half, half == 0 ? a.dw1 : a.dw3), sms, stream));
  profile::mark("dW1", stream);

  SMOE_RETURN_IF_ERROR(engine::varlen_m(layer::dx_tilde_args(er, dH, gu, w.dXt), sms, stream));
  profile::mark("dX_proj", stream);

  SMOE_RETURN_IF_ERROR(kernels::dx_sum(w.dXt, sv.reverse_scatter_idx, sv.token_offset, w.dl, sv.entry_expert,
                                       a.weights.w_router, w.dx_router, s.d, s.T, s.E, s.K, sms, a.dx, stream, valid));
  profile::mark("dx_sum", stream);
  // Timed as a stage of its own: while its launch was uncapped, its 0.3 ms hid between the stages.
  SMOE_RETURN_IF_ERROR(nan_if_invalid());
  profile::mark("nan_guard", stream);
  return Status{};
}

}  // namespace smoe
