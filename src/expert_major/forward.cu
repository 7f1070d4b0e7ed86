// The expert-major layer's forward (smoe/expert_major.h) on the token-major layer's engine calls,
// with one entry per row (plan.h):
//   row ranges                      check counts / segment_offset, grouped-row maps (saved)
//   H, A = SwiGLU(x[row_of] W1_e^T) engine varlen-M, x gathered through row_of (padding rows: none)
//   Y = A W2_e^T                    engine varlen-M, A by TMA
//   out[r] = p[r] Y[slot_of[r]]     the layer's aggregation with one entry per row (padding: 0)
#include "engine/engine.h"
#include "expert_major/row_ranges.h"
#include "expert_major/rules.h"
#include "expert_major/weights.h"
#include "moe/layer_common.h"
#include "moe/layer_kernels.h"
#include "moe/profile.h"

namespace smoe {

Status expert_major_forward(const ExpertMajorForwardArgs& a, cudaStream_t stream) {
  SMOE_RETURN_IF_ERROR(expert_major::check_forward(a));
  const ExpertMajorShape& s = a.shape;
  int sms = 0;
  SMOE_RETURN_IF_ERROR(layer::sm_count(&sms));
  const expert_major::SavedLayout sv = expert_major::saved_layout(s, a.saved);
  const expert_major::ForwardWs w = expert_major::forward_ws(s, a.workspace);
  // The stamp is cleared first and written last: a forward that stops half way leaves none.
  SMOE_RETURN_IF_ERROR(kernels::clear_saved_stamp(sv.stamp, stream));
  profile::mark("begin", stream);
  SMOE_RETURN_IF_ERROR(expert_major::row_ranges({a.counts, a.segment_offset, a.probs, s.rows, s.E}, sv,
                                                w.row_begin, w.valid, a.status, stream));
  profile::mark("row_ranges", stream);
  if (s.rows > 0) {
    const layer::GateUp gu = expert_major::gate_up(s, a.weights);
    // Sized for R rows; the scheduler reads the valid rows per expert from expert_offset.
    const layer::ExpertRows er{s.E, s.d, s.n, s.rows, sv.expert_offset, sv.row_of, s.rows};
    SMOE_RETURN_IF_ERROR(engine::varlen_m(layer::up_proj_args(er, a.x, gu, sv.h, w.act), sms, stream));
    profile::mark("up_proj", stream);
    SMOE_RETURN_IF_ERROR(engine::varlen_m(layer::down_proj_args(er, w.act, a.weights.w2, w.y), sms, stream));
    profile::mark("down_proj", stream);

    SMOE_RETURN_IF_ERROR(kernels::aggregate(w.y, sv.scores, sv.slot_of, sv.row_offset, s.d, s.rows, 1, sms, a.out, stream));
    profile::mark("aggregate", stream);
    SMOE_RETURN_IF_ERROR(
        kernels::nan_fill_if_invalid(w.valid, {{a.out, static_cast<size_t>(s.rows) * s.d * sizeof(bf16)}}, stream));
  }
  SMOE_RETURN_IF_ERROR(kernels::write_saved_stamp(sv.stamp, expert_major::kSavedMagic,
                                                  expert_major::saved_shape_hash(s), sv.bytes, stream));
  return expert_major::clear_stamp_if_invalid(sv.stamp, w.valid, stream);
}

}  // namespace smoe
