// PyTorch custom ops over the smoe C++ library (torch.library, schema in TORCH_LIBRARY below).
// Inputs are checked here with messages that name the argument and the rule; the library then
// validates shapes (E, K, d, n limits) with its own messages, before anything is launched.
// Workspaces come from PyTorch's caching allocator; work runs on the current CUDA stream.
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/extension.h>

#include <cstdint>
#include <tuple>
#include <vector>

#include "common.h"
#include "smoe/smoe.h"

namespace {

using namespace smoe_torch;  // common.h: num, dims, throw_if, bytes, pointer casts, device_status

void check_tensor(const at::Tensor& t, const char* name, at::ScalarType dtype, int64_t dim) {
  TORCH_CHECK(t.is_cuda(), "smoe: ", name, " must be a CUDA tensor (got device ", t.device(), ")");
  TORCH_CHECK(t.scalar_type() == dtype, "smoe: ", name, " must have dtype ", dtype, " (got ",
              t.scalar_type(), ")");
  TORCH_CHECK(t.dim() == dim, "smoe: ", name, " must have ", num(dim), " dimensions (got shape ", dims(t.sizes()), ")");
  TORCH_CHECK(t.is_contiguous(), "smoe: ", name, " must be contiguous");
  TORCH_CHECK(reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0, "smoe: ", name,
              " must be 16-byte aligned (a view at an odd offset is not)");
}

// w_router undefined: caller-provided routing (E from w1). w3 defined: gate/up as two tensors,
// w1 (gate) and w3 (up) [E, n, d] each; else w1 [E, 2n, d] interleaved.
smoe::MoEShape layer_shape(const at::Tensor& x, const at::Tensor& w_router, const at::Tensor& w1,
                           const at::Tensor& w2, int64_t top_k, const at::Tensor& w3 = at::Tensor()) {
  TORCH_CHECK(top_k >= 1 && top_k <= smoe::kMaxTopK, "smoe: top_k = ", num(top_k), " must be in [1, ",
              num(smoe::kMaxTopK), "]");
  check_tensor(x, "x", at::kBFloat16, 2);
  check_tensor(w1, "w1", at::kBFloat16, 3);
  check_tensor(w2, "w2", at::kBFloat16, 3);
  const int64_t T = x.size(0), d = x.size(1), E = w1.size(0);
  // Checked before the int casts below (a size of 2^32 + 64 must not run as 64).
  TORCH_CHECK(d <= INT32_MAX && E <= INT32_MAX && w1.size(1) <= INT32_MAX, "smoe: d = ", num(d), ", E = ", num(E),
              " and 2n = ", num(w1.size(1)), " must each fit in int32");
  if (w_router.defined()) {
    check_tensor(w_router, "w_router", at::kBFloat16, 2);
    TORCH_CHECK(w_router.size(0) == E && w_router.size(1) == d, "smoe: w_router must be [E, d] = ", dims({E, d}),
                " (E = w1.size(0), d = x.size(1); got ", dims(w_router.sizes()), ")");
    TORCH_CHECK(x.device() == w_router.device(), "smoe: x and w_router must be on the same device");
  }
  const bool two = w3.defined();
  int64_t n = 0;
  if (two) {
    check_tensor(w3, "w3", at::kBFloat16, 3);
    TORCH_CHECK(w1.size(2) == d && w3.sizes() == w1.sizes(), "smoe: w1 (gate) and w3 (up) must both be [E, n, d] with d = ",
                num(d), " (got ", dims(w1.sizes()), " and ", dims(w3.sizes()), ")");
    TORCH_CHECK(w3.device() == x.device(), "smoe: w3 must be on x's device");
    n = w1.size(1);
  } else {
    TORCH_CHECK(w1.size(0) == E && w1.size(2) == d && w1.size(1) % 2 == 0,
                "smoe: w1 must be [E, 2n, d] (gate/up interleaved) with E = ", num(E), ", d = ", num(d), " (got ",
                dims(w1.sizes()), ")");
    n = w1.size(1) / 2;
  }
  TORCH_CHECK(w2.size(0) == E && w2.size(1) == d && w2.size(2) == n, "smoe: w2 must be [E, d, n] = ",
              dims({E, d, n}), " (got ", dims(w2.sizes()), ")");
  TORCH_CHECK(x.device() == w1.device() && x.device() == w2.device(),
              "smoe: x, w1 and w2 must be on the same device");
  smoe::MoEShape s{T, static_cast<int>(d), static_cast<int>(n), static_cast<int>(E), static_cast<int>(top_k)};
  throw_if(smoe::moe_can_implement(s));
  return s;
}

// rounding: -1 for plain top-K softmax, else a smoe::TokenRoundingMode (0 NR, 1 UP, 2 DOWN, 3 SR).
smoe::MoEShape with_rounding(smoe::MoEShape s, int64_t rounding) {
  TORCH_CHECK(rounding >= -1 && rounding <= 3, "smoe: rounding = ", num(rounding),
              " must be -1 (top-K) or 0..3 (token rounding NR, UP, DOWN, SR)");
  if (rounding >= 0) {
    s.router = smoe::MoERouter::kTokenRounding;
    s.rounding = static_cast<smoe::TokenRoundingMode>(rounding);
  }
  throw_if(smoe::moe_can_implement(s));
  return s;
}

std::tuple<at::Tensor, at::Tensor> forward_impl(const smoe::MoEShape& s, const at::Tensor& x, const at::Tensor& w_router,
                                                const at::Tensor& w1, const at::Tensor& w2, const at::Tensor& expert,
                                                const at::Tensor& scores, uint64_t seed, const at::Tensor& w3) {
  const c10::cuda::CUDAGuard guard(x.device());
  at::Tensor out = at::empty_like(x);
  at::Tensor saved = bytes(static_cast<int64_t>(smoe::moe_saved_state_size(s)), x);
  at::Tensor ws = bytes(static_cast<int64_t>(smoe::moe_forward_workspace_size(s)), x);
  smoe::MoEForwardArgs a;
  a.shape = s;
  a.x = bf16_ptr(x);
  a.weights = {bf16_ptr(w_router), bf16_ptr(w1), bf16_ptr(w2), bf16_ptr(w3)};
  a.out = reinterpret_cast<smoe::bf16*>(out.data_ptr());
  a.saved = saved.data_ptr();
  a.saved_bytes = static_cast<size_t>(saved.numel());
  a.workspace = ws.data_ptr();
  a.workspace_bytes = static_cast<size_t>(ws.numel());
  a.status = device_status(x);
  if (expert.defined()) {
    a.routed_expert = expert.data_ptr<int32_t>();
    a.routed_scores = scores.data_ptr<float>();
  }
  a.rounding_seed = seed;
  throw_if(smoe::moe_forward(a, at::cuda::getCurrentCUDAStream()));
  return {out, saved};
}

// Caller-provided routing: expert [T, K] int32 (-1 = empty slot), scores [T, K] float32.
std::tuple<at::Tensor, at::Tensor> moe_forward_routed(const at::Tensor& x, const at::Tensor& w1, const at::Tensor& w2,
                                                      const at::Tensor& expert, const at::Tensor& scores,
                                                      const c10::optional<at::Tensor>& w3) {
  TORCH_CHECK(expert.dim() == 2, "smoe: expert must be [T, K] int32 (got shape ", dims(expert.sizes()), ")");
  smoe::MoEShape s = layer_shape(x, at::Tensor(), w1, w2, expert.size(1), w3.value_or(at::Tensor()));
  check_tensor(expert, "expert", at::kInt, 2);
  check_tensor(scores, "scores", at::kFloat, 2);
  TORCH_CHECK(expert.size(0) == s.T && scores.sizes() == expert.sizes(), "smoe: expert and scores must both be [T, K] = ",
              dims({s.T, s.K}), " with T = x.size(0) (got ", dims(expert.sizes()), " and ", dims(scores.sizes()), ")");
  TORCH_CHECK(expert.device() == x.device() && scores.device() == x.device(),
              "smoe: expert and scores must be on x's device");
  s.router = smoe::MoERouter::kProvided;
  throw_if(smoe::moe_can_implement(s));
  return forward_impl(s, x, at::Tensor(), w1, w2, expert, scores, 0, w3.value_or(at::Tensor()));
}

std::tuple<at::Tensor, at::Tensor> moe_forward_tr(const at::Tensor& x, const at::Tensor& w_router, const at::Tensor& w1,
                                                  const at::Tensor& w2, int64_t top_k, int64_t rounding, int64_t seed,
                                                  const c10::optional<at::Tensor>& w3) {
  TORCH_CHECK(rounding >= 0, "smoe: moe_forward_tr needs rounding in 0..3 (got ", num(rounding), ")");
  const at::Tensor w3t = w3.value_or(at::Tensor());
  const smoe::MoEShape s = with_rounding(layer_shape(x, w_router, w1, w2, top_k, w3t), rounding);
  return forward_impl(s, x, w_router, w1, w2, at::Tensor(), at::Tensor(), static_cast<uint64_t>(seed), w3t);
}

std::tuple<at::Tensor, at::Tensor> moe_forward(const at::Tensor& x, const at::Tensor& w_router,
                                               const at::Tensor& w1, const at::Tensor& w2, int64_t top_k,
                                               const c10::optional<at::Tensor>& w3) {
  const at::Tensor w3t = w3.value_or(at::Tensor());
  const smoe::MoEShape s = layer_shape(x, w_router, w1, w2, top_k, w3t);
  return forward_impl(s, x, w_router, w1, w2, at::Tensor(), at::Tensor(), 0, w3t);
}

// With w3 (gate/up as two tensors) the weight gradient is one [2, E, n, d] tensor: [0] = dw1 (gate),
// [1] = dw3 (up), each contiguous; the Python autograd hands out the two views (no copy), and the
// ops keep their output count.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> backward_impl(
    const smoe::MoEShape& s, const at::Tensor& dout, const at::Tensor& x, const at::Tensor& w_router,
    const at::Tensor& w1, const at::Tensor& w2, const at::Tensor& saved, const at::Tensor& w3, bool consume_saved) {
  check_tensor(dout, "dout", at::kBFloat16, 2);
  TORCH_CHECK(dout.sizes() == x.sizes(), "smoe: dout must have the shape of x ", dims(x.sizes()), " (got ",
              dims(dout.sizes()), ")");
  TORCH_CHECK(dout.device() == x.device(), "smoe: dout must be on x's device");
  TORCH_CHECK(saved.is_cuda() && saved.device() == x.device() && saved.scalar_type() == at::kByte &&
                  saved.numel() >= static_cast<int64_t>(smoe::moe_saved_state_size(s)),
              "smoe: saved must be the uint8 CUDA tensor returned by the forward op for these shapes");
  const c10::cuda::CUDAGuard guard(x.device());
  const bool provided = s.router == smoe::MoERouter::kProvided;
  const bool two = w3.defined();
  at::Tensor dx = at::empty_like(x), dw2 = at::empty_like(w2);
  at::Tensor dw1 = two ? at::empty({2, w1.size(0), w1.size(1), w1.size(2)}, w1.options()) : at::empty_like(w1);
  at::Tensor dwr = provided ? at::Tensor() : at::empty_like(w_router);
  at::Tensor dscores = provided ? at::empty({s.T, s.K}, x.options().dtype(at::kFloat)) : at::Tensor();
  at::Tensor ws = bytes(static_cast<int64_t>(smoe::moe_backward_workspace_size(s, consume_saved)), x);
  smoe::MoEBackwardArgs a;
  a.consume_saved = consume_saved;
  a.shape = s;
  a.x = bf16_ptr(x);
  a.weights = {bf16_ptr(w_router), bf16_ptr(w1), bf16_ptr(w2), bf16_ptr(w3)};
  a.dout = bf16_ptr(dout);
  a.saved = saved.data_ptr();
  a.saved_bytes = static_cast<size_t>(saved.numel());
  a.dx = reinterpret_cast<smoe::bf16*>(dx.data_ptr());
  a.dw_router = provided ? nullptr : reinterpret_cast<smoe::bf16*>(dwr.data_ptr());
  a.dscores = provided ? dscores.data_ptr<float>() : nullptr;
  a.dw1 = reinterpret_cast<smoe::bf16*>(dw1.data_ptr());
  a.dw3 = two ? reinterpret_cast<smoe::bf16*>(dw1[1].data_ptr()) : nullptr;
  a.dw2 = reinterpret_cast<smoe::bf16*>(dw2.data_ptr());
  a.workspace = ws.data_ptr();
  a.workspace_bytes = static_cast<size_t>(ws.numel());
  // A saved state the forward did not write for these shapes, or one a consume_saved backward spent:
  // NaN gradients and this flag, which smoe_torch.raise_if_nonfinite() reports.
  a.status = device_status(x);
  throw_if(smoe::moe_backward(a, at::cuda::getCurrentCUDAStream()));
  return {dx, dwr, dw1, dw2, dscores};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> moe_backward_routed(
    const at::Tensor& dout, const at::Tensor& x, const at::Tensor& w1, const at::Tensor& w2, const at::Tensor& saved,
    int64_t top_k, const c10::optional<at::Tensor>& w3, bool consume_saved) {
  const at::Tensor w3t = w3.value_or(at::Tensor());
  smoe::MoEShape s = layer_shape(x, at::Tensor(), w1, w2, top_k, w3t);
  s.router = smoe::MoERouter::kProvided;
  throw_if(smoe::moe_can_implement(s));
  auto r = backward_impl(s, dout, x, at::Tensor(), w1, w2, saved, w3t, consume_saved);
  return {std::get<0>(r), std::get<2>(r), std::get<3>(r), std::get<4>(r)};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> moe_backward_tr(
    const at::Tensor& dout, const at::Tensor& x, const at::Tensor& w_router, const at::Tensor& w1,
    const at::Tensor& w2, const at::Tensor& saved, int64_t top_k, int64_t rounding,
    const c10::optional<at::Tensor>& w3, bool consume_saved) {
  TORCH_CHECK(rounding >= 0, "smoe: moe_backward_tr needs rounding in 0..3 (got ", num(rounding), ")");
  const at::Tensor w3t = w3.value_or(at::Tensor());
  const smoe::MoEShape s = with_rounding(layer_shape(x, w_router, w1, w2, top_k, w3t), rounding);
  auto r = backward_impl(s, dout, x, w_router, w1, w2, saved, w3t, consume_saved);
  return {std::get<0>(r), std::get<1>(r), std::get<2>(r), std::get<3>(r)};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> moe_backward(
    const at::Tensor& dout, const at::Tensor& x, const at::Tensor& w_router, const at::Tensor& w1,
    const at::Tensor& w2, const at::Tensor& saved, int64_t top_k, const c10::optional<at::Tensor>& w3,
    bool consume_saved) {
  TORCH_CHECK(w_router.defined(), "smoe: w_router is required");
  const at::Tensor w3t = w3.value_or(at::Tensor());
  const smoe::MoEShape s = layer_shape(x, w_router, w1, w2, top_k, w3t);
  auto r = backward_impl(s, dout, x, w_router, w1, w2, saved, w3t, consume_saved);
  return {std::get<0>(r), std::get<1>(r), std::get<2>(r), std::get<3>(r)};
}

// Top-K softmax routing: (scores [T,K] f32, topk_expert [T,K] i32, expert_frequency [E],
// expert_offset [E+1], scatter_idx [TK], reverse_scatter_idx [TK], gather_idx [TK]) all int32.
std::vector<at::Tensor> topk_routing(const at::Tensor& logits, int64_t top_k) {
  TORCH_CHECK(logits.is_cuda() && logits.dim() == 2 && logits.is_contiguous(),
              "smoe: logits must be a contiguous 2-D CUDA tensor [T, E] (got ", dims(logits.sizes()), ")");
  TORCH_CHECK(logits.scalar_type() == at::kFloat || logits.scalar_type() == at::kBFloat16,
              "smoe: logits must be float32 or bfloat16 (got ", logits.scalar_type(), ")");
  TORCH_CHECK(top_k >= 1 && top_k <= smoe::kMaxTopK, "smoe: top_k = ", num(top_k), " must be in [1, ",
              num(smoe::kMaxTopK), "]");
  TORCH_CHECK(logits.size(1) >= 1 && logits.size(1) <= smoe::kMaxExperts, "smoe: logits.size(1) (E) = ",
              num(logits.size(1)), " must be in [1, ", num(smoe::kMaxExperts), "]");
  smoe::RoutingProblem p{logits.size(0), static_cast<int>(logits.size(1)), static_cast<int>(top_k),
                         logits.scalar_type() == at::kFloat ? smoe::DType::kFloat32 : smoe::DType::kBFloat16};
  throw_if(smoe::routing_can_implement(p));
  const c10::cuda::CUDAGuard guard(logits.device());
  const int64_t T = p.num_tokens, E = p.num_experts, K = p.top_k;
  auto i32 = logits.options().dtype(at::kInt);
  at::Tensor scores = at::empty({T, K}, logits.options().dtype(at::kFloat)), topk = at::empty({T, K}, i32),
             freq = at::empty({E}, i32), off = at::empty({E + 1}, i32), sc = at::empty({T * K}, i32),
             rev = at::empty({T * K}, i32), ga = at::empty({T * K}, i32);
  at::Tensor ws = bytes(static_cast<int64_t>(smoe::routing_workspace_size(p)), logits);
  smoe::RoutingOutputs o{scores.data_ptr<float>(), topk.data_ptr<int32_t>(), freq.data_ptr<int32_t>(),
                         off.data_ptr<int32_t>(),  sc.data_ptr<int32_t>(),   rev.data_ptr<int32_t>(),
                         ga.data_ptr<int32_t>(),   device_status(logits)};
  throw_if(smoe::topk_routing(p, logits.data_ptr(), o, ws.data_ptr(), static_cast<size_t>(ws.numel()),
                              at::cuda::getCurrentCUDAStream()));
  return {scores, topk, freq, off, sc, rev, ga};
}

// Clear the sticky status of like's device (enqueued on the current stream).
void reset_nonfinite_status(const at::Tensor& like) {
  const c10::cuda::CUDAGuard guard(like.device());  // like's device and its current stream
  throw_if(smoe::reset_device_status(device_status(like), at::cuda::getCurrentCUDAStream()));
}

// The device status as a uint8 tensor view (flags u32, nonfinite_tokens u32, first token i64).
at::Tensor nonfinite_status(const at::Tensor& like) {
  smoe::DeviceStatus* s = device_status(like);
  return at::from_blob(s, {static_cast<int64_t>(sizeof(smoe::DeviceStatus))}, like.options().dtype(at::kByte));
}

// router: 0 top-K softmax, 1 token rounding (with `rounding` 0..3), 2 caller-provided.
int64_t saved_state_size(int64_t T, int64_t d, int64_t n, int64_t E, int64_t K, int64_t router, int64_t rounding) {
  smoe::MoEShape s{T, static_cast<int>(d), static_cast<int>(n), static_cast<int>(E), static_cast<int>(K)};
  s.router = static_cast<smoe::MoERouter>(router);
  s.rounding = static_cast<smoe::TokenRoundingMode>(rounding);
  return static_cast<int64_t>(smoe::moe_saved_state_size(s));
}

// The rows each expert received in a forward (int32 [E]), a view into its saved state: the aux
// loss and expert-bias updates read the routing's own counts instead of redoing the top-K.
at::Tensor saved_expert_frequency(const at::Tensor& saved, int64_t T, int64_t d, int64_t n, int64_t E, int64_t K,
                                  int64_t router, int64_t rounding) {
  smoe::MoEShape s{T, static_cast<int>(d), static_cast<int>(n), static_cast<int>(E), static_cast<int>(K)};
  s.router = static_cast<smoe::MoERouter>(router);
  s.rounding = static_cast<smoe::TokenRoundingMode>(rounding);
  throw_if(smoe::moe_can_implement(s));
  TORCH_CHECK(saved.is_cuda() && saved.scalar_type() == at::kByte &&
                  saved.numel() >= static_cast<int64_t>(smoe::moe_saved_state_size(s)),
              "smoe: saved must be the uint8 CUDA tensor of a forward with these shapes");
  const smoe::MoESavedView v = smoe::moe_saved_state_view(s, saved.data_ptr());
  const int64_t off = reinterpret_cast<char*>(v.expert_frequency) - static_cast<char*>(saved.data_ptr());
  return saved.narrow(0, off, 4 * E).view(at::kInt);
}

// smoe::moe_init on like's device (call before capturing the layer in a CUDA graph).
void init(const at::Tensor& like) {
  const c10::cuda::CUDAGuard guard(like.device());
  throw_if(smoe::moe_init());
}

int64_t token_rounding_tile() { return smoe::moe_token_rounding_tile(smoe::MoEShape{}); }

}  // namespace

TORCH_LIBRARY(smoe, m) {
  // w3 (optional, last): gate/up as two tensors, w1 (gate) and w3 (up) [E, n, d]; the backward's
  // weight gradient is then [2, E, n, d] (dw1, dw3). Without it w1 is [E, 2n, d] interleaved.
  m.def("moe_forward(Tensor x, Tensor w_router, Tensor w1, Tensor w2, int top_k, Tensor? w3=None) -> (Tensor, Tensor)");
  // consume_saved (last; eager only): the backward writes dH over the saved H and spends the state
  // (smoe::MoEBackwardArgs::consume_saved), H's bytes less workspace. The schema does not mark saved
  // as written: the autograd functions (_ops.py) pass it only outside any trace, when autograd frees
  // the saved state right after (the graph not kept: no retain_graph), so no traced graph ever holds it.
  m.def("moe_backward(Tensor dout, Tensor x, Tensor w_router, Tensor w1, Tensor w2, Tensor saved, "
        "int top_k, Tensor? w3=None, bool consume_saved=False) -> (Tensor, Tensor, Tensor, Tensor)");
  m.def("topk_routing(Tensor logits, int top_k) -> Tensor[]");
  m.def("moe_forward_routed(Tensor x, Tensor w1, Tensor w2, Tensor expert, Tensor scores, Tensor? w3=None) "
        "-> (Tensor, Tensor)");
  m.def("moe_backward_routed(Tensor dout, Tensor x, Tensor w1, Tensor w2, Tensor saved, int top_k, Tensor? w3=None, "
        "bool consume_saved=False) -> (Tensor, Tensor, Tensor, Tensor)");
  m.def("moe_forward_tr(Tensor x, Tensor w_router, Tensor w1, Tensor w2, int top_k, int rounding, int seed, "
        "Tensor? w3=None) -> (Tensor, Tensor)");
  m.def("moe_backward_tr(Tensor dout, Tensor x, Tensor w_router, Tensor w1, Tensor w2, Tensor saved, int top_k, "
        "int rounding, Tensor? w3=None, bool consume_saved=False) -> (Tensor, Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(smoe, CUDA, m) {
  m.impl("moe_forward", &moe_forward);
  m.impl("moe_backward", &moe_backward);
  m.impl("topk_routing", &topk_routing);
  m.impl("moe_forward_routed", &moe_forward_routed);
  m.impl("moe_backward_routed", &moe_backward_routed);
  m.impl("moe_forward_tr", &moe_forward_tr);
  m.impl("moe_backward_tr", &moe_backward_tr);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("saved_state_size", &saved_state_size, "bytes the forward keeps for backward",
        pybind11::arg("T"), pybind11::arg("d"), pybind11::arg("n"), pybind11::arg("E"), pybind11::arg("K"),
        pybind11::arg("router") = 0, pybind11::arg("rounding") = 0);
  m.def("token_rounding_tile", &token_rounding_tile, "the M tile token rounding rounds to");
  m.def("init", &init, "smoe::moe_init on like's device (needed before CUDA-graph capture)");
  m.def("reset_nonfinite_status", &reset_nonfinite_status, "clear the sticky device status of like's device");
  m.def("saved_expert_frequency", &saved_expert_frequency, "rows per expert of a forward (int32 [E] view of saved)");
  m.def("nonfinite_status", &nonfinite_status, "the sticky device status of like's device (uint8[16])");
}
