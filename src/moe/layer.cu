// The MoE layer, GPU version 1: orchestration, memory plan, workspace carving.
//
// Forward (stream-ordered, no host sync):
//   logits = x W_r^T (cuBLAS, fp32 out) -> top-K routing into the saved state
//   Xg = x[gather]                       (workspace, TK x d, temporary)
//   H  = Xg W1_e^T  grouped TN           (saved state, TK x 2n)
//   A  = SwiGLU(H)                       (workspace, TK x n)
//   Y  = A W2_e^T   grouped TN           (workspace, reuses Xg's buffer)
//   out[t] = sum_k s Y[row(t,k)]         (fp32 gather-sum, no atomics)
// Backward (SonicMoE's rewrite: no Y, no dY):
//   dOg = dout[gather]                   (workspace buffer X)
//   dA' = dOg W2_e  grouped NN           (workspace buffer N)
//   dH, A' (in place over dA'), dS       (one fused elementwise kernel)
//   dW2_e = dOg_e^T A'_e   varlen-K
//   dl, dense bf16 dlogits; dW_r = dlogits^T x (cuBLAS, fp32 out -> bf16)
//   Xg = x[gather]                       (buffer X again: dOg is dead)
//   dW1_e = dH_e^T Xg_e    varlen-K
//   dX~ = dH W1_e   grouped NN           (buffer X again: Xg is dead)
//   dx[t] = sum_k dX~[row(t,k)] + dl[t,k] W_r[e_k]
// Held between forward and backward: the saved state only (H + O(TK)); x is the caller's.
#include <cublas_v2.h>

#include "common/check.h"
#include "gemm/grouped_gemm.h"
#include "moe/layer_kernels.h"
#include "moe/profile.h"
#include "smoe/smoe.h"

namespace smoe {

namespace profile {
namespace {
Recorder* g_recorder = nullptr;
}
void set_recorder(Recorder* r) { g_recorder = r; }
Recorder* recorder() { return g_recorder; }
}  // namespace profile

namespace {

constexpr size_t kCublasWorkspace = size_t{32} << 20;  // cuBLAS' recommendation for Hopper

// Sequential carving of a caller buffer; also used with base == nullptr to compute sizes.
class Carver {
 public:
  explicit Carver(void* base) : base_(static_cast<char*>(base)) {}
  template <typename T>
  T* take(size_t count) {
    char* p = base_ ? base_ + used_ : nullptr;
    used_ += detail::align_workspace(sizeof(T) * count);
    return reinterpret_cast<T*>(p);
  }
  size_t used() const { return used_; }

 private:
  char* base_;
  size_t used_ = 0;
};

int device_sm_count() {
  int dev = 0, sms = 0;
  if (cudaGetDevice(&dev) != cudaSuccess) return 132;
  if (cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess) return 132;
  return sms;
}

// One cuBLAS handle per host thread and device, created on first use.
Status cublas_handle(cublasHandle_t* out) {
  thread_local cublasHandle_t handles[64] = {};
  int dev = 0;
  SMOE_CUDA_RETURN(cudaGetDevice(&dev));
  if (dev < 0 || dev >= 64) return detail::make_status(StatusCode::kInvalidArgument, "moe: device index >= 64");
  if (!handles[dev]) {
    if (cublasCreate(&handles[dev]) != CUBLAS_STATUS_SUCCESS)
      return detail::make_status(StatusCode::kCudaError, "moe: cublasCreate failed");
  }
  *out = handles[dev];
  return Status{};
}

Status cublas_check(cublasStatus_t s, const char* what) {
  if (s == CUBLAS_STATUS_SUCCESS) return Status{};
  return detail::make_status(StatusCode::kCudaError, detail::concat(what, ": cuBLAS status ", static_cast<int>(s)));
}

Status cublas_prepare(cudaStream_t stream, void* ws, cublasHandle_t* h) {
  SMOE_RETURN_IF_ERROR(cublas_handle(h));
  SMOE_RETURN_IF_ERROR(cublas_check(cublasSetStream(*h, stream), "cublasSetStream"));
  SMOE_RETURN_IF_ERROR(cublas_check(cublasSetWorkspace(*h, ws, kCublasWorkspace), "cublasSetWorkspace"));
  return Status{};
}

struct SavedLayout {
  MoESavedView v;
  size_t bytes;
};

SavedLayout saved_layout(const MoEShape& s, void* base) {
  const size_t tk = static_cast<size_t>(s.T) * s.K;
  Carver c(base);
  SavedLayout l;
  l.v.h = c.take<bf16>(tk * 2 * s.n);
  l.v.scores = c.take<float>(tk);
  l.v.topk_expert = c.take<int32_t>(tk);
  l.v.scatter_idx = c.take<int32_t>(tk);
  l.v.reverse_scatter_idx = c.take<int32_t>(tk);
  l.v.gather_idx = c.take<int32_t>(tk);
  l.v.expert_frequency = c.take<int32_t>(s.E);
  l.v.expert_offset = c.take<int32_t>(s.E + 1);
  l.bytes = c.used();
  return l;
}

struct ForwardWs {
  void* cublas;
  float* logits;
  void* routing;
  size_t routing_bytes;
  bf16* bufX;  // Xg, then Y
  bf16* bufA;
  void* gemm;
  size_t gemm_bytes;
  size_t total;
};

ForwardWs forward_ws(const MoEShape& s, void* base, int sms) {
  const size_t tk = static_cast<size_t>(s.T) * s.K;
  Carver c(base);
  ForwardWs w;
  w.cublas = c.take<char>(kCublasWorkspace);
  w.logits = c.take<float>(static_cast<size_t>(s.T) * s.E);
  RoutingProblem rp{s.T, s.E, s.K, DType::kFloat32};
  w.routing_bytes = routing_workspace_size(rp);
  w.routing = c.take<char>(w.routing_bytes);
  w.bufX = c.take<bf16>(tk * s.d);
  w.bufA = c.take<bf16>(tk * s.n);
  w.gemm_bytes = gemm::varlen_m_workspace_size(s.E, sms, gemm::WeightLayout::kWeightNK);
  w.gemm = c.take<char>(w.gemm_bytes);
  w.total = c.used();
  return w;
}

struct BackwardWs {
  void* cublas;
  bf16* bufX;   // dOg, then Xg, then dX~
  bf16* bufN;   // dA', then A'
  bf16* dH;
  float* dS;
  float* dl;
  bf16* dlogits;
  float* dwr32;
  void* gemm;
  size_t gemm_bytes;
  size_t total;
};

BackwardWs backward_ws(const MoEShape& s, void* base, int sms) {
  const size_t tk = static_cast<size_t>(s.T) * s.K;
  Carver c(base);
  BackwardWs w;
  w.cublas = c.take<char>(kCublasWorkspace);
  w.bufX = c.take<bf16>(tk * s.d);
  w.bufN = c.take<bf16>(tk * s.n);
  w.dH = c.take<bf16>(tk * 2 * s.n);
  w.dS = c.take<float>(tk);
  w.dl = c.take<float>(tk);
  w.dlogits = c.take<bf16>(static_cast<size_t>(s.T) * s.E);
  w.dwr32 = c.take<float>(static_cast<size_t>(s.E) * s.d);
  const size_t m = gemm::varlen_m_workspace_size(s.E, sms, gemm::WeightLayout::kWeightKN);
  const size_t k = gemm::varlen_k_workspace_size(s.E, sms);
  w.gemm_bytes = m > k ? m : k;
  w.gemm = c.take<char>(w.gemm_bytes);
  w.total = c.used();
  return w;
}

Status check_buffer(const void* p, size_t have, size_t need, const char* fn, const char* name,
                    const char* bytes_name, const char* query) {
  SMOE_RETURN_IF_ERROR(detail::check_ptr(p, fn, name, kWorkspaceAlignment));
  if (have < need)
    return detail::make_status(StatusCode::kWorkspaceTooSmall,
                               detail::concat(fn, ": ", bytes_name, " = ", have, " is smaller than ",
                                              query, "() = ", need));
  return Status{};
}

}  // namespace

Status moe_can_implement(const MoEShape& s) {
  using detail::concat;
  using detail::make_status;
  const char* fn = "moe";
  RoutingProblem rp{s.T, s.E, s.K, DType::kFloat32};
  SMOE_RETURN_IF_ERROR(routing_can_implement(rp));
  // 64: the GEMM K-tile and 16-byte rows for TMA; SwiGLU pairs need n even anyway.
  if (s.d <= 0 || s.d % 64 != 0)
    return make_status(StatusCode::kInvalidArgument, concat(fn, ": d = ", s.d, " must be a positive multiple of 64"));
  if (s.n <= 0 || s.n % 64 != 0)
    return make_status(StatusCode::kInvalidArgument, concat(fn, ": n = ", s.n, " must be a positive multiple of 64"));
  return Status{};
}

size_t moe_saved_state_size(const MoEShape& s) {
  if (!moe_can_implement(s).ok()) return 0;  // forward/backward report the broken rule
  return saved_layout(s, nullptr).bytes;
}
MoESavedView moe_saved_state_view(const MoEShape& s, void* saved) { return saved_layout(s, saved).v; }
size_t moe_forward_workspace_size(const MoEShape& s) {
  if (!moe_can_implement(s).ok()) return 0;
  return forward_ws(s, nullptr, device_sm_count()).total;
}
size_t moe_backward_workspace_size(const MoEShape& s) {
  if (!moe_can_implement(s).ok()) return 0;
  return backward_ws(s, nullptr, device_sm_count()).total;
}

Status moe_forward(const MoEForwardArgs& a, cudaStream_t stream) {
  const char* fn = "moe_forward";
  const MoEShape& s = a.shape;
  SMOE_RETURN_IF_ERROR(moe_can_implement(s));
  SMOE_RETURN_IF_ERROR(detail::check_ptr(a.x, fn, "x", 16));
  SMOE_RETURN_IF_ERROR(detail::check_ptr(a.weights.w_router, fn, "weights.w_router", 16));
  SMOE_RETURN_IF_ERROR(detail::check_ptr(a.weights.w1, fn, "weights.w1", 16));
  SMOE_RETURN_IF_ERROR(detail::check_ptr(a.weights.w2, fn, "weights.w2", 16));
  SMOE_RETURN_IF_ERROR(detail::check_ptr(a.out, fn, "out", 16));
  SMOE_RETURN_IF_ERROR(detail::check_ptr(a.status, fn, "status", 8));
  SMOE_RETURN_IF_ERROR(check_buffer(a.saved, a.saved_bytes, moe_saved_state_size(s), fn, "saved",
                                    "saved_bytes", "moe_saved_state_size"));
  const int sms = device_sm_count();
  const ForwardWs w = forward_ws(s, a.workspace, sms);
  SMOE_RETURN_IF_ERROR(check_buffer(a.workspace, a.workspace_bytes, w.total, fn, "workspace",
                                    "workspace_bytes", "moe_forward_workspace_size"));
  const MoESavedView sv = moe_saved_state_view(s, a.saved);
  const int64_t tk = s.T * s.K;
  profile::mark("begin", stream);

  // Router logits [T][E] = x W_r^T: column-major C (E x T) = op(W_r as d x E)^T * (x as d x T).
  cublasHandle_t h;
  SMOE_RETURN_IF_ERROR(cublas_prepare(stream, w.cublas, &h));
  const float one = 1.f, zero = 0.f;
  SMOE_RETURN_IF_ERROR(cublas_check(
      cublasGemmEx(h, CUBLAS_OP_T, CUBLAS_OP_N, s.E, static_cast<int>(s.T), s.d, &one, a.weights.w_router,
                   CUDA_R_16BF, s.d, a.x, CUDA_R_16BF, s.d, &zero, w.logits, CUDA_R_32F, s.E,
                   CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
      "moe_forward: router GEMM"));
  profile::mark("router_gemm", stream);

  RoutingProblem rp{s.T, s.E, s.K, DType::kFloat32};
  RoutingOutputs ro{sv.scores, sv.topk_expert, sv.expert_frequency, sv.expert_offset,
                    sv.scatter_idx, sv.reverse_scatter_idx, sv.gather_idx, a.status};
  SMOE_RETURN_IF_ERROR(topk_routing(rp, w.logits, ro, w.routing, w.routing_bytes, stream));
  profile::mark("routing", stream);

  SMOE_RETURN_IF_ERROR(kernels::gather_rows(a.x, s.d, sv.gather_idx, tk, w.bufX, stream));
  profile::mark("gather_x", stream);

  gemm::VarlenMArgs up;
  up.num_experts = s.E;
  up.N = 2 * s.n;
  up.K = s.d;
  up.expert_offset = sv.expert_offset;
  up.A = w.bufX;
  up.B = a.weights.w1;
  up.D = sv.h;
  up.b_layout = gemm::WeightLayout::kWeightNK;
  SMOE_RETURN_IF_ERROR(gemm::varlen_m_gemm(up, w.gemm, w.gemm_bytes, sms, stream));
  profile::mark("up_proj", stream);

  SMOE_RETURN_IF_ERROR(kernels::swiglu(sv.h, w.bufA, tk, s.n, stream));
  profile::mark("swiglu", stream);

  gemm::VarlenMArgs down = up;
  down.N = s.d;
  down.K = s.n;
  down.A = w.bufA;
  down.B = a.weights.w2;
  down.D = w.bufX;  // Y reuses Xg's buffer
  SMOE_RETURN_IF_ERROR(gemm::varlen_m_gemm(down, w.gemm, w.gemm_bytes, sms, stream));
  profile::mark("down_proj", stream);

  SMOE_RETURN_IF_ERROR(kernels::aggregate(w.bufX, sv.scores, sv.reverse_scatter_idx, s.K, s.d, s.T, a.out, stream));
  profile::mark("aggregate", stream);
  return Status{};
}

Status moe_backward(const MoEBackwardArgs& a, cudaStream_t stream) {
  const char* fn = "moe_backward";
  const MoEShape& s = a.shape;
  SMOE_RETURN_IF_ERROR(moe_can_implement(s));
  SMOE_RETURN_IF_ERROR(detail::check_ptr(a.x, fn, "x", 16));
  SMOE_RETURN_IF_ERROR(detail::check_ptr(a.weights.w_router, fn, "weights.w_router", 16));
  SMOE_RETURN_IF_ERROR(detail::check_ptr(a.weights.w1, fn, "weights.w1", 16));
  SMOE_RETURN_IF_ERROR(detail::check_ptr(a.weights.w2, fn, "weights.w2", 16));
  SMOE_RETURN_IF_ERROR(detail::check_ptr(a.dout, fn, "dout", 16));
  SMOE_RETURN_IF_ERROR(detail::check_ptr(a.dx, fn, "dx", 16));
  SMOE_RETURN_IF_ERROR(detail::check_ptr(a.dw_router, fn, "dw_router", 16));
  SMOE_RETURN_IF_ERROR(detail::check_ptr(a.dw1, fn, "dw1", 16));
  SMOE_RETURN_IF_ERROR(detail::check_ptr(a.dw2, fn, "dw2", 16));
  SMOE_RETURN_IF_ERROR(check_buffer(a.saved, a.saved_bytes, moe_saved_state_size(s), fn, "saved",
                                    "saved_bytes", "moe_saved_state_size"));
  const int sms = device_sm_count();
  const BackwardWs w = backward_ws(s, a.workspace, sms);
  SMOE_RETURN_IF_ERROR(check_buffer(a.workspace, a.workspace_bytes, w.total, fn, "workspace",
                                    "workspace_bytes", "moe_backward_workspace_size"));
  const MoESavedView sv = moe_saved_state_view(s, const_cast<void*>(a.saved));
  const int64_t tk = s.T * s.K;
  profile::mark("begin", stream);

  SMOE_RETURN_IF_ERROR(kernels::gather_rows(a.dout, s.d, sv.gather_idx, tk, w.bufX, stream));
  profile::mark("gather_dout", stream);

  gemm::VarlenMArgs da;
  da.num_experts = s.E;
  da.N = s.n;
  da.K = s.d;
  da.expert_offset = sv.expert_offset;
  da.A = w.bufX;
  da.B = a.weights.w2;  // [E][d][n] = [K][N]
  da.D = w.bufN;
  da.b_layout = gemm::WeightLayout::kWeightKN;
  SMOE_RETURN_IF_ERROR(gemm::varlen_m_gemm(da, w.gemm, w.gemm_bytes, sms, stream));
  profile::mark("dA_proj", stream);

  SMOE_RETURN_IF_ERROR(kernels::dh_ds(sv.h, w.bufN, sv.scores, sv.scatter_idx, tk, s.n, w.dH, w.dS, stream));
  profile::mark("dh_ds", stream);

  gemm::VarlenKArgs dw2;
  dw2.num_experts = s.E;
  dw2.M = s.d;
  dw2.N = s.n;
  dw2.expert_offset = sv.expert_offset;
  dw2.P = w.bufX;  // dOg
  dw2.Q = w.bufN;  // A'
  dw2.D = a.dw2;
  SMOE_RETURN_IF_ERROR(gemm::varlen_k_gemm(dw2, w.gemm, w.gemm_bytes, sms, stream));
  profile::mark("dW2", stream);

  SMOE_RETURN_IF_ERROR(kernels::router_backward(w.dS, sv.scores, sv.topk_expert, s.K, s.E, s.T, w.dl,
                                                w.dlogits, stream));
  // dW_r [E][d] = dlogits^T x: column-major C (d x E) = (x as d x T) * (dlogits as E x T)^T.
  cublasHandle_t h;
  SMOE_RETURN_IF_ERROR(cublas_prepare(stream, w.cublas, &h));
  const float one = 1.f, zero = 0.f;
  SMOE_RETURN_IF_ERROR(cublas_check(
      cublasGemmEx(h, CUBLAS_OP_N, CUBLAS_OP_T, s.d, s.E, static_cast<int>(s.T), &one, a.x, CUDA_R_16BF,
                   s.d, w.dlogits, CUDA_R_16BF, s.E, &zero, w.dwr32, CUDA_R_32F, s.d,
                   CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
      "moe_backward: router weight gradient GEMM"));
  SMOE_RETURN_IF_ERROR(kernels::f32_to_bf16(w.dwr32, a.dw_router, static_cast<int64_t>(s.E) * s.d, stream));
  profile::mark("router_bwd", stream);

  SMOE_RETURN_IF_ERROR(kernels::gather_rows(a.x, s.d, sv.gather_idx, tk, w.bufX, stream));
  profile::mark("gather_x", stream);

  gemm::VarlenKArgs dw1;
  dw1.num_experts = s.E;
  dw1.M = 2 * s.n;
  dw1.N = s.d;
  dw1.expert_offset = sv.expert_offset;
  dw1.P = w.dH;
  dw1.Q = w.bufX;  // Xg
  dw1.D = a.dw1;
  SMOE_RETURN_IF_ERROR(gemm::varlen_k_gemm(dw1, w.gemm, w.gemm_bytes, sms, stream));
  profile::mark("dW1", stream);

  gemm::VarlenMArgs dxt;
  dxt.num_experts = s.E;
  dxt.N = s.d;
  dxt.K = 2 * s.n;
  dxt.expert_offset = sv.expert_offset;
  dxt.A = w.dH;
  dxt.B = a.weights.w1;  // [E][2n][d] = [K][N]
  dxt.D = w.bufX;        // dX~ (Xg is dead)
  dxt.b_layout = gemm::WeightLayout::kWeightKN;
  SMOE_RETURN_IF_ERROR(gemm::varlen_m_gemm(dxt, w.gemm, w.gemm_bytes, sms, stream));
  profile::mark("dX_proj", stream);

  SMOE_RETURN_IF_ERROR(kernels::dx_sum(w.bufX, sv.reverse_scatter_idx, w.dl, sv.topk_expert,
                                       a.weights.w_router, s.K, s.d, s.T, a.dx, stream));
  profile::mark("dx_sum", stream);
  return Status{};
}

}  // namespace smoe
