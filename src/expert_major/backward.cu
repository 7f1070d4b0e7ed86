// The expert-major layer's backward (smoe/expert_major.h): the token-major backward's engine calls
// with one entry per row (plan.h) and no router:
//   dA' = dout[row_of] W2_e           engine varlen-M, dSwiGLU + dS epilogue: dH, A' = p A, dS partials
//   dprobs[r] = sum of r's partials   fixed order (padding rows: 0)
//   dW2_e = dout[row_of]_e^T A'_e     engine varlen-K, dout gathered
//   dW1_e = dH_e^T x[row_of]_e        engine varlen-K, x gathered (two tensors: one call per half;
//                                     concatenated: dH's halves are dW1's gate and up rows, one call)
//   dX~ = dH W1_e                     engine varlen-M, dH by TMA
//   dx[r] = dX~[slot_of[r]]           the layer's dx sum with one entry per row (padding: 0)
#include "engine/engine.h"
#include "expert_major/plan.h"
#include "expert_major/rules.h"
#include "expert_major/weights.h"
#include "moe/layer_common.h"
#include "moe/layer_kernels.h"
#include "moe/profile.h"

namespace smoe {

Status expert_major_backward(const ExpertMajorBackwardArgs& a, cudaStream_t stream) {
  SMOE_RETURN_IF_ERROR(expert_major::check_backward(a));
  const ExpertMajorShape& s = a.shape;
  int sms = 0;
  SMOE_RETURN_IF_ERROR(layer::sm_count(&sms));
  const expert_major::SavedLayout sv = expert_major::saved_layout(s, const_cast<void*>(a.saved));
  const expert_major::BackwardWs w = expert_major::backward_ws(s, a.workspace);
  const bool separate = s.gate_up == GateUpLayout::kSeparate;
  const size_t rows_bytes = static_cast<size_t>(s.rows) * s.d * sizeof(bf16);
  const size_t w1_bytes = static_cast<size_t>(s.E) * (separate ? 1 : 2) * s.n * s.d * sizeof(bf16);
  const size_t w2_bytes = static_cast<size_t>(s.E) * s.d * s.n * sizeof(bf16);
  float* dS = s.probs ? a.dprobs : w.dprobs;
  profile::mark("begin", stream);
  // The stamp first: when it does not match, expert_offset is all zeros (no GEMM row, no saved
  // index read), the index-reading kernels skip on `valid`, and the end NaN-fills every gradient.
  SMOE_RETURN_IF_ERROR(kernels::check_saved(sv.stamp, expert_major::kSavedMagic, expert_major::saved_shape_hash(s),
                                            sv.bytes, sv.expert_offset, s.E, w.valid, w.expert_offset, a.status,
                                            stream));
  const int32_t* expert_offset = w.expert_offset;
  auto nan_if_invalid = [&]() -> Status {
    return kernels::nan_fill_if_invalid(w.valid,
                                        {{a.dx, rows_bytes},
                                         {a.dw1, w1_bytes},
                                         {separate ? a.dw3 : nullptr, w1_bytes},
                                         {a.dw2, w2_bytes},
                                         {s.probs ? a.dprobs : nullptr, static_cast<size_t>(s.rows) * sizeof(float)}},
                                        stream);
  };
  if (s.rows == 0) {  // no row: every weight gradient is zero (overwritten, never accumulated)
    SMOE_CUDA_RETURN(cudaMemsetAsync(a.dw1, 0, w1_bytes, stream));
    if (separate) SMOE_CUDA_RETURN(cudaMemsetAsync(a.dw3, 0, w1_bytes, stream));
    SMOE_CUDA_RETURN(cudaMemsetAsync(a.dw2, 0, w2_bytes, stream));
    return nan_if_invalid();
  }
  const expert_major::GateUp gu = expert_major::gate_up(s, a.weights);

  engine::VarlenMArgs da;
  da.num_experts = s.E;
  da.N = s.n;
  da.K = s.d;
  da.rows = s.rows;
  da.expert_offset = expert_offset;
  da.A = a.dout;
  da.a_rows = s.rows;
  da.gather_idx = sv.row_of;
  da.B = a.weights.w2;  // [E][d][n] = [E][K][N]
  da.b_major = engine::WeightMajor::kKN;
  da.epilogue = engine::Epilogue::kDSwiGLU;
  da.D2 = w.a_prime;
  da.H = sv.h;
  da.dH = w.dH;
  da.scores = sv.scores;   // by entry = row
  da.scatter = sv.row_of;  // grouped row -> entry = row
  da.ds_partial = w.ds_partial;
  da.halves = gu.halves;
  SMOE_RETURN_IF_ERROR(engine::varlen_m(da, sms, stream));
  // Grouped rows past nnz are the padding rows (row_of): their dprobs entry gets 0.
  SMOE_RETURN_IF_ERROR(kernels::ds_rowsum(w.ds_partial, engine::ds_partial_tiles(s.n), sv.row_of, s.rows,
                                          expert_offset + s.E, dS, stream, w.valid));
  profile::mark("dA_proj", stream);

  engine::VarlenKArgs dw2;
  dw2.num_experts = s.E;
  dw2.M = s.d;
  dw2.N = s.n;
  dw2.rows = s.rows;
  dw2.expert_offset = expert_offset;
  dw2.P = a.dout;
  dw2.ld_p = s.d;
  dw2.gather_p = sv.row_of;
  dw2.gather_rows = s.rows;
  dw2.Q = w.a_prime;
  dw2.ld_q = s.n;
  dw2.D = a.dw2;
  SMOE_RETURN_IF_ERROR(engine::varlen_k(dw2, sms, stream));
  profile::mark("dW2", stream);

  // dW1 [E][2n][d] = dH^T x: interleaved dH gives interleaved dW1, and dH in halves gives gate rows
  // then up rows, which is the concatenated layout itself; two tensors take one call per half.
  for (int half = 0; half < (separate ? 2 : 1); ++half) {
    engine::VarlenKArgs dw1;
    dw1.num_experts = s.E;
    dw1.M = separate ? s.n : 2 * s.n;
    dw1.N = s.d;
    dw1.rows = s.rows;
    dw1.expert_offset = expert_offset;
    dw1.P = w.dH + static_cast<int64_t>(half) * s.n;
    dw1.ld_p = 2 * s.n;
    dw1.Q = a.x;
    dw1.ld_q = s.d;
    dw1.gather_q = sv.row_of;
    dw1.gather_rows = s.rows;
    dw1.D = half == 0 ? a.dw1 : a.dw3;
    SMOE_RETURN_IF_ERROR(engine::varlen_k(dw1, sms, stream));
  }
  profile::mark("dW1", stream);

  engine::VarlenMArgs dxt;
  dxt.num_experts = s.E;
  dxt.N = s.d;
  dxt.K = 2 * s.n;
  dxt.rows = s.rows;
  dxt.expert_offset = expert_offset;
  dxt.A = w.dH;
  dxt.a_rows = s.rows;
  dxt.B = gu.b;  // [E][2n][d] = [E][K][N]; halves: K-tiles [0, n) gate rows, [n, 2n) up rows
  dxt.B2 = gu.b2;
  dxt.b_expert_stride = gu.stride;
  dxt.b_major = engine::WeightMajor::kKN;
  dxt.epilogue = engine::Epilogue::kStore;
  dxt.D = w.dXt;
  SMOE_RETURN_IF_ERROR(engine::varlen_m(dxt, sms, stream));
  profile::mark("dX_proj", stream);

  SMOE_RETURN_IF_ERROR(kernels::dx_sum(w.dXt, sv.slot_of, sv.row_offset, nullptr, nullptr, nullptr, nullptr, s.d,
                                       s.rows, s.E, 1, sms, a.dx, stream, w.valid));
  profile::mark("dx_sum", stream);
  return nan_if_invalid();
}

}  // namespace smoe
