// Top-K softmax routing and routing metadata on the GPU.
//
// Pipeline (all on `stream`, no host sync, no allocation):
//   1. topk_softmax_kernel: one warp per token. Lane l holds logits l, l+32, ... (E <= 512, so at
//      most 16 per lane, in registers; the kernel instance holds per_lane_for(E) of them). K
//      rounds of a warp arg-max over (value desc, index asc) pick the experts; lane k keeps
//      choice k, so the softmax over the K chosen is one warp sum. NaN / Inf logits are recorded
//      in the sticky DeviceStatus (integer atomics only).
//   2. iota -> CUB radix sort of (expert, entry) pairs on the low ceil(log2 E) bits. LSD radix sort
//      is stable, so rows of one expert come out in entry (t*K+k) order: the scatter index.
//   3. offsets_kernel: expert_offset[e] = lower_bound(sorted experts, e) by binary search,
//      frequency = difference. No histogram atomics, exact and deterministic.
//   4. inverse_kernel: reverse_scatter[scatter[r]] = r, gather[r] = scatter[r] / K.
#include <climits>
#include <cstdint>

#include <cub/device/device_radix_sort.cuh>

#include "common/check.h"
#include "common/grid_stride.h"
#include "routing/routing_rules.h"
#include "routing/warp_topk.cuh"
#include "smoe/smoe.h"

namespace smoe {
namespace {

constexpr int kWarpsPerBlock = 8;
constexpr int kThreads = 256;

template <typename TIn, int kPerLane>
__global__ void __launch_bounds__(kWarpsPerBlock * 32)
    topk_softmax_kernel(const TIn* __restrict__ logits, int64_t T, int E, int K,
                        float* __restrict__ scores, int32_t* __restrict__ topk_expert,
                        DeviceStatus* status) {
  const int lane = threadIdx.x & 31;
  const int64_t t = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + (threadIdx.x >> 5);
  if (t >= T) return;  // whole warps exit together
  routing::WarpTopK<kPerLane> r;
  routing::warp_topk_softmax(logits + t * E, E, K, lane, &r);
  if (lane < K) {
    scores[t * K + lane] = r.score;
    topk_expert[t * K + lane] = r.idx;
  }
  routing::record_nonfinite(r.nonfinite, lane, t, status);
}

__global__ void iota_kernel(uint32_t* __restrict__ p, int64_t n) {
  for (int64_t i = detail::grid_first(); i < n; i += detail::grid_step())
    p[i] = static_cast<uint32_t>(i);
}

__device__ __forceinline__ int64_t lower_bound(const uint32_t* a, int64_t n, uint32_t key) {
  int64_t lo = 0, hi = n;
  while (lo < hi) {
    const int64_t mid = (lo + hi) >> 1;
    if (a[mid] < key) lo = mid + 1; else hi = mid;
  }
  return lo;
}

__global__ void offsets_kernel(const uint32_t* __restrict__ sorted_expert, int64_t n, int E,
                               int32_t* __restrict__ offset, int32_t* __restrict__ frequency) {
  const int e = blockIdx.x * blockDim.x + threadIdx.x;
  if (e > E) return;
  const int64_t lo = lower_bound(sorted_expert, n, static_cast<uint32_t>(e));
  offset[e] = static_cast<int32_t>(lo);
  if (e < E) {
    const int64_t hi = lower_bound(sorted_expert, n, static_cast<uint32_t>(e + 1));
    frequency[e] = static_cast<int32_t>(hi - lo);
  }
}

// nnz: grouped rows in use (device; null = all n). Rows past it hold the empty slots of provided
// routing: their slot gets reverse -1 and the row gathers token 0 (a valid index, never used).
__global__ void inverse_kernel(const int32_t* __restrict__ scatter, int64_t n, int K,
                               const int32_t* __restrict__ nnz, int32_t* __restrict__ reverse,
                               int32_t* __restrict__ gather) {
  const int64_t used = nnz ? *nnz : n;
  for (int64_t r = detail::grid_first(); r < n; r += detail::grid_step()) {
    const int32_t s = scatter[r];
    reverse[s] = r < used ? static_cast<int32_t>(r) : -1;
    gather[r] = r < used ? s / K : 0;
  }
}

__global__ void token_offset_kernel(int32_t* __restrict__ token_offset, int64_t T, int K) {
  for (int64_t t = detail::grid_first(); t <= T; t += detail::grid_step())
    token_offset[t] = static_cast<int32_t>(t * K);
}

// Provided routing, one thread per token (K <= 16): an id outside [-1, E) or one the token already
// listed drops its slot (id -1, score 0) and is flagged; kept slots copy the caller's score. As a
// sort key, -1 reads 0xFFFFFFFF, whose low key_bits(E+1) bits are all ones (>= E): empty slots sort
// after every expert, so expert_offset[E] counts the kept slots.
__global__ void provided_slots_kernel(const int32_t* __restrict__ expert_in, const float* __restrict__ scores_in,
                                      int64_t T, int E, int K, int32_t* __restrict__ expert_out,
                                      float* __restrict__ scores_out, DeviceStatus* status) {
  for (int64_t t = detail::grid_first(); t < T; t += detail::grid_step()) {
    int32_t ids[kMaxTopK];
    uint32_t flags = 0;
    for (int k = 0; k < K; ++k) {
      int32_t id = expert_in[t * K + k];
      if (id < -1 || id >= E) {
        flags |= kStatusInvalidExpertId;
        id = -1;
      }
      for (int j = 0; j < k && id >= 0; ++j)
        if (ids[j] == id) {
          flags |= kStatusDuplicateExpert;
          id = -1;
        }
      ids[k] = id;
      float sc = 0.f;
      if (id >= 0) {
        sc = scores_in[t * K + k];
        if (!isfinite(sc)) flags |= kStatusNonFiniteScores;
      }
      expert_out[t * K + k] = id;
      scores_out[t * K + k] = sc;
    }
    if (flags) atomicOr(&status->flags, flags);
  }
}

__global__ void reset_status_kernel(DeviceStatus* s) {
  s->flags = 0;
  s->nonfinite_tokens = 0;
  s->first_nonfinite_token = INT64_MAX;
}

int key_bits(int E) {
  int b = 1;
  while ((1 << b) < E) ++b;
  return b;
}

// Workspace: [sorted expert keys: TK u32][iota values: TK u32][CUB temp]
struct RoutingWorkspace {
  size_t keys_off = 0, vals_off = 0, cub_off = 0, cub_bytes = 0, total = 0;
};

// The sort runs on key_bits(E + 1) bits: enough for the empty-slot key of provided routing too.
Status plan_workspace(const RoutingProblem& p, RoutingWorkspace* ws) {
  const int64_t tk = p.num_tokens * p.top_k;
  ws->keys_off = 0;
  ws->vals_off = detail::align_workspace(sizeof(uint32_t) * tk);
  ws->cub_off = ws->vals_off + detail::align_workspace(sizeof(uint32_t) * tk);
  ws->cub_bytes = 0;
  if (tk > 0) {
    SMOE_CUDA_RETURN(cub::DeviceRadixSort::SortPairs(
        nullptr, ws->cub_bytes, static_cast<const uint32_t*>(nullptr), static_cast<uint32_t*>(nullptr),
        static_cast<const uint32_t*>(nullptr), static_cast<uint32_t*>(nullptr),
        static_cast<int>(tk), 0, key_bits(p.num_experts + 1)));
  }
  ws->total = ws->cub_off + detail::align_workspace(ws->cub_bytes);
  return Status{};
}

// Routing's kernels cap their grids at 4096 blocks (grid-stride loops cover the rest).
unsigned grid_for(int64_t n, int threads) { return detail::grid_blocks(n, threads, 4096); }

}  // namespace

Status reset_device_status(DeviceStatus* status, cudaStream_t stream) {
  SMOE_RETURN_IF_ERROR(detail::check_ptr(status, "reset_device_status", "status", 8));
  reset_status_kernel<<<1, 1, 0, stream>>>(status);
  SMOE_CHECK_LAUNCH("reset_status_kernel");
  return Status{};
}

Status routing_can_implement(const RoutingProblem& p) {
  return routing::check_routing_shape("topk_routing", p.num_tokens, p.num_experts, p.top_k, p.logits_dtype);
}

Status routing_workspace_size(const RoutingProblem& p, size_t* bytes) {
  SMOE_RETURN_IF_ERROR(detail::check_ptr(bytes, "routing_workspace_size", "bytes", 1));
  SMOE_RETURN_IF_ERROR(routing_can_implement(p));
  RoutingWorkspace ws;
  SMOE_RETURN_IF_ERROR(plan_workspace(p, &ws));
  *bytes = ws.total;
  return Status{};
}

size_t routing_workspace_size(const RoutingProblem& p) {
  size_t bytes = 0;
  return routing_workspace_size(p, &bytes).ok() ? bytes : 0;
}

namespace {

// The argument rules topk_routing and provided_routing share; fills *ws.
Status check_routing_call(const char* fn, const RoutingProblem& p, const RoutingOutputs& o, void* workspace,
                          size_t workspace_bytes, RoutingWorkspace* ws) {
  using detail::check_ptr;
  const bool has_rows = p.num_tokens * p.top_k > 0;
  if (has_rows) {
    SMOE_RETURN_IF_ERROR(check_ptr(o.scores, fn, "outputs.scores", 4));
    SMOE_RETURN_IF_ERROR(check_ptr(o.topk_expert, fn, "outputs.topk_expert", 4));
    SMOE_RETURN_IF_ERROR(check_ptr(o.scatter_idx, fn, "outputs.scatter_idx", 4));
    SMOE_RETURN_IF_ERROR(check_ptr(o.reverse_scatter_idx, fn, "outputs.reverse_scatter_idx", 4));
    SMOE_RETURN_IF_ERROR(check_ptr(o.gather_idx, fn, "outputs.gather_idx", 4));
    SMOE_RETURN_IF_ERROR(check_ptr(workspace, fn, "workspace", kWorkspaceAlignment));
  }
  SMOE_RETURN_IF_ERROR(check_ptr(o.expert_frequency, fn, "outputs.expert_frequency", 4));
  SMOE_RETURN_IF_ERROR(check_ptr(o.expert_offset, fn, "outputs.expert_offset", 4));
  SMOE_RETURN_IF_ERROR(check_ptr(o.status, fn, "outputs.status", 8));
  if (o.token_offset) SMOE_RETURN_IF_ERROR(check_ptr(o.token_offset, fn, "outputs.token_offset", 4));
  SMOE_RETURN_IF_ERROR(plan_workspace(p, ws));
  if (workspace_bytes < ws->total)
    return detail::make_status(
        StatusCode::kWorkspaceTooSmall,
        detail::concat(fn, ": workspace_bytes = ", workspace_bytes,
                       " is smaller than routing_workspace_size() = ", ws->total));
  return Status{};
}

// From the per-entry expert ids in o.topk_expert (-1 = empty, sorting last): sort, offsets,
// inverse, token offsets. `has_empty`: rows past expert_offset[E] are empty slots.
Status group_entries(const RoutingProblem& p, const RoutingOutputs& o, const RoutingWorkspace& ws,
                     void* workspace, bool has_empty, cudaStream_t stream) {
  const int64_t T = p.num_tokens;
  const int E = p.num_experts, K = p.top_k;
  const int64_t tk = T * K;
  if (o.token_offset) {
    token_offset_kernel<<<grid_for(T + 1, kThreads), kThreads, 0, stream>>>(o.token_offset, T, K);
    SMOE_CHECK_LAUNCH("token_offset_kernel");
  }
  if (tk == 0) {
    // No routed rows: every expert is empty.
    SMOE_CUDA_RETURN(cudaMemsetAsync(o.expert_frequency, 0, sizeof(int32_t) * E, stream));
    SMOE_CUDA_RETURN(cudaMemsetAsync(o.expert_offset, 0, sizeof(int32_t) * (E + 1), stream));
    return Status{};
  }
  char* base = static_cast<char*>(workspace);
  uint32_t* sorted_keys = reinterpret_cast<uint32_t*>(base + ws.keys_off);
  uint32_t* iota = reinterpret_cast<uint32_t*>(base + ws.vals_off);
  iota_kernel<<<grid_for(tk, kThreads), kThreads, 0, stream>>>(iota, tk);
  SMOE_CHECK_LAUNCH("iota_kernel");

  size_t cub_bytes = ws.cub_bytes;
  SMOE_CUDA_RETURN(cub::DeviceRadixSort::SortPairs(
      base + ws.cub_off, cub_bytes, reinterpret_cast<const uint32_t*>(o.topk_expert), sorted_keys,
      iota, reinterpret_cast<uint32_t*>(o.scatter_idx), static_cast<int>(tk), 0, key_bits(E + 1),
      stream));

  offsets_kernel<<<(E + 1 + kThreads - 1) / kThreads, kThreads, 0, stream>>>(
      sorted_keys, tk, E, o.expert_offset, o.expert_frequency);
  SMOE_CHECK_LAUNCH("offsets_kernel");
  inverse_kernel<<<grid_for(tk, kThreads), kThreads, 0, stream>>>(
      o.scatter_idx, tk, K, has_empty ? o.expert_offset + E : nullptr, o.reverse_scatter_idx, o.gather_idx);
  SMOE_CHECK_LAUNCH("inverse_kernel");
  return Status{};
}

}  // namespace

Status topk_routing(const RoutingProblem& p, const void* logits, const RoutingOutputs& o,
                    void* workspace, size_t workspace_bytes, cudaStream_t stream) {
  SMOE_RETURN_IF_ERROR(routing_can_implement(p));
  const char* fn = "topk_routing";
  const int64_t T = p.num_tokens;
  const int E = p.num_experts, K = p.top_k;
  if (T * K > 0)
    SMOE_RETURN_IF_ERROR(
        detail::check_ptr(logits, fn, "logits", p.logits_dtype == DType::kFloat32 ? 4 : 2));
  RoutingWorkspace ws;
  SMOE_RETURN_IF_ERROR(check_routing_call(fn, p, o, workspace, workspace_bytes, &ws));

  if (T > 0) {
    const unsigned blocks = static_cast<unsigned>((T + kWarpsPerBlock - 1) / kWarpsPerBlock);
    routing::with_per_lane(E, [&](auto per_lane) {
      constexpr int J = decltype(per_lane)::value;
      if (p.logits_dtype == DType::kFloat32)
        topk_softmax_kernel<float, J><<<blocks, kWarpsPerBlock * 32, 0, stream>>>(
            static_cast<const float*>(logits), T, E, K, o.scores, o.topk_expert, o.status);
      else
        topk_softmax_kernel<bf16, J><<<blocks, kWarpsPerBlock * 32, 0, stream>>>(
            static_cast<const bf16*>(logits), T, E, K, o.scores, o.topk_expert, o.status);
    });
    SMOE_CHECK_LAUNCH("topk_softmax_kernel");
  }
  return group_entries(p, o, ws, workspace, /*has_empty=*/false, stream);
}

Status provided_routing(const RoutingProblem& p, const int32_t* expert, const float* scores,
                        const RoutingOutputs& o, void* workspace, size_t workspace_bytes,
                        cudaStream_t stream) {
  const char* fn = "provided_routing";
  // logits_dtype is not used here (no logits): not checked.
  SMOE_RETURN_IF_ERROR(routing::check_routing_shape(fn, p.num_tokens, p.num_experts, p.top_k, DType::kFloat32));
  const int64_t T = p.num_tokens;
  if (T * p.top_k > 0) {
    SMOE_RETURN_IF_ERROR(detail::check_ptr(expert, fn, "expert", 4));
    SMOE_RETURN_IF_ERROR(detail::check_ptr(scores, fn, "scores", 4));
  }
  RoutingWorkspace ws;
  SMOE_RETURN_IF_ERROR(check_routing_call(fn, p, o, workspace, workspace_bytes, &ws));
  if (T > 0) {
    provided_slots_kernel<<<grid_for(T, kThreads), kThreads, 0, stream>>>(
        expert, scores, T, p.num_experts, p.top_k, o.topk_expert, o.scores, o.status);
    SMOE_CHECK_LAUNCH("provided_slots_kernel");
  }
  return group_entries(p, o, ws, workspace, /*has_empty=*/true, stream);
}

}  // namespace smoe
