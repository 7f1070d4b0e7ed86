// PyTorch binding of the expert-parallel library (smoe/ep.h): the module smoe_torch._ep.
// A context is created per process from an NCCL unique id that Python broadcasts over a
// torch.distributed group (the communicator is our own, on the NCCL that torch loads); the ops
// smoe::ep_forward / smoe::ep_backward take the context as an int handle.
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/extension.h>

#include <cstdint>
#include <cstring>
#include <string>

#include "common.h"  // the inline helpers only (device_status is _C's)
#include "smoe/ep.h"

namespace {

using smoe_torch::num;
using smoe_torch::throw_if;

struct Handle {
  ncclComm_t comm = nullptr;
  smoe::EpContext* ctx = nullptr;
  at::Tensor status;  // DeviceStatus bytes on the context's device
  smoe::EpConfig config;
  int device = 0;
};

Handle* handle(int64_t h) {
  TORCH_CHECK(h != 0, "smoe: the EP context is closed or was never created");
  return reinterpret_cast<Handle*>(h);
}

pybind11::bytes unique_id() {
  ncclUniqueId id;
  const ncclResult_t r = ncclGetUniqueId(&id);
  TORCH_CHECK(r == ncclSuccess, "smoe: ncclGetUniqueId: ", ncclGetErrorString(r));
  return pybind11::bytes(id.internal, sizeof(id.internal));
}

int64_t create(const std::string& uid, int64_t rank, int64_t world, int64_t device, int64_t max_tokens,
               int64_t d, int64_t n, int64_t E, int64_t K, int64_t comm_blocks, int64_t recv_capacity,
               int64_t barrier_timeout_ms) {
  TORCH_CHECK(uid.size() == sizeof(ncclUniqueId::internal), "smoe: the NCCL unique id must have ",
              num(sizeof(ncclUniqueId::internal)), " bytes (got ", num(uid.size()), ")");
  for (int64_t v : {d, n, E, K, comm_blocks, world, rank, barrier_timeout_ms})
    TORCH_CHECK(v >= 0 && v <= INT32_MAX, "smoe: EP sizes must fit in int32 (got ", num(v), ")");
  const c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device));
  ncclUniqueId id;
  std::memcpy(id.internal, uid.data(), sizeof(id.internal));
  auto* h = new Handle;
  h->device = static_cast<int>(device);
  const ncclResult_t r = ncclCommInitRank(&h->comm, static_cast<int>(world), id, static_cast<int>(rank));
  if (r != ncclSuccess) {
    delete h;
    TORCH_CHECK(false, "smoe: ncclCommInitRank: ", ncclGetErrorString(r));
  }
  h->config.max_tokens = max_tokens;
  h->config.d = static_cast<int>(d);
  h->config.n = static_cast<int>(n);
  h->config.E = static_cast<int>(E);
  h->config.K = static_cast<int>(K);
  h->config.comm_blocks = static_cast<int>(comm_blocks);
  h->config.recv_capacity = recv_capacity;
  h->config.barrier_timeout_ms = static_cast<int>(barrier_timeout_ms);
  const smoe::Status s = smoe::ep_create(h->comm, h->config, &h->ctx);
  if (!s.ok()) {
    ncclCommDestroy(h->comm);
    delete h;
    throw_if(s);
  }
  h->status = at::empty({static_cast<int64_t>(sizeof(smoe::DeviceStatus))},
                        at::TensorOptions().device(at::kCUDA, device).dtype(at::kByte));
  throw_if(smoe::reset_device_status(reinterpret_cast<smoe::DeviceStatus*>(h->status.data_ptr()),
                                     at::cuda::getCurrentCUDAStream()));
  return reinterpret_cast<int64_t>(h);
}

void destroy(int64_t hv) {
  if (hv == 0) return;
  Handle* h = handle(hv);
  const c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(h->device));
  const smoe::Status s = smoe::ep_destroy(h->ctx);
  ncclCommDestroy(h->comm);
  delete h;
  throw_if(s);
}

int64_t saved_state_size(int64_t hv, int64_t T) {
  return static_cast<int64_t>(smoe::ep_saved_state_size(handle(hv)->ctx, T));
}

at::Tensor status(int64_t hv) { return handle(hv)->status; }

// What the Python fake implementation needs to size the saved state symbolically in T.
pybind11::dict info(int64_t hv) {
  const smoe::EpInfo i = smoe::ep_info(handle(hv)->ctx);
  pybind11::dict d;
  d["rank"] = i.rank;
  d["world"] = i.world;
  d["experts_per_rank"] = i.experts_per_rank;
  d["local_slots"] = i.local_slots;
  d["recv_capacity"] = i.recv_capacity;
  d["window_bytes"] = i.window_bytes;
  return d;
}

void check(const at::Tensor& t, const char* name, at::ScalarType dtype, std::initializer_list<int64_t> shape,
           const Handle* h) {
  TORCH_CHECK(t.is_cuda() && t.get_device() == h->device, "smoe: ", name,
              " must be on the EP context's device cuda:", num(h->device), " (got ", t.device(), ")");
  TORCH_CHECK(t.scalar_type() == dtype, "smoe: ", name, " must have dtype ", dtype, " (got ", t.scalar_type(), ")");
  TORCH_CHECK(t.sizes() == at::IntArrayRef(shape), "smoe: ", name, " has shape ", t.sizes(), ", expected ",
              at::IntArrayRef(shape));
  TORCH_CHECK(t.is_contiguous(), "smoe: ", name, " must be contiguous");
}

std::tuple<at::Tensor, at::Tensor> ep_forward(int64_t hv, const at::Tensor& x, const at::Tensor& expert,
                                              const at::Tensor& scores, const at::Tensor& w1, const at::Tensor& w2) {
  Handle* h = handle(hv);
  const smoe::EpInfo info = smoe::ep_info(h->ctx);
  const int64_t T = x.dim() == 2 ? x.size(0) : -1;
  const int64_t d = h->config.d, n = h->config.n, K = h->config.K, El = info.experts_per_rank;
  check(x, "x", at::kBFloat16, {T, d}, h);
  check(expert, "expert", at::kInt, {T, K}, h);
  check(scores, "scores", at::kFloat, {T, K}, h);
  check(w1, "w1", at::kBFloat16, {El, 2 * n, d}, h);
  check(w2, "w2", at::kBFloat16, {El, d, n}, h);
  TORCH_CHECK(T <= h->config.max_tokens, "smoe: x has ", num(T), " tokens, more than the EP context's max_tokens = ",
              num(h->config.max_tokens));
  const c10::cuda::CUDAGuard guard(x.device());
  auto bytes = [&](size_t b) { return at::empty({static_cast<int64_t>(std::max<size_t>(b, 1))}, x.options().dtype(at::kByte)); };
  at::Tensor out = at::empty_like(x);
  at::Tensor saved = bytes(smoe::ep_saved_state_size(h->ctx, T));
  const size_t wsb = smoe::ep_forward_workspace_size(h->ctx, T);
  at::Tensor ws = bytes(wsb);
  smoe::EpForwardArgs a;
  a.T = T;
  a.x = reinterpret_cast<const smoe::bf16*>(x.data_ptr());
  a.expert = expert.data_ptr<int32_t>();
  a.scores = scores.data_ptr<float>();
  a.w1 = reinterpret_cast<const smoe::bf16*>(w1.data_ptr());
  a.w2 = reinterpret_cast<const smoe::bf16*>(w2.data_ptr());
  a.out = reinterpret_cast<smoe::bf16*>(out.data_ptr());
  a.saved = saved.data_ptr();
  a.saved_bytes = saved.numel();
  a.workspace = ws.data_ptr();
  a.workspace_bytes = ws.numel();
  a.status = reinterpret_cast<smoe::DeviceStatus*>(h->status.data_ptr());
  throw_if(smoe::ep_forward(h->ctx, a, at::cuda::getCurrentCUDAStream()));
  return {out, saved};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> ep_backward(int64_t hv, const at::Tensor& dout,
                                                                        const at::Tensor& x, const at::Tensor& w1,
                                                                        const at::Tensor& w2, const at::Tensor& saved) {
  Handle* h = handle(hv);
  const smoe::EpInfo info = smoe::ep_info(h->ctx);
  const int64_t T = x.dim() == 2 ? x.size(0) : -1;
  const int64_t d = h->config.d, n = h->config.n, K = h->config.K, El = info.experts_per_rank;
  check(x, "x", at::kBFloat16, {T, d}, h);
  check(dout, "dout", at::kBFloat16, {T, d}, h);
  check(w1, "w1", at::kBFloat16, {El, 2 * n, d}, h);
  check(w2, "w2", at::kBFloat16, {El, d, n}, h);
  TORCH_CHECK(T <= h->config.max_tokens, "smoe: x has more tokens than max_tokens");
  TORCH_CHECK(saved.is_cuda() && saved.get_device() == h->device && saved.scalar_type() == at::kByte &&
                  saved.numel() >= static_cast<int64_t>(smoe::ep_saved_state_size(h->ctx, T)),
              "smoe: saved must be the uint8 tensor ep_forward returned for this x");
  const c10::cuda::CUDAGuard guard(x.device());
  at::Tensor dx = at::empty_like(x);
  at::Tensor dscores = at::empty({T, K}, x.options().dtype(at::kFloat));
  at::Tensor dw1 = at::empty_like(w1), dw2 = at::empty_like(w2);
  const size_t wsb = smoe::ep_backward_workspace_size(h->ctx, T);
  at::Tensor ws = at::empty({static_cast<int64_t>(std::max<size_t>(wsb, 1))}, x.options().dtype(at::kByte));
  smoe::EpBackwardArgs a;
  a.T = T;
  a.x = reinterpret_cast<const smoe::bf16*>(x.data_ptr());
  a.w1 = reinterpret_cast<const smoe::bf16*>(w1.data_ptr());
  a.w2 = reinterpret_cast<const smoe::bf16*>(w2.data_ptr());
  a.dout = reinterpret_cast<const smoe::bf16*>(dout.data_ptr());
  a.saved = saved.data_ptr();
  a.saved_bytes = saved.numel();
  a.dx = reinterpret_cast<smoe::bf16*>(dx.data_ptr());
  a.dw1 = reinterpret_cast<smoe::bf16*>(dw1.data_ptr());
  a.dw2 = reinterpret_cast<smoe::bf16*>(dw2.data_ptr());
  a.dscores = dscores.data_ptr<float>();
  a.workspace = ws.data_ptr();
  a.workspace_bytes = ws.numel();
  throw_if(smoe::ep_backward(h->ctx, a, at::cuda::getCurrentCUDAStream()));
  return {dx, dscores, dw1, dw2};
}

// Dispatch + combine alone with identity experts (smoe::ep_roundtrip): out[t] = ranks hit * x[t].
at::Tensor roundtrip(int64_t hv, const at::Tensor& x, const at::Tensor& expert) {
  Handle* h = handle(hv);
  const int64_t T = x.dim() == 2 ? x.size(0) : -1;
  check(x, "x", at::kBFloat16, {T, h->config.d}, h);
  check(expert, "expert", at::kInt, {T, h->config.K}, h);
  TORCH_CHECK(T <= h->config.max_tokens, "smoe: x has more tokens than max_tokens");
  const c10::cuda::CUDAGuard guard(x.device());
  at::Tensor out = at::empty_like(x);
  const size_t wsb = smoe::ep_roundtrip_workspace_size(h->ctx, T);
  at::Tensor ws = at::empty({static_cast<int64_t>(std::max<size_t>(wsb, 1))}, x.options().dtype(at::kByte));
  smoe::EpRoundtripArgs a;
  a.T = T;
  a.x = reinterpret_cast<const smoe::bf16*>(x.data_ptr());
  a.expert = expert.data_ptr<int32_t>();
  a.out = reinterpret_cast<smoe::bf16*>(out.data_ptr());
  a.workspace = ws.data_ptr();
  a.workspace_bytes = ws.numel();
  a.status = reinterpret_cast<smoe::DeviceStatus*>(h->status.data_ptr());
  throw_if(smoe::ep_roundtrip(h->ctx, a, at::cuda::getCurrentCUDAStream()));
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(smoe, m) {
  m.def("ep_forward(int ctx, Tensor x, Tensor expert, Tensor scores, Tensor w1, Tensor w2) -> (Tensor, Tensor)");
  m.def("ep_backward(int ctx, Tensor dout, Tensor x, Tensor w1, Tensor w2, Tensor saved) "
        "-> (Tensor, Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(smoe, CUDA, m) {
  m.impl("ep_forward", &ep_forward);
  m.impl("ep_backward", &ep_backward);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("unique_id", &unique_id, "a fresh NCCL unique id (bytes), to broadcast from one rank");
  m.def("create", &create, "NCCL communicator + smoe EP context; returns an int handle");
  m.def("destroy", &destroy, "collective: frees the context and its communicator");
  m.def("saved_state_size", &saved_state_size, "bytes ep_forward keeps for backward at T tokens");
  m.def("roundtrip", &roundtrip, "dispatch + combine alone (identity experts): out = ranks hit * x");
  m.def("info", &info, "rank, world, experts_per_rank, local_slots, recv_capacity, window_bytes");
  m.def("status", &status, "the context's DeviceStatus bytes (uint8 CUDA tensor)");
  m.def("ncclversion", [] { int v = 0; ncclGetVersion(&v); return v; }, "version of the NCCL linked");
}
