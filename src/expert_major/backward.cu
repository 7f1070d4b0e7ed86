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
#include "moe/da_proj.h"
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
  const expert_major::BackwardWs w = expert_major::backward_ws(s, a.workspace, a.consume_saved);
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
  // consume_saved spends the state (dH goes over H below): the stamp is cleared once dA' is
  // prepared, before it launches (see src/moe/backward.cu).
  auto spend_saved = [&]() -> Status {
    return a.consume_saved ? kernels::clear_saved_stamp(sv.stamp, stream) : Status{};
  };
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
    SMOE_RETURN_IF_ERROR(spend_saved());
    SMOE_CUDA_RETURN(cudaMemsetAsync(a.dw1, 0, w1_bytes, stream));
    if (separate) SMOE_CUDA_RETURN(cudaMemsetAsync(a.dw3, 0, w1_bytes, stream));
    SMOE_CUDA_RETURN(cudaMemsetAsync(a.dw2, 0, w2_bytes, stream));
    return nan_if_invalid();
  }
  const layer::GateUp gu = expert_major::gate_up(s, a.weights);

  const layer::ExpertRows er{s.E, s.d, s.n, s.rows, expert_offset, sv.row_of, s.rows};
  // Scores by entry = row; scatter: grouped row -> entry = row.
  bf16* const dH = a.consume_saved ? sv.h : w.dH;  // in place over H: see src/moe/backward.cu
  const layer::DSwiGLUIo io{sv.h, sv.scores, sv.row_of, dH, w.a_prime, w.ds_partial};
  const engine::VarlenMArgs da = layer::da_proj_args(er, a.dout, a.weights.w2, gu.halves, io);
  SMOE_RETURN_IF_ERROR(layer::run_da_proj(da, sms, stream, spend_saved));
  // Grouped rows past nnz are the padding rows (row_of): their dprobs entry gets 0.
  SMOE_RETURN_IF_ERROR(kernels::ds_rowsum(w.ds_partial, engine::ds_partial_tiles(s.n), sv.row_of, s.rows,
                                          expert_offset + s.E, dS, stream, w.valid));
  profile::mark("dA_proj", stream);

  SMOE_RETURN_IF_ERROR(engine::varlen_k(layer::dw2_args(er, a.dout, w.a_prime, a.dw2), sms, stream));
  profile::mark("dW2", stream);

  // dW1 [E][2n][d] = dH^T x: interleaved dH gives interleaved dW1, and dH in halves gives gate rows
  // then up rows, which is the concatenated layout itself; two tensors take one call per half.
  for (int half = 0; half < (separate ? 2 : 1); ++half)
    SMOE_RETURN_IF_ERROR(engine::varlen_k(
        layer::dw1_args(er, dH, a.x, separate, half, half == 0 ? a.dw1 : a.dw3), sms, stream));
  profile::mark("dW1", stream);

  SMOE_RETURN_IF_ERROR(engine::varlen_m(layer::dx_tilde_args(er, dH, gu, w.dXt), sms, stream));
  profile::mark("dX_proj", stream);

  SMOE_RETURN_IF_ERROR(kernels::dx_sum(w.dXt, sv.slot_of, sv.row_offset, nullptr, nullptr, nullptr, nullptr, s.d,
                                       s.rows, s.E, 1, sms, a.dx, stream, w.valid));
  profile::mark("dx_sum", stream);
  return nan_if_invalid();
}

}  // namespace smoe
