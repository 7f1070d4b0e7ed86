// The expert-major layer's host side: shape rules, sizes and the argument rules of forward and
// backward (smoe/expert_major.h). Everything here is host arithmetic and runs before any CUDA call.
#include "common/check.h"
#include "expert_major/plan.h"
#include "expert_major/rules.h"
#include "moe/layer_common.h"
#include "smoe/expert_major.h"

namespace smoe {

namespace {

constexpr int64_t kMaxRows = (int64_t{1} << 31) - 1;

Status bad(const char* fn, const std::string& what) {
  return detail::make_status(StatusCode::kInvalidArgument, detail::concat(fn, ": ", what));
}

// A pointer a shape flag asks for: given (and aligned) exactly when `wanted`, null otherwise;
// `may_be_null` lets a wanted row tensor be null when there are no rows.
Status check_wanted(const char* fn, bool wanted, bool may_be_null, const void* p, const char* name, size_t align,
                    const char* when) {
  if (!wanted) {
    if (p != nullptr) return bad(fn, detail::concat(name, " must be null unless ", when));
    return Status{};
  }
  if (may_be_null && p == nullptr) return Status{};
  return detail::check_ptr(p, fn, name, align);
}

bool separate(const ExpertMajorShape& s) { return s.gate_up == GateUpLayout::kSeparate; }

// Bytes of the layer's tensors (the shape passed expert_major_can_implement: no product overflows).
struct Bytes {
  size_t rows;   // x, out, dout, dx: [R][d]
  size_t w1;     // [E][2n][d], or each of gate / up [E][n][d] when separate
  size_t w2;     // [E][d][n]
  size_t probs;  // [R] fp32 when given
  size_t E;      // counts [E] int32
  explicit Bytes(const ExpertMajorShape& s)
      : rows(static_cast<size_t>(s.rows) * s.d * 2),
        w1(static_cast<size_t>(s.E) * (separate(s) ? 1 : 2) * s.n * s.d * 2),
        w2(static_cast<size_t>(s.E) * s.d * s.n * 2),
        probs(s.probs ? static_cast<size_t>(s.rows) * 4 : 0),
        E(static_cast<size_t>(s.E) * 4) {}
};

// The rules forward and backward share: the shape, x, the weights, probs.
Status check_common(const char* fn, const ExpertMajorShape& s, const bf16* x, const float* probs,
                    const ExpertMajorWeights& w) {
  SMOE_RETURN_IF_ERROR(expert_major_can_implement(s));
  if (s.rows > 0) SMOE_RETURN_IF_ERROR(detail::check_ptr(x, fn, "x", 16));
  SMOE_RETURN_IF_ERROR(detail::check_ptr(w.w1, fn, "weights.w1", 16));
  SMOE_RETURN_IF_ERROR(detail::check_ptr(w.w2, fn, "weights.w2", 16));
  SMOE_RETURN_IF_ERROR(check_wanted(fn, separate(s), false, w.w3, "weights.w3", 16,
                                    "shape.gate_up is GateUpLayout::kSeparate (else w1 holds gate and up)"));
  return check_wanted(fn, s.probs, s.rows == 0, probs, "probs", 4, "shape.probs is set");
}

}  // namespace

Status expert_major_can_implement(const ExpertMajorShape& s) {
  const char* fn = "expert_major";
  if (s.rows < 0 || s.rows > kMaxRows) return bad(fn, detail::concat("shape.rows = ", s.rows, " must be in [0, 2^31)"));
  if (s.d <= 0 || s.d % 64 != 0) return bad(fn, detail::concat("shape.d = ", s.d, " must be a positive multiple of 64"));
  if (s.n <= 0 || s.n % 64 != 0) return bad(fn, detail::concat("shape.n = ", s.n, " must be a positive multiple of 64"));
  if (s.E < 1 || s.E > kMaxExperts)
    return bad(fn, detail::concat("shape.E = ", s.E, " must be in [1, ", kMaxExperts, "]"));
  const int gu = static_cast<int>(s.gate_up);
  if (gu < 0 || gu > static_cast<int>(GateUpLayout::kConcatenated))
    return bad(fn, detail::concat("shape.gate_up = ", gu, " is not a GateUpLayout"));
  // TMA coordinates of the weight tensors are 32-bit: E * 2n rows of W1, E * d rows of W2.
  if (int64_t{s.E} * 2 * s.n > kMaxRows || int64_t{s.E} * s.d > kMaxRows)
    return bad(fn, "shape.E * 2n and shape.E * d must be < 2^31 (weight rows)");
  return Status{};
}

size_t expert_major_saved_state_size(const ExpertMajorShape& s) {
  return expert_major_can_implement(s).ok() ? expert_major::saved_layout(s, nullptr).bytes : 0;
}
size_t expert_major_forward_workspace_size(const ExpertMajorShape& s) {
  return expert_major_can_implement(s).ok() ? expert_major::forward_ws(s, nullptr).total : 0;
}
size_t expert_major_backward_workspace_size(const ExpertMajorShape& s, bool consume_saved) {
  return expert_major_can_implement(s).ok() ? expert_major::backward_ws(s, nullptr, consume_saved).total : 0;
}

namespace expert_major {

Status check_forward(const ExpertMajorForwardArgs& a) {
  const char* fn = "expert_major_forward";
  const ExpertMajorShape& s = a.shape;
  SMOE_RETURN_IF_ERROR(check_common(fn, s, a.x, a.probs, a.weights));
  SMOE_RETURN_IF_ERROR(detail::check_ptr(a.counts, fn, "counts", 4));
  SMOE_RETURN_IF_ERROR(
      check_wanted(fn, s.segmented, false, a.segment_offset, "segment_offset", 4, "shape.segmented is set"));
  if (s.rows > 0) SMOE_RETURN_IF_ERROR(detail::check_ptr(a.out, fn, "out", 16));
  SMOE_RETURN_IF_ERROR(layer::check_buffer(a.saved, a.saved_bytes, expert_major_saved_state_size(s), fn, "saved",
                                           "saved_bytes", "expert_major_saved_state_size"));
  SMOE_RETURN_IF_ERROR(layer::check_buffer(a.workspace, a.workspace_bytes, expert_major_forward_workspace_size(s), fn,
                                           "workspace", "workspace_bytes", "expert_major_forward_workspace_size"));
  SMOE_RETURN_IF_ERROR(detail::check_ptr(a.status, fn, "status", 8));
  const Bytes b(s);
  SMOE_RETURN_IF_ERROR(layer::check_disjoint(
      fn,
      {{a.out, b.rows, "out"},
       {a.saved, a.saved_bytes, "saved"},
       {a.workspace, a.workspace_bytes, "workspace"},
       {a.status, sizeof(DeviceStatus), "status"}},
      {{a.x, b.rows, "x"},
       {a.counts, b.E, "counts"},
       {a.segment_offset, s.segmented ? b.E + 4 : 0, "segment_offset"},
       {a.probs, b.probs, "probs"},
       {a.weights.w1, b.w1, "weights.w1"},
       {a.weights.w3, separate(s) ? b.w1 : 0, "weights.w3"},
       {a.weights.w2, b.w2, "weights.w2"}}));
  return Status{};
}

Status check_backward(const ExpertMajorBackwardArgs& a) {
  const char* fn = "expert_major_backward";
  const ExpertMajorShape& s = a.shape;
  SMOE_RETURN_IF_ERROR(check_common(fn, s, a.x, a.probs, a.weights));
  if (s.rows > 0) {
    SMOE_RETURN_IF_ERROR(detail::check_ptr(a.dout, fn, "dout", 16));
    SMOE_RETURN_IF_ERROR(detail::check_ptr(a.dx, fn, "dx", 16));
  }
  SMOE_RETURN_IF_ERROR(detail::check_ptr(a.dw1, fn, "dw1", 16));
  SMOE_RETURN_IF_ERROR(detail::check_ptr(a.dw2, fn, "dw2", 16));
  SMOE_RETURN_IF_ERROR(check_wanted(fn, separate(s), false, a.dw3, "dw3", 16,
                                    "shape.gate_up is GateUpLayout::kSeparate (else dw1 holds gate and up)"));
  SMOE_RETURN_IF_ERROR(check_wanted(fn, s.probs, s.rows == 0, a.dprobs, "dprobs", 4, "shape.probs is set"));
  SMOE_RETURN_IF_ERROR(layer::check_buffer(a.saved, a.saved_bytes, expert_major_saved_state_size(s), fn, "saved",
                                           "saved_bytes", "expert_major_saved_state_size"));
  SMOE_RETURN_IF_ERROR(layer::check_buffer(a.workspace, a.workspace_bytes,
                                           expert_major_backward_workspace_size(s, a.consume_saved), fn,
                                           "workspace", "workspace_bytes", "expert_major_backward_workspace_size"));
  if (a.status != nullptr) SMOE_RETURN_IF_ERROR(detail::check_ptr(a.status, fn, "status", 8));
  const Bytes b(s);
  SMOE_RETURN_IF_ERROR(layer::check_disjoint(
      fn,
      {{a.dx, b.rows, "dx"},
       {a.dw1, b.w1, "dw1"},
       {a.dw3, separate(s) ? b.w1 : 0, "dw3"},
       {a.dw2, b.w2, "dw2"},
       {a.dprobs, b.probs, "dprobs"},
       {a.workspace, a.workspace_bytes, "workspace"},
       {a.status, a.status ? sizeof(DeviceStatus) : 0, "status"},
       // consume_saved writes the saved state: then it is an output, disjoint from the inputs too.
       {a.consume_saved ? a.saved : nullptr, a.consume_saved ? a.saved_bytes : 0, "saved (consume_saved)"}},
      {{a.x, b.rows, "x"},
       {a.probs, b.probs, "probs"},
       {a.dout, b.rows, "dout"},
       {a.consume_saved ? nullptr : a.saved, a.consume_saved ? 0 : a.saved_bytes, "saved"},
       {a.weights.w1, b.w1, "weights.w1"},
       {a.weights.w3, separate(s) ? b.w1 : 0, "weights.w3"},
       {a.weights.w2, b.w2, "weights.w2"}}));
  return Status{};
}

}  // namespace expert_major
}  // namespace smoe
