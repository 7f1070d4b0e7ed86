// EP forward and backward: layout -> exchange -> dispatch -> local layer -> combine -> reduce.
#include "common/check.h"
#include "common/workspace.h"
#include "ep/ep_context.h"

namespace smoe {
namespace {

using detail::Carver;
using detail::concat;
using detail::make_status;

struct SavedLayout {
  void* layer = nullptr;
  int32_t* all_counts = nullptr;  // [R][R]
  int32_t* send_pos = nullptr;    // [R][T]
  int32_t* ids = nullptr;         // [T][K] sanitised ids
  size_t bytes = 0;
};

SavedLayout saved_layout(const EpContext* c, int64_t T, void* base) {
  Carver w(base);
  SavedLayout s;
  s.layer = w.take<char>(moe_saved_state_size(c->local_shape));
  s.all_counts = w.take<int32_t>(size_t(c->world) * c->world);
  s.send_pos = w.take<int32_t>(size_t(c->world) * size_t(T));
  s.ids = w.take<int32_t>(size_t(T) * c->config.K);
  s.bytes = w.used();
  return s;
}

struct FwdWorkspace {
  int32_t* my_counts = nullptr;
  bf16* y = nullptr;  // [recv_capacity][d] the local layer's output, slot order
  void* layer = nullptr;
  size_t layer_bytes = 0;
  size_t bytes = 0;
};

FwdWorkspace fwd_workspace(const EpContext* c, void* base) {
  Carver w(base);
  FwdWorkspace f;
  f.my_counts = w.take<int32_t>(size_t(c->world));
  f.y = w.take<bf16>(size_t(c->recv_capacity) * c->config.d);
  f.layer_bytes = moe_forward_workspace_size(c->local_shape);
  f.layer = w.take<char>(f.layer_bytes);
  f.bytes = w.used();
  return f;
}

struct BwdWorkspace {
  bf16* dx = nullptr;     // [recv_capacity][d]
  float* ds = nullptr;    // [recv_capacity][Kl]
  void* layer = nullptr;
  size_t layer_bytes = 0;
  size_t bytes = 0;
};

BwdWorkspace bwd_workspace(const EpContext* c, void* base) {
  Carver w(base);
  BwdWorkspace b;
  b.dx = w.take<bf16>(size_t(c->recv_capacity) * c->config.d);
  b.ds = w.take<float>(size_t(c->recv_capacity) * c->local_slots);
  b.layer_bytes = moe_backward_workspace_size(c->local_shape);
  b.layer = w.take<char>(b.layer_bytes);
  b.bytes = w.used();
  return b;
}

// Roundtrip: the layout part of the saved state plus the counts, all in the workspace.
struct RoundtripWorkspace {
  int32_t* my_counts = nullptr;
  int32_t* all_counts = nullptr;
  int32_t* send_pos = nullptr;
  int32_t* ids = nullptr;
  size_t bytes = 0;
};

RoundtripWorkspace roundtrip_workspace(const EpContext* c, int64_t T, void* base) {
  Carver w(base);
  RoundtripWorkspace r;
  r.my_counts = w.take<int32_t>(size_t(c->world));
  r.all_counts = w.take<int32_t>(size_t(c->world) * c->world);
  r.send_pos = w.take<int32_t>(size_t(c->world) * size_t(T));
  r.ids = w.take<int32_t>(size_t(T) * c->config.K);
  r.bytes = w.used();
  return r;
}

bool valid_T(const EpContext* c, int64_t T) { return c != nullptr && T >= 0 && T <= c->config.max_tokens; }

Status check_common(const EpContext* c, const char* fn, int64_t T) {
  if (c == nullptr) return make_status(StatusCode::kInvalidArgument, concat(fn, ": ctx is null"));
  if (!valid_T(c, T))
    return make_status(StatusCode::kInvalidArgument,
                       concat(fn, ": T = ", T, " must be in [0, config.max_tokens = ",
                              c->config.max_tokens, "]"));
  int dev = -1;
  SMOE_CUDA_RETURN(cudaGetDevice(&dev));
  if (dev != c->device)
    return make_status(StatusCode::kInvalidArgument,
                       concat(fn, ": the current device (", dev, ") is not the context's (",
                              c->device, ")"));
  return Status{};
}

Status check_size(const char* fn, const char* name, size_t have, size_t need) {
  if (have < need)
    return make_status(name[0] == 'w' ? StatusCode::kWorkspaceTooSmall : StatusCode::kInvalidArgument,
                       concat(fn, ": ", name, " = ", have, " < the required ", need, " bytes"));
  return Status{};
}

ep::EpKernelArgs kernel_args(const EpContext* c, int64_t T, DeviceStatus* status) {
  ep::EpKernelArgs a;
  a.dev_comm = c->dev_comm;
  a.window = c->window;
  a.lay = c->layout;
  a.rank = c->rank;
  a.world = c->world;
  a.T = T;
  a.Tmax = c->config.max_tokens;
  a.cap = c->recv_capacity;
  a.d = c->config.d;
  a.K = c->config.K;
  a.E = c->config.E;
  a.El = c->experts_per_rank;
  a.Kl = c->local_slots;
  a.timeout_cycles = c->timeout_cycles;
  a.flags = status ? &status->flags : nullptr;
  return a;
}

#define SMOE_EP_LAUNCH(expr, name) \
  SMOE_RETURN_IF_ERROR(detail::cuda_status((expr), "launch of " name))

}  // namespace

size_t ep_roundtrip_workspace_size(const EpContext* c, int64_t T) {
  return valid_T(c, T) ? roundtrip_workspace(c, T, nullptr).bytes : 0;
}

Status ep_roundtrip(EpContext* c, const EpRoundtripArgs& a, cudaStream_t stream) {
  const char* fn = "ep_roundtrip";
  SMOE_RETURN_IF_ERROR(check_common(c, fn, a.T));
  if (a.T > 0) {
    SMOE_RETURN_IF_ERROR(detail::check_ptr(a.x, fn, "x", 16));
    SMOE_RETURN_IF_ERROR(detail::check_ptr(a.expert, fn, "expert", 4));
    SMOE_RETURN_IF_ERROR(detail::check_ptr(a.out, fn, "out", 16));
  }
  SMOE_RETURN_IF_ERROR(detail::check_ptr(a.status, fn, "status", 8));
  SMOE_RETURN_IF_ERROR(detail::check_ptr(a.workspace, fn, "workspace", kWorkspaceAlignment));
  const RoundtripWorkspace ws = roundtrip_workspace(c, a.T, a.workspace);
  SMOE_RETURN_IF_ERROR(check_size(fn, "workspace_bytes", a.workspace_bytes, ws.bytes));
  const ep::EpKernelArgs k = kernel_args(c, a.T, a.status);
  // The receive window holds the dispatched rows in slot order, which is what combine sends back.
  const bf16* recv = reinterpret_cast<const bf16*>(static_cast<const char*>(c->window_base) + c->layout.recv_x);
  SMOE_EP_LAUNCH(ep::launch_layout(k, a.expert, ws.send_pos, ws.my_counts, ws.ids, a.status, stream),
                 "ep layout");
  SMOE_EP_LAUNCH(ep::launch_exchange(k, ws.my_counts, ws.all_counts, stream), "ep exchange");
  SMOE_EP_LAUNCH(ep::launch_dispatch(k, ws.all_counts, ws.send_pos, a.x, nullptr, ws.ids, nullptr,
                                     /*write_meta=*/false, /*start_barrier=*/false, /*report_capacity=*/true,
                                     c->config.comm_blocks, stream),
                 "ep dispatch");
  SMOE_EP_LAUNCH(ep::launch_combine(k, ws.all_counts, recv, nullptr, c->config.comm_blocks, stream),
                 "ep combine");
  SMOE_EP_LAUNCH(ep::launch_reduce(k, ws.all_counts, ws.send_pos, recv, a.out, nullptr, nullptr,
                                   nullptr, stream),
                 "ep reduce");
  return Status{};
}

size_t ep_saved_state_size(const EpContext* c, int64_t T) {
  return valid_T(c, T) ? saved_layout(c, T, nullptr).bytes : 0;
}
size_t ep_forward_workspace_size(const EpContext* c, int64_t T) {
  return valid_T(c, T) ? fwd_workspace(c, nullptr).bytes : 0;
}
size_t ep_backward_workspace_size(const EpContext* c, int64_t T) {
  return valid_T(c, T) ? bwd_workspace(c, nullptr).bytes : 0;
}

Status ep_forward(EpContext* c, const EpForwardArgs& a, cudaStream_t stream) {
  const char* fn = "ep_forward";
  SMOE_RETURN_IF_ERROR(check_common(c, fn, a.T));
  if (a.T > 0) {
    SMOE_RETURN_IF_ERROR(detail::check_ptr(a.x, fn, "x", 16));
    SMOE_RETURN_IF_ERROR(detail::check_ptr(a.expert, fn, "expert", 4));
    SMOE_RETURN_IF_ERROR(detail::check_ptr(a.scores, fn, "scores", 4));
    SMOE_RETURN_IF_ERROR(detail::check_ptr(a.out, fn, "out", 16));
  }
  SMOE_RETURN_IF_ERROR(detail::check_ptr(a.w1, fn, "w1", 16));
  SMOE_RETURN_IF_ERROR(detail::check_ptr(a.w2, fn, "w2", 16));
  SMOE_RETURN_IF_ERROR(detail::check_ptr(a.status, fn, "status", 8));
  SMOE_RETURN_IF_ERROR(detail::check_ptr(a.saved, fn, "saved", kWorkspaceAlignment));
  SMOE_RETURN_IF_ERROR(detail::check_ptr(a.workspace, fn, "workspace", kWorkspaceAlignment));
  const SavedLayout sv = saved_layout(c, a.T, a.saved);
  const FwdWorkspace ws = fwd_workspace(c, a.workspace);
  SMOE_RETURN_IF_ERROR(check_size(fn, "saved_bytes", a.saved_bytes, sv.bytes));
  SMOE_RETURN_IF_ERROR(check_size(fn, "workspace_bytes", a.workspace_bytes, ws.bytes));

  const ep::EpKernelArgs k = kernel_args(c, a.T, a.status);
  const char* win = static_cast<const char*>(c->window_base);
  MoEForwardArgs la;
  la.shape = c->local_shape;
  la.x = reinterpret_cast<const bf16*>(win + c->layout.recv_x);
  la.weights.w1 = a.w1;
  la.weights.w2 = a.w2;
  la.out = ws.y;
  la.saved = sv.layer;
  la.saved_bytes = moe_saved_state_size(c->local_shape);
  la.workspace = ws.layer;
  la.workspace_bytes = ws.layer_bytes;
  la.status = a.status;
  la.routed_expert = reinterpret_cast<const int32_t*>(win + c->layout.meta_ids);
  la.routed_scores = reinterpret_cast<const float*>(win + c->layout.meta_scores);

  SMOE_EP_LAUNCH(ep::launch_layout(k, a.expert, sv.send_pos, ws.my_counts, sv.ids, a.status, stream),
                 "ep layout");
  SMOE_EP_LAUNCH(ep::launch_exchange(k, ws.my_counts, sv.all_counts, stream), "ep exchange");
  SMOE_EP_LAUNCH(ep::launch_dispatch(k, sv.all_counts, sv.send_pos, a.x, nullptr, sv.ids, a.scores,
                                     /*write_meta=*/true, /*start_barrier=*/false, /*report_capacity=*/true,
                                     c->config.comm_blocks, stream),
                 "ep dispatch");
  SMOE_RETURN_IF_ERROR(moe_forward(la, stream));
  SMOE_EP_LAUNCH(ep::launch_combine(k, sv.all_counts, ws.y, nullptr, c->config.comm_blocks, stream),
                 "ep combine");
  SMOE_EP_LAUNCH(ep::launch_reduce(k, sv.all_counts, sv.send_pos, ws.y, a.out, nullptr, nullptr,
                                   nullptr, stream),
                 "ep reduce");
  return Status{};
}

Status ep_backward(EpContext* c, const EpBackwardArgs& a, cudaStream_t stream) {
  const char* fn = "ep_backward";
  SMOE_RETURN_IF_ERROR(check_common(c, fn, a.T));
  if (a.T > 0) {
    SMOE_RETURN_IF_ERROR(detail::check_ptr(a.x, fn, "x", 16));
    SMOE_RETURN_IF_ERROR(detail::check_ptr(a.dout, fn, "dout", 16));
    SMOE_RETURN_IF_ERROR(detail::check_ptr(a.dx, fn, "dx", 16));
    SMOE_RETURN_IF_ERROR(detail::check_ptr(a.dscores, fn, "dscores", 4));
  }
  SMOE_RETURN_IF_ERROR(detail::check_ptr(a.w1, fn, "w1", 16));
  SMOE_RETURN_IF_ERROR(detail::check_ptr(a.w2, fn, "w2", 16));
  SMOE_RETURN_IF_ERROR(detail::check_ptr(a.dw1, fn, "dw1", 16));
  SMOE_RETURN_IF_ERROR(detail::check_ptr(a.dw2, fn, "dw2", 16));
  if (a.status != nullptr) SMOE_RETURN_IF_ERROR(detail::check_ptr(a.status, fn, "status", 8));
  SMOE_RETURN_IF_ERROR(detail::check_ptr(a.saved, fn, "saved", kWorkspaceAlignment));
  SMOE_RETURN_IF_ERROR(detail::check_ptr(a.workspace, fn, "workspace", kWorkspaceAlignment));
  const SavedLayout sv = saved_layout(c, a.T, const_cast<void*>(a.saved));
  const BwdWorkspace ws = bwd_workspace(c, a.workspace);
  SMOE_RETURN_IF_ERROR(check_size(fn, "saved_bytes", a.saved_bytes, sv.bytes));
  SMOE_RETURN_IF_ERROR(check_size(fn, "workspace_bytes", a.workspace_bytes, ws.bytes));

  const ep::EpKernelArgs k = kernel_args(c, a.T, a.status);
  const char* win = static_cast<const char*>(c->window_base);
  MoEBackwardArgs lb;
  lb.shape = c->local_shape;
  lb.x = reinterpret_cast<const bf16*>(win + c->layout.recv_x);
  lb.weights.w1 = a.w1;
  lb.weights.w2 = a.w2;
  lb.dout = reinterpret_cast<const bf16*>(win + c->layout.recv_dy);
  lb.saved = sv.layer;
  lb.saved_bytes = moe_saved_state_size(c->local_shape);
  lb.dx = ws.dx;
  lb.dw1 = a.dw1;
  lb.dw2 = a.dw2;
  lb.dscores = ws.ds;
  lb.workspace = ws.layer;
  lb.workspace_bytes = ws.layer_bytes;
  lb.status = a.status;  // a bad saved state is reported there (when given)

  // x is dispatched again with dout (same slots: the layout is the forward's), so the forward
  // keeps no copy of the received tokens. With overlap, dout goes first and x follows on the side
  // stream while dA' and dW2 (which read only dout) run; the layer waits for x_ready before dW1.
  const bool overlap = c->config.overlap != 0 && c->side != nullptr;
  SMOE_EP_LAUNCH(ep::launch_dispatch(k, sv.all_counts, sv.send_pos, overlap ? nullptr : a.x, a.dout, sv.ids,
                                     nullptr, /*write_meta=*/false, /*start_barrier=*/true,
                                     /*report_capacity=*/false, c->config.comm_blocks, stream),
                 "ep dispatch (backward)");
  if (overlap) {
    SMOE_CUDA_RETURN(cudaEventRecord(c->fork, stream));
    SMOE_CUDA_RETURN(cudaStreamWaitEvent(c->side, c->fork, 0));
    SMOE_EP_LAUNCH(ep::launch_dispatch(k, sv.all_counts, sv.send_pos, a.x, nullptr, sv.ids, nullptr,
                                       /*write_meta=*/false, /*start_barrier=*/false,
                                       /*report_capacity=*/false, c->config.comm_blocks, c->side),
                   "ep dispatch (backward, x)");
    SMOE_CUDA_RETURN(cudaEventRecord(c->x_ready, c->side));
    lb.x_ready = c->x_ready;
  }
  const Status layer_status = moe_backward(lb, stream);
  // Join the side stream whatever the layer did: the combine below, and the caller's next call,
  // must come after the x pass.
  if (overlap) SMOE_CUDA_RETURN(cudaStreamWaitEvent(stream, c->x_ready, 0));
  SMOE_RETURN_IF_ERROR(layer_status);
  SMOE_EP_LAUNCH(ep::launch_combine(k, sv.all_counts, ws.dx, ws.ds, c->config.comm_blocks, stream),
                 "ep combine (backward)");
  SMOE_EP_LAUNCH(ep::launch_reduce(k, sv.all_counts, sv.send_pos, ws.dx, a.dx, ws.ds, sv.ids,
                                   a.dscores, stream),
                 "ep reduce (backward)");
  return Status{};
}

}  // namespace smoe
