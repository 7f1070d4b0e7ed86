// PyTorch custom ops over the expert-major MoE layer (smoe/expert_major.h): rows already grouped by
// expert, per-expert counts on the device, optional per-row probabilities. Part of smoe_torch._C
// (ops.cpp holds TORCH_LIBRARY(smoe); this file adds a fragment). Conventions as ops.cpp: inputs
// checked here with messages naming the argument and the rule, then the library's own shape rules
// (expert_major_can_implement) before anything is launched; workspaces from PyTorch's caching
// allocator; work on the current CUDA stream of x's device; no host sync.
//
//   expert_major_fwd(x [R,d] bf16, counts [E] i32, segment_offset [E+1] i32 | None, probs [R] f32 | None,
//                    w1, w3 | None, w2 [E,d,n] bf16, gate_up) -> (out [R,d] bf16, saved uint8)
//       gate_up (smoe::GateUpLayout): 0 interleaved (w1 [E,2n,d], rows 2j gate / 2j+1 up),
//       1 separate (w1 gate, w3 up, [E,n,d] each), 2 concatenated (w1 [E,2n,d], gate rows first)
//   expert_major_bwd(dout, x, probs | None, w1, w3 | None, w2, saved, gate_up, segmented, consume_saved=False)
//       -> (dx [R,d], dw1 like w1, dw3 like w3 | None, dw2 [E,d,n], dprobs [R] f32 | None)
//       consume_saved (eager only, as the token-major ops' in ops.cpp): dH written over the saved H
//   expert_major_status(like) -> uint8[16]: a copy of this layer's sticky DeviceStatus of like's device
//   expert_major_reset_status(like) -> (): clears it (enqueued on the current stream)
//
// The device status: the forward passes a sticky per-device DeviceStatus record (required by the
// API: a bad count / segment offset sets kStatusInvalidCounts there and makes every output NaN),
// exactly as ops.cpp does for the token-major forward: nothing reads it here (no sync); Python reads
// it when asked (smoe_torch.expert_major.raise_if_expert_major_error, one sync). The backward passes
// the same record (optional in the API: a bad saved state, kStatusBadSavedState). It is the one record
// of smoe_torch._C (common.h), shared with the token-major ops, so smoe_torch.raise_if_nonfinite sees
// these flags too; expert_major_status / _reset_status read and clear that same record.
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <tuple>

#include "common.h"
#include "smoe/expert_major.h"

namespace {

using namespace smoe_torch;  // common.h: num, dims, throw_if, bytes, pointer casts, device_status

// Devices and dtypes are formatted with c10 strings, never with iostreams (common.h says why).
std::string dev(const at::Tensor& t) { return t.device().str(); }
std::string dt(at::ScalarType s) { return c10::toString(s); }

constexpr const char* kPre = "smoe: expert_major: ";

// align: the bytes the library needs (16 for the bf16 row / weight tensors, 4 for counts,
// segment_offset, probs). An empty tensor (R = 0) has a null pointer, which passes.
void check_tensor(const at::Tensor& t, const char* name, at::ScalarType dtype, int64_t dim, size_t align) {
  TORCH_CHECK(t.is_cuda(), kPre, name, " must be a CUDA tensor (got device ", dev(t), ")");
  TORCH_CHECK(t.scalar_type() == dtype, kPre, name, " must have dtype ", dt(dtype), " (got ", dt(t.scalar_type()),
              ")");
  TORCH_CHECK(t.dim() == dim, kPre, name, " must have ", num(dim), " dimensions (got shape ", dims(t.sizes()), ")");
  TORCH_CHECK(t.is_contiguous(), kPre, name, " must be contiguous (got strides ", dims(t.strides()), ")");
  TORCH_CHECK(reinterpret_cast<uintptr_t>(t.data_ptr()) % align == 0, kPre, name, " must be ", num(align),
              "-byte aligned (a view at an odd offset is not)");
}

void check_same_device(const at::Tensor& t, const char* name, const at::Tensor& x) {
  TORCH_CHECK(t.device() == x.device(), kPre, name, " must be on x's device ", dev(x), " (got ", dev(t), ")");
}

const char* layout_name(int64_t g) {
  return g == 0 ? "interleaved" : g == 1 ? "separate" : "concatenated";
}

// The layer's shape from x, the weights, probs and the layout (every tensor checked, w3 given exactly
// for the separate layout), then expert_major_can_implement (d, n multiples of 64, E in [1, 512], R < 2^31).
smoe::ExpertMajorShape layer_shape(const at::Tensor& x, const at::Tensor& probs, const at::Tensor& w1,
                                   const at::Tensor& w3, const at::Tensor& w2, int64_t gate_up, bool segmented) {
  TORCH_CHECK(gate_up >= 0 && gate_up <= 2, kPre, "gate_up = ", num(gate_up),
              " must be 0 (interleaved), 1 (separate) or 2 (concatenated)");
  const bool separate = gate_up == static_cast<int64_t>(smoe::GateUpLayout::kSeparate);
  check_tensor(x, "x", at::kBFloat16, 2, 16);
  check_tensor(w1, "w1", at::kBFloat16, 3, 16);
  check_tensor(w2, "w2", at::kBFloat16, 3, 16);
  check_same_device(w1, "w1", x);
  check_same_device(w2, "w2", x);
  const int64_t R = x.size(0), d = x.size(1), E = w1.size(0);
  int64_t n = 0;
  if (separate) {
    TORCH_CHECK(w3.defined(), kPre, "w3 (up) is required with gate_up = 1 (separate: w1 gate, w3 up, [E, n, d] each)");
    check_tensor(w3, "w3", at::kBFloat16, 3, 16);
    check_same_device(w3, "w3", x);
    TORCH_CHECK(w1.size(2) == d, kPre, "w1 (gate) must be [E, n, d] with d = x.size(1) = ", num(d), " (got ",
                dims(w1.sizes()), ")");
    TORCH_CHECK(w3.sizes() == w1.sizes(), kPre, "w3 (up) must have the shape of w1 (gate) ", dims(w1.sizes()),
                " (got ", dims(w3.sizes()), ")");
    n = w1.size(1);
  } else {
    TORCH_CHECK(!w3.defined(), kPre, "w3 must be None with gate_up = ", num(gate_up), " (", layout_name(gate_up),
                ": w1 [E, 2n, d] holds gate and up)");
    TORCH_CHECK(w1.size(2) == d && w1.size(1) % 2 == 0, kPre, "w1 must be [E, 2n, d] (", layout_name(gate_up),
                " gate/up) with d = x.size(1) = ", num(d), " (got ", dims(w1.sizes()), ")");
    n = w1.size(1) / 2;
  }
  TORCH_CHECK(w2.size(0) == E && w2.size(1) == d && w2.size(2) == n, kPre, "w2 must be [E, d, n] = ",
              dims({E, d, n}), " (E = w1.size(0), d = x.size(1), n from w1; got ", dims(w2.sizes()), ")");
  if (probs.defined()) {
    check_tensor(probs, "probs", at::kFloat, 1, 4);
    check_same_device(probs, "probs", x);
    TORCH_CHECK(probs.size(0) == R, kPre, "probs must be [R] = ", dims({R}), " with R = x.size(0) (got ",
                dims(probs.sizes()), ")");
  }
  // Before the int casts (a size of 2^32 + 64 must not run as 64).
  TORCH_CHECK(d <= INT32_MAX && n <= INT32_MAX && E <= INT32_MAX, kPre, "d = ", num(d), ", n = ", num(n),
              " and E = ", num(E), " must each fit in int32");
  smoe::ExpertMajorShape s;
  s.rows = R;
  s.d = static_cast<int>(d);
  s.n = static_cast<int>(n);
  s.E = static_cast<int>(E);
  s.gate_up = static_cast<smoe::GateUpLayout>(gate_up);
  s.probs = probs.defined();
  s.segmented = segmented;
  throw_if(smoe::expert_major_can_implement(s));
  return s;
}

std::tuple<at::Tensor, at::Tensor> expert_major_fwd(const at::Tensor& x, const at::Tensor& counts,
                                                    const c10::optional<at::Tensor>& segment_offset,
                                                    const c10::optional<at::Tensor>& probs, const at::Tensor& w1,
                                                    const c10::optional<at::Tensor>& w3, const at::Tensor& w2,
                                                    int64_t gate_up) {
  const at::Tensor so = segment_offset.value_or(at::Tensor());
  const at::Tensor pr = probs.value_or(at::Tensor());
  const at::Tensor w3t = w3.value_or(at::Tensor());
  const smoe::ExpertMajorShape s = layer_shape(x, pr, w1, w3t, w2, gate_up, so.defined());
  check_tensor(counts, "counts", at::kInt, 1, 4);
  check_same_device(counts, "counts", x);
  TORCH_CHECK(counts.size(0) == s.E, kPre, "counts must be [E] = ", dims({int64_t{s.E}}), " with E = w1.size(0) (got ",
              dims(counts.sizes()), ")");
  if (so.defined()) {
    check_tensor(so, "segment_offset", at::kInt, 1, 4);
    check_same_device(so, "segment_offset", x);
    TORCH_CHECK(so.size(0) == int64_t{s.E} + 1, kPre, "segment_offset must be [E + 1] = ", dims({int64_t{s.E} + 1}),
                " with E = w1.size(0) (got ", dims(so.sizes()), ")");
  }
  const c10::cuda::CUDAGuard guard(x.device());
  at::Tensor out = at::empty_like(x);
  at::Tensor saved = bytes(static_cast<int64_t>(smoe::expert_major_saved_state_size(s)), x);
  at::Tensor ws = bytes(static_cast<int64_t>(smoe::expert_major_forward_workspace_size(s)), x);
  smoe::ExpertMajorForwardArgs a;
  a.shape = s;
  a.x = bf16_ptr(x);
  a.counts = counts.data_ptr<int32_t>();
  a.segment_offset = so.defined() ? so.data_ptr<int32_t>() : nullptr;
  a.probs = pr.defined() ? pr.data_ptr<float>() : nullptr;
  a.weights.w1 = bf16_ptr(w1);
  a.weights.w3 = bf16_ptr(w3t);
  a.weights.w2 = bf16_ptr(w2);
  a.out = bf16_out(out);
  a.saved = saved.data_ptr();
  a.saved_bytes = static_cast<size_t>(saved.numel());
  a.workspace = ws.data_ptr();
  a.workspace_bytes = static_cast<size_t>(ws.numel());
  a.status = device_status(x);
  throw_if(smoe::expert_major_forward(a, at::cuda::getCurrentCUDAStream()));
  return {out, saved};
}

std::tuple<at::Tensor, at::Tensor, c10::optional<at::Tensor>, at::Tensor, c10::optional<at::Tensor>>
expert_major_bwd(const at::Tensor& dout, const at::Tensor& x, const c10::optional<at::Tensor>& probs,
                 const at::Tensor& w1, const c10::optional<at::Tensor>& w3, const at::Tensor& w2,
                 const at::Tensor& saved, int64_t gate_up, bool segmented, bool consume_saved) {
  const at::Tensor pr = probs.value_or(at::Tensor());
  const at::Tensor w3t = w3.value_or(at::Tensor());
  const smoe::ExpertMajorShape s = layer_shape(x, pr, w1, w3t, w2, gate_up, segmented);
  check_tensor(dout, "dout", at::kBFloat16, 2, 16);
  check_same_device(dout, "dout", x);
  TORCH_CHECK(dout.sizes() == x.sizes(), kPre, "dout must have the shape of x ", dims(x.sizes()), " (got ",
              dims(dout.sizes()), ")");
  const size_t saved_size = smoe::expert_major_saved_state_size(s);
  TORCH_CHECK(saved.is_cuda() && saved.device() == x.device() && saved.scalar_type() == at::kByte &&
                  saved.dim() == 1 && saved.is_contiguous() && saved.numel() >= static_cast<int64_t>(saved_size),
              kPre, "saved must be the uint8 CUDA tensor returned by expert_major_fwd for these shapes (",
              num(static_cast<int64_t>(saved_size)), " bytes on ", dev(x), "; got ", dt(saved.scalar_type()), " ",
              dims(saved.sizes()), " on ", dev(saved), ")");
  const c10::cuda::CUDAGuard guard(x.device());
  const bool separate = s.gate_up == smoe::GateUpLayout::kSeparate;
  at::Tensor dx = at::empty_like(x), dw1 = at::empty_like(w1), dw2 = at::empty_like(w2);
  at::Tensor dw3 = separate ? at::empty_like(w3t) : at::Tensor();
  at::Tensor dprobs = s.probs ? at::empty({s.rows}, x.options().dtype(at::kFloat)) : at::Tensor();
  at::Tensor ws = bytes(static_cast<int64_t>(smoe::expert_major_backward_workspace_size(s, consume_saved)), x);
  smoe::ExpertMajorBackwardArgs a;
  a.consume_saved = consume_saved;
  a.shape = s;
  a.x = bf16_ptr(x);
  a.probs = pr.defined() ? pr.data_ptr<float>() : nullptr;
  a.weights.w1 = bf16_ptr(w1);
  a.weights.w3 = bf16_ptr(w3t);
  a.weights.w2 = bf16_ptr(w2);
  a.dout = bf16_ptr(dout);
  a.saved = saved.data_ptr();
  a.saved_bytes = static_cast<size_t>(saved.numel());
  a.dx = bf16_out(dx);
  a.dw1 = bf16_out(dw1);
  a.dw3 = bf16_out(dw3);
  a.dw2 = bf16_out(dw2);
  a.dprobs = dprobs.defined() ? dprobs.data_ptr<float>() : nullptr;
  a.workspace = ws.data_ptr();
  a.workspace_bytes = static_cast<size_t>(ws.numel());
  a.status = device_status(x);
  throw_if(smoe::expert_major_backward(a, at::cuda::getCurrentCUDAStream()));
  c10::optional<at::Tensor> dw3_out, dprobs_out;
  if (dw3.defined()) dw3_out = dw3;
  if (dprobs.defined()) dprobs_out = dprobs;
  return {dx, dw1, dw3_out, dw2, dprobs_out};
}

// A copy (enqueued on the current stream) of the status record of like's device (common.h):
// flags u32 (kStatusInvalidCounts = 32, kStatusBadSavedState = 16), u32, i64 (unused here).
at::Tensor expert_major_status(const at::Tensor& like) {
  TORCH_CHECK(like.is_cuda(), kPre, "like must be a CUDA tensor (got device ", dev(like), ")");
  const c10::cuda::CUDAGuard guard(like.device());
  smoe::DeviceStatus* s = device_status(like);
  return at::from_blob(s, {static_cast<int64_t>(sizeof(smoe::DeviceStatus))}, like.options().dtype(at::kByte))
      .clone();
}

void expert_major_reset_status(const at::Tensor& like) {
  TORCH_CHECK(like.is_cuda(), kPre, "like must be a CUDA tensor (got device ", dev(like), ")");
  const c10::cuda::CUDAGuard guard(like.device());
  throw_if(smoe::reset_device_status(device_status(like), at::cuda::getCurrentCUDAStream()));
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(smoe, m) {
  m.def("expert_major_fwd(Tensor x, Tensor counts, Tensor? segment_offset, Tensor? probs, Tensor w1, Tensor? w3, "
        "Tensor w2, int gate_up) -> (Tensor out, Tensor saved)");
  m.def("expert_major_bwd(Tensor dout, Tensor x, Tensor? probs, Tensor w1, Tensor? w3, Tensor w2, Tensor saved, "
        "int gate_up, bool segmented, bool consume_saved=False) "
        "-> (Tensor dx, Tensor dw1, Tensor? dw3, Tensor dw2, Tensor? dprobs)");
  m.def("expert_major_status(Tensor like) -> Tensor");
  m.def("expert_major_reset_status(Tensor like) -> ()");
}

TORCH_LIBRARY_IMPL(smoe, CUDA, m) {
  m.impl("expert_major_fwd", &expert_major_fwd);
  m.impl("expert_major_bwd", &expert_major_bwd);
  m.impl("expert_major_status", &expert_major_status);
  m.impl("expert_major_reset_status", &expert_major_reset_status);
}
