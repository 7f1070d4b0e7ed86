// PyTorch custom ops over the smoe C++ library (torch.library, schema in TORCH_LIBRARY below).
// Inputs are checked here with messages that name the argument and the rule; the library then
// validates shapes (E, K, d, n limits) with its own messages, before anything is launched.
// Workspaces come from PyTorch's caching allocator; work runs on the current CUDA stream.
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/extension.h>

#include <cstdint>
#include <mutex>
#include <tuple>
#include <vector>

#include "smoe/smoe.h"

namespace {

// Numbers and shapes are formatted with std::to_string, never with iostreams: built on the GPU
// machine, this extension crashed formatting an integer through the process's locale (a
// libstdc++ mismatch between the build toolchain and the one Python loads).
std::string num(int64_t v) { return std::to_string(v); }
std::string dims(at::IntArrayRef a) {
  std::string s = "[";
  for (size_t i = 0; i < a.size(); ++i) s += (i ? ", " : "") + std::to_string(a[i]);
  return s + "]";
}

void check_tensor(const at::Tensor& t, const char* name, at::ScalarType dtype, int64_t dim) {
  TORCH_CHECK(t.is_cuda(), "smoe: ", name, " must be a CUDA tensor (got device ", t.device(), ")");
  TORCH_CHECK(t.scalar_type() == dtype, "smoe: ", name, " must have dtype ", dtype, " (got ",
              t.scalar_type(), ")");
  TORCH_CHECK(t.dim() == dim, "smoe: ", name, " must have ", num(dim), " dimensions (got shape ", dims(t.sizes()), ")");
  TORCH_CHECK(t.is_contiguous(), "smoe: ", name, " must be contiguous");
  TORCH_CHECK(reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0, "smoe: ", name,
              " must be 16-byte aligned (a view at an odd offset is not)");
}

void throw_if(const smoe::Status& s) {
  TORCH_CHECK(s.ok(), "smoe: ", s.message, " [", smoe::status_code_name(s.code), "]");
}

smoe::MoEShape layer_shape(const at::Tensor& x, const at::Tensor& w_router, const at::Tensor& w1,
                           const at::Tensor& w2, int64_t top_k) {
  TORCH_CHECK(top_k >= 1 && top_k <= smoe::kMaxTopK, "smoe: top_k = ", num(top_k), " must be in [1, ",
              num(smoe::kMaxTopK), "]");
  check_tensor(x, "x", at::kBFloat16, 2);
  check_tensor(w_router, "w_router", at::kBFloat16, 2);
  check_tensor(w1, "w1", at::kBFloat16, 3);
  check_tensor(w2, "w2", at::kBFloat16, 3);
  const int64_t T = x.size(0), d = x.size(1), E = w_router.size(0);
  TORCH_CHECK(w_router.size(1) == d, "smoe: w_router must be [E, d] with d = x.size(1) = ", num(d), " (got ",
              dims(w_router.sizes()), ")");
  TORCH_CHECK(w1.size(0) == E && w1.size(2) == d && w1.size(1) % 2 == 0,
              "smoe: w1 must be [E, 2n, d] (gate/up interleaved) with E = ", num(E), ", d = ", num(d), " (got ",
              dims(w1.sizes()), ")");
  const int64_t n = w1.size(1) / 2;
  TORCH_CHECK(w2.size(0) == E && w2.size(1) == d && w2.size(2) == n, "smoe: w2 must be [E, d, n] = ",
              dims({E, d, n}), " (got ", dims(w2.sizes()), ")");
  TORCH_CHECK(x.device() == w_router.device() && x.device() == w1.device() && x.device() == w2.device(),
              "smoe: x, w_router, w1 and w2 must be on the same device");
  smoe::MoEShape s{T, static_cast<int>(d), static_cast<int>(n), static_cast<int>(E), static_cast<int>(top_k)};
  throw_if(smoe::moe_can_implement(s));
  return s;
}

at::Tensor bytes(int64_t n, const at::Tensor& like) {
  return at::empty({std::max<int64_t>(n, 1)}, like.options().dtype(at::kByte));
}

// One sticky numerical status per device, read with smoe::nonfinite_status().
smoe::DeviceStatus* device_status(const at::Tensor& like) {
  static std::mutex mu;
  static std::vector<at::Tensor> per_device(64);
  std::lock_guard<std::mutex> lock(mu);
  const int dev = like.get_device();
  TORCH_CHECK(dev >= 0 && dev < 64, "smoe: device index out of range");
  if (!per_device[dev].defined()) {
    per_device[dev] = at::empty({static_cast<int64_t>(sizeof(smoe::DeviceStatus))}, like.options().dtype(at::kByte));
    throw_if(smoe::reset_device_status(reinterpret_cast<smoe::DeviceStatus*>(per_device[dev].data_ptr()),
                                       at::cuda::getCurrentCUDAStream()));
  }
  return reinterpret_cast<smoe::DeviceStatus*>(per_device[dev].data_ptr());
}

std::tuple<at::Tensor, at::Tensor> moe_forward(const at::Tensor& x, const at::Tensor& w_router,
                                               const at::Tensor& w1, const at::Tensor& w2, int64_t top_k) {
  const smoe::MoEShape s = layer_shape(x, w_router, w1, w2, top_k);
  const c10::cuda::CUDAGuard guard(x.device());
  at::Tensor out = at::empty_like(x);
  at::Tensor saved = bytes(static_cast<int64_t>(smoe::moe_saved_state_size(s)), x);
  at::Tensor ws = bytes(static_cast<int64_t>(smoe::moe_forward_workspace_size(s)), x);
  smoe::MoEForwardArgs a;
  a.shape = s;
  a.x = reinterpret_cast<const smoe::bf16*>(x.data_ptr());
  a.weights = {reinterpret_cast<const smoe::bf16*>(w_router.data_ptr()),
               reinterpret_cast<const smoe::bf16*>(w1.data_ptr()),
               reinterpret_cast<const smoe::bf16*>(w2.data_ptr())};
  a.out = reinterpret_cast<smoe::bf16*>(out.data_ptr());
  a.saved = saved.data_ptr();
  a.saved_bytes = static_cast<size_t>(saved.numel());
  a.workspace = ws.data_ptr();
  a.workspace_bytes = static_cast<size_t>(ws.numel());
  a.status = device_status(x);
  throw_if(smoe::moe_forward(a, at::cuda::getCurrentCUDAStream()));
  return {out, saved};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> moe_backward(
    const at::Tensor& dout, const at::Tensor& x, const at::Tensor& w_router, const at::Tensor& w1,
    const at::Tensor& w2, const at::Tensor& saved, int64_t top_k) {
  const smoe::MoEShape s = layer_shape(x, w_router, w1, w2, top_k);
  check_tensor(dout, "dout", at::kBFloat16, 2);
  TORCH_CHECK(dout.sizes() == x.sizes(), "smoe: dout must have the shape of x ", dims(x.sizes()), " (got ",
              dims(dout.sizes()), ")");
  TORCH_CHECK(saved.is_cuda() && saved.scalar_type() == at::kByte &&
                  saved.numel() >= static_cast<int64_t>(smoe::moe_saved_state_size(s)),
              "smoe: saved must be the uint8 CUDA tensor returned by moe_forward for these shapes");
  const c10::cuda::CUDAGuard guard(x.device());
  at::Tensor dx = at::empty_like(x), dwr = at::empty_like(w_router), dw1 = at::empty_like(w1),
             dw2 = at::empty_like(w2);
  at::Tensor ws = bytes(static_cast<int64_t>(smoe::moe_backward_workspace_size(s)), x);
  smoe::MoEBackwardArgs a;
  a.shape = s;
  a.x = reinterpret_cast<const smoe::bf16*>(x.data_ptr());
  a.weights = {reinterpret_cast<const smoe::bf16*>(w_router.data_ptr()),
               reinterpret_cast<const smoe::bf16*>(w1.data_ptr()),
               reinterpret_cast<const smoe::bf16*>(w2.data_ptr())};
  a.dout = reinterpret_cast<const smoe::bf16*>(dout.data_ptr());
  a.saved = saved.data_ptr();
  a.saved_bytes = static_cast<size_t>(saved.numel());
  a.dx = reinterpret_cast<smoe::bf16*>(dx.data_ptr());
  a.dw_router = reinterpret_cast<smoe::bf16*>(dwr.data_ptr());
  a.dw1 = reinterpret_cast<smoe::bf16*>(dw1.data_ptr());
  a.dw2 = reinterpret_cast<smoe::bf16*>(dw2.data_ptr());
  a.workspace = ws.data_ptr();
  a.workspace_bytes = static_cast<size_t>(ws.numel());
  throw_if(smoe::moe_backward(a, at::cuda::getCurrentCUDAStream()));
  return {dx, dwr, dw1, dw2};
}

// Top-K softmax routing: (scores [T,K] f32, topk_expert [T,K] i32, expert_frequency [E],
// expert_offset [E+1], scatter_idx [TK], reverse_scatter_idx [TK], gather_idx [TK]) all int32.
std::vector<at::Tensor> topk_routing(const at::Tensor& logits, int64_t top_k) {
  TORCH_CHECK(logits.is_cuda() && logits.dim() == 2 && logits.is_contiguous(),
              "smoe: logits must be a contiguous 2-D CUDA tensor [T, E] (got ", dims(logits.sizes()), ")");
  TORCH_CHECK(logits.scalar_type() == at::kFloat || logits.scalar_type() == at::kBFloat16,
              "smoe: logits must be float32 or bfloat16 (got ", logits.scalar_type(), ")");
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

// The device status as a uint8 tensor view (flags u32, nonfinite_tokens u32, first token i64).
at::Tensor nonfinite_status(const at::Tensor& like) {
  smoe::DeviceStatus* s = device_status(like);
  return at::from_blob(s, {static_cast<int64_t>(sizeof(smoe::DeviceStatus))}, like.options().dtype(at::kByte));
}

int64_t saved_state_size(int64_t T, int64_t d, int64_t n, int64_t E, int64_t K) {
  return static_cast<int64_t>(smoe::moe_saved_state_size(
      smoe::MoEShape{T, static_cast<int>(d), static_cast<int>(n), static_cast<int>(E), static_cast<int>(K)}));
}

}  // namespace

TORCH_LIBRARY(smoe, m) {
  m.def("moe_forward(Tensor x, Tensor w_router, Tensor w1, Tensor w2, int top_k) -> (Tensor, Tensor)");
  m.def("moe_backward(Tensor dout, Tensor x, Tensor w_router, Tensor w1, Tensor w2, Tensor saved, "
        "int top_k) -> (Tensor, Tensor, Tensor, Tensor)");
  m.def("topk_routing(Tensor logits, int top_k) -> Tensor[]");
}

TORCH_LIBRARY_IMPL(smoe, CUDA, m) {
  m.impl("moe_forward", &moe_forward);
  m.impl("moe_backward", &moe_backward);
  m.impl("topk_routing", &topk_routing);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("saved_state_size", &saved_state_size, "bytes moe_forward keeps for backward");
  m.def("nonfinite_status", &nonfinite_status, "the sticky device status of like's device (uint8[16])");
}
