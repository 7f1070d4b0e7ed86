#include "expert_major/plan.h"

#include "common/hash.h"
#include "common/workspace.h"
#include "engine/epilogue/dswiglu.h"

namespace smoe {
namespace expert_major {

SavedLayout saved_layout(const ExpertMajorShape& s, void* base) {
  const size_t R = static_cast<size_t>(s.rows);
  detail::Carver c(base);
  SavedLayout l;
  l.stamp = c.take<plan::SavedStamp>(1);
  l.h = c.take<bf16>(R * 2 * s.n);
  l.expert_offset = c.take<int32_t>(s.E + 1);
  l.row_of = c.take<int32_t>(R);
  l.slot_of = c.take<int32_t>(R);
  l.scores = c.take<float>(R);
  l.row_offset = c.take<int32_t>(R + 1);
  l.bytes = c.used();
  return l;
}

ForwardWs forward_ws(const ExpertMajorShape& s, void* base) {
  const size_t R = static_cast<size_t>(s.rows);
  detail::Carver c(base);
  ForwardWs w;
  w.act = c.take<bf16>(R * s.n);
  w.y = c.take<bf16>(R * s.d);
  w.valid = c.take<int32_t>(1);
  w.row_begin = c.take<int32_t>(s.E);
  w.total = c.used();
  return w;
}

BackwardWs backward_ws(const ExpertMajorShape& s, void* base, bool consume_saved) {
  const size_t R = static_cast<size_t>(s.rows);
  detail::Carver c(base);
  BackwardWs w;
  // consume_saved: dH goes over the saved H (the dA' epilogue, its one reader, reads each element
  // before writing it: src/moe/backward.cu).
  w.dH = consume_saved ? nullptr : c.take<bf16>(R * 2 * s.n);
  // A' and the dS partials die with dW2 and ds_rowsum; dX~ is written after them (backward.cu: one
  // stream, dA' -> ds_rowsum -> dW2 -> dW1 -> dX~ -> dx_sum), so it takes their bytes, as in the
  // token-major layer's workspace (src/moe/memory_plan.cpp).
  c.overlay_begin();
  w.a_prime = c.take<bf16>(R * s.n);
  w.ds_partial = c.take<float>(R * engine::ds_partial_tiles(s.n));
  c.overlay_next();
  w.dXt = c.take<bf16>(R * s.d);
  c.overlay_end();
  w.dprobs = s.probs ? nullptr : c.take<float>(R);
  w.valid = c.take<int32_t>(1);
  w.expert_offset = c.take<int32_t>(s.E + 1);
  w.total = c.used();
  return w;
}

uint64_t saved_shape_hash(const ExpertMajorShape& s) {
  // FNV-1a over every field that changes the saved layout or its meaning ("em" tags the layer).
  const int64_t f[8] = {0x656d, s.rows, s.d, s.n, s.E, static_cast<int64_t>(s.gate_up), s.probs ? 1 : 0,
                        s.segmented ? 1 : 0};
  return detail::fnv1a_fields(f, 8);
}

}  // namespace expert_major
}  // namespace smoe
