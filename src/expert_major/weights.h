// How each gate/up layout (smoe/expert_major.h, GateUpLayout) is handed to the engine: the token-major
// layer's two forms (interleaved, or two tensors with H in halves), and the concatenated tensor as
// two tensors 2n rows apart per expert (engine::VarlenMArgs::b_expert_stride), so no layout is
// copied.
#pragma once

#include <cstdint>

#include "moe/expert_gemms.h"
#include "smoe/expert_major.h"

namespace smoe {
namespace expert_major {

inline layer::GateUp gate_up(const ExpertMajorShape& s, const ExpertMajorWeights& w) {
  switch (s.gate_up) {
    case GateUpLayout::kSeparate: return {w.w1, w.w3, 0, true};
    case GateUpLayout::kConcatenated:
      return {w.w1, w.w1 + static_cast<int64_t>(s.n) * s.d, int64_t{2} * s.n, true};
    case GateUpLayout::kInterleaved: break;
  }
  return {w.w1, nullptr, 0, false};
}

}  // namespace expert_major
}  // namespace smoe
