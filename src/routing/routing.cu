// Top-K softmax routing and routing metadata on the GPU.
//
// Pipeline (all on `stream`, no host sync, no allocation):
//   1. topk_softmax_kernel: one warp per token. Lane l holds logits l, l+32, ... (E <= 512, so at
//      most 16 per lane, in registers; the kernel instance holds per_lane_for(E) of them). K
//      rounds of a warp arg-max over (value desc, index asc) pick the experts; lane k keeps
//      choice k, so the softmax over the K chosen is one warp sum. NaN / Inf logits are recorded
//      in the sticky DeviceStatus (integer atomics only).
//   2. Grouping: a stable counting sort of the entries f = t*K+k by key = expert (E for an empty
//      slot of provided routing, so empties follow every expert), in three kernels. The entries
//      are cut into contiguous warp ranges, numbered block-major: global warp g owns
//      [g * span, (g+1) * span), so "earlier warp" means "lower entries".
//      a. count_keys_kernel: each block counts its entries' keys in a shared histogram (integer
//         atomics: counts do not depend on the order of the adds) into counts[key][block]. Also
//         writes token_offset (saves a launch).
//      b. prefix_counts_kernel: one warp per key scans the key's counts over the blocks into
//         prefix[key][block] (its entries in earlier blocks) and totals[key].
//      c. scatter_entries_kernel: each block counts again, per warp, and adds the key starts (a
//         block-wide exclusive sum of totals; block 0 writes expert_offset and expert_frequency
//         from it) and prefix[key][block] to get each warp's running row per key. Each warp then
//         walks its range in order, 32 entries a step: the lanes of one key (one ballot per key
//         bit) take rows running[key] + (their rank among those lanes). Writes scatter_idx,
//         reverse_scatter_idx and gather_idx (-1 / token 0 for empty slots).
//      Rows of one key come out in entry order (warps, steps and lanes are all walked in entry
//      order), so the output is exactly that of a stable sort, bitwise deterministic. It replaced
//      iota -> CUB radix sort -> binary-search offsets -> inverse (6 launches, ~46 us of GPU time
//      at T*K = 262144 on the H200 under ncu, the offsets kernel's 18 dependent loads 12.6 us); at
//      E = 512 these three took 5.6 + 4.1 + 13.8 us under ncu, and provided_routing 27 us instead
//      of 63 us by wall clock (T = 32768, K = 8), with bit-identical outputs.
#include <algorithm>
#include <climits>
#include <cstdint>

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

// ---- grouping: a stable counting sort of the entries by key (see the pipeline above) ----------

constexpr int kGroupWarps = 8;        // warps of a count / scatter block
constexpr int kGroupThreads = kGroupWarps * 32;
constexpr int kStepsInFlight = 8;     // 32-entry steps whose keys a warp loads before using them
constexpr int kMinWarpSteps = 4;      // a warp range holds at least this many steps
constexpr int kMaxGroupBlocks = 1024; // count / scatter blocks (then the warp ranges grow)
constexpr int kPrefixWarps = 8;       // keys (one a warp) per prefix_counts_kernel block
constexpr int kKeysPerThread = (kMaxExperts + 1 + kGroupThreads - 1) / kGroupThreads;  // first_rows
constexpr int bit_width(int v) { return v == 0 ? 0 : 1 + bit_width(v >> 1); }
constexpr int kKeyBits = bit_width(kMaxExperts + 1);  // keys 0..E+1 (see entry_key): 10 at E <= 512
static_assert(sizeof(int32_t) * kGroupWarps * (kMaxExperts + 1) + 32 * sizeof(int32_t) <= 48 * 1024,
              "the scatter block's per-warp histograms and warp sums must fit the default 48 KB of "
              "shared memory (no opt-in attribute): E <= 1531");
static_assert(kMaxGroupBlocks % 32 == 0, "prefix_counts_kernel scans a key's blocks in whole warps");

// Keys: 0..E-1 the experts, E the empty slot (-1; any id outside [0, E) would be, but the routing
// kernels leave only -1), E+1 a lane past the end of its warp's range (counted nowhere).
__device__ __forceinline__ int entry_key(const int32_t* __restrict__ expert, int64_t f, int64_t end, int E) {
  if (f >= end) return E + 1;
  const int32_t id = __ldg(expert + f);
  return static_cast<uint32_t>(id) < static_cast<uint32_t>(E) ? id : E;
}

// The lanes of this warp holding `key`, as __match_any_sync would say, from one independent ballot
// per key bit: a fixed kKeyBits votes that pipeline. The first version used __match_any_sync; its
// kernels were slower under ncu (count 11.8 us at E = 512), though that was not isolated from the
// other changes made with this one.
__device__ __forceinline__ unsigned lanes_with_key(int key) {
  unsigned peers = 0xffffffffu;
#pragma unroll
  for (int b = 0; b < kKeyBits; ++b) {
    const bool set = (key >> b) & 1;
    const unsigned voted = __ballot_sync(0xffffffffu, set);
    peers &= set ? voted : ~voted;
  }
  return peers;
}

// This warp's entries: global warp g = block * kGroupWarps + warp owns [g * span, (g+1) * span).
struct WarpRange {
  int64_t begin, end;
};
__device__ __forceinline__ WarpRange warp_range(int64_t tk, int64_t span) {
  const int64_t g = static_cast<int64_t>(blockIdx.x) * kGroupWarps + (threadIdx.x >> 5);
  const int64_t begin = g * span;
  return {begin, begin + span < tk ? begin + span : tk};
}

// Calls step(f, key) for lane's entry of each 32-entry step of [begin, end), in order, the whole
// warp together (step may use warp-synchronous intrinsics). The keys of kStepsInFlight steps are
// loaded first, so their load latencies overlap instead of adding up.
template <class Step>
__device__ __forceinline__ void walk_warp_range(const int32_t* __restrict__ expert, WarpRange r, int E,
                                                Step&& step) {
  const int lane = threadIdx.x & 31;
  for (int64_t f0 = r.begin; f0 < r.end; f0 += 32 * kStepsInFlight) {
    int key[kStepsInFlight];
#pragma unroll
    for (int j = 0; j < kStepsInFlight; ++j) key[j] = entry_key(expert, f0 + 32 * j + lane, r.end, E);
#pragma unroll
    for (int j = 0; j < kStepsInFlight; ++j)
      if (f0 + 32 * j < r.end) step(f0 + 32 * j + lane, key[j]);  // warp-uniform condition
  }
}

// counts[key * gridDim.x + block] = entries of `key` in this block's warp ranges (key-major: a
// key's blocks are contiguous for prefix_counts_kernel). A block-wide shared histogram with integer
// atomics: the counts do not depend on the order of the adds. token_offset (optional, [T+1]) =
// t * K rides along to save a launch.
__global__ void __launch_bounds__(kGroupThreads)
    count_keys_kernel(const int32_t* __restrict__ expert, int64_t tk, int E, int64_t span,
                      int32_t* __restrict__ counts, int32_t* __restrict__ token_offset, int64_t T, int K) {
  extern __shared__ int32_t hist[];  // [E+1]
  const int keys = E + 1;
  for (int k = threadIdx.x; k < keys; k += blockDim.x) hist[k] = 0;
  __syncthreads();
  walk_warp_range(expert, warp_range(tk, span), E, [&](int64_t, int key) {
    if (key < keys) atomicAdd(&hist[key], 1);
  });
  __syncthreads();
  for (int k = threadIdx.x; k < keys; k += blockDim.x)
    counts[static_cast<int64_t>(k) * gridDim.x + blockIdx.x] = hist[k];
  if (token_offset)
    for (int64_t t = detail::grid_first(); t <= T; t += detail::grid_step())
      token_offset[t] = static_cast<int32_t>(t * K);
}

// One warp per key: counts[key][0..blocks) -> their exclusive prefix sum in place (the key's
// entries in earlier blocks), totals[key] = the key's entries. Every load is issued before the
// first is used (kMaxGroupBlocks / 32 a lane): a one-block scan that walked the counts one
// dependent load at a time took 80 us at E = 512 under ncu. Sums stay <= T*K <= 2^31-1 (int32).
__global__ void __launch_bounds__(kPrefixWarps * 32)
    prefix_counts_kernel(int32_t* __restrict__ counts, int keys, int blocks, int32_t* __restrict__ totals) {
  const int key = blockIdx.x * kPrefixWarps + (threadIdx.x >> 5);
  const int lane = threadIdx.x & 31;
  if (key >= keys) return;  // whole warps
  int32_t* row = counts + static_cast<int64_t>(key) * blocks;
  constexpr int kChunks = kMaxGroupBlocks / 32;
  int32_t v[kChunks];
#pragma unroll
  for (int j = 0; j < kChunks; ++j) v[j] = 32 * j + lane < blocks ? row[32 * j + lane] : 0;
  int32_t carry = 0;
#pragma unroll
  for (int j = 0; j < kChunks; ++j) {
    if (32 * j >= blocks) break;  // warp-uniform
    int32_t incl = v[j];
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const int32_t up = __shfl_up_sync(0xffffffffu, incl, o);
      if (lane >= o) incl += up;
    }
    if (32 * j + lane < blocks) row[32 * j + lane] = carry + incl - v[j];
    carry += __shfl_sync(0xffffffffu, incl, 31);
  }
  if (lane == 0) totals[key] = carry;
}

// Exclusive prefix sum of v over the block's kGroupThreads threads; all threads call it.
__device__ __forceinline__ int32_t block_exclusive_sum(int32_t v, int32_t* warp_sums /* __shared__ [32] */) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  int32_t incl = v;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const int32_t up = __shfl_up_sync(0xffffffffu, incl, o);
    if (lane >= o) incl += up;
  }
  if (lane == 31) warp_sums[warp] = incl;
  __syncthreads();
  if (warp == 0) {
    const int32_t s = lane < kGroupWarps ? warp_sums[lane] : 0;
    int32_t s_incl = s;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const int32_t up = __shfl_up_sync(0xffffffffu, s_incl, o);
      if (lane >= o) s_incl += up;
    }
    warp_sums[lane] = s_incl - s;
  }
  __syncthreads();
  return warp_sums[warp] + incl - v;
}

// The keys a thread of a scatter block owns for first_rows: a contiguous run, so the key starts
// are one block-wide sum. Their totals and prefixes are loaded at the kernel's start, so those
// loads overlap the counting.
struct OwnedKeys {
  int first;                       // keys [first, first + kKeysPerThread) that are < E+1
  int32_t total[kKeysPerThread];   // totals[key]: the key's entries
  int32_t before[kKeysPerThread];  // prefix[key][block]: its entries in earlier blocks
};

__device__ __forceinline__ OwnedKeys load_owned_keys(const int32_t* __restrict__ totals,
                                                     const int32_t* __restrict__ prefix, int keys) {
  OwnedKeys o;
  o.first = threadIdx.x * kKeysPerThread;
#pragma unroll
  for (int i = 0; i < kKeysPerThread; ++i) {
    const int k = o.first + i;
    o.total[i] = k < keys ? totals[k] : 0;
    o.before[i] = k < keys ? prefix[static_cast<int64_t>(k) * gridDim.x + blockIdx.x] : 0;
  }
  return o;
}

// Turns the block's per-warp counts hist[w][key] into each warp's first row per key: the key's start
// (the exclusive sum of totals over lower keys, the empty key last) + its entries in earlier blocks
// + in earlier warps of this block. Block 0 also writes expert_offset (E+1 values: [E] = the first
// empty row = the non-empty entries) and expert_frequency. Ends with __syncthreads.
__device__ __forceinline__ void first_rows(const OwnedKeys& o, int E, int32_t* hist, int32_t* __restrict__ offset,
                                           int32_t* __restrict__ frequency) {
  __shared__ int32_t warp_sums[32];
  const int keys = E + 1;
  int32_t sum = 0;
#pragma unroll
  for (int i = 0; i < kKeysPerThread; ++i) sum += o.total[i];
  int32_t start = block_exclusive_sum(sum, warp_sums);
#pragma unroll
  for (int i = 0; i < kKeysPerThread; ++i) {
    const int k = o.first + i;
    if (k < keys) {
      if (blockIdx.x == 0) {
        offset[k] = start;
        if (k < E) frequency[k] = o.total[i];
      }
      int32_t row = start + o.before[i];
#pragma unroll
      for (int w = 0; w < kGroupWarps; ++w) {
        const int32_t count = hist[w * keys + k];
        hist[w * keys + k] = row;
        row += count;
      }
      start += o.total[i];
    }
  }
  __syncthreads();
}

// Counts each warp's range into its own histogram (hist + warp * (E+1), zeroed here; integer
// shared atomics, whose counts do not depend on the order of the adds), turns them into first rows
// (first_rows), then each warp walks its range again in order: a lane's row = next[key] + the lower
// lanes of its key group, and the group's highest lane, whose row is the group's last, moves
// next[key] past it. A non-empty entry f gets reverse[f] = row, gather[row] = f / K; an empty slot
// reverse[f] = -1 and gather[row] = 0 (a valid token, never used).
__global__ void __launch_bounds__(kGroupThreads)
    scatter_entries_kernel(const int32_t* __restrict__ expert, int64_t tk, int E, int K, int64_t span,
                           const int32_t* __restrict__ prefix, const int32_t* __restrict__ totals,
                           int32_t* __restrict__ offset, int32_t* __restrict__ frequency,
                           int32_t* __restrict__ scatter, int32_t* __restrict__ reverse,
                           int32_t* __restrict__ gather) {
  extern __shared__ int32_t next_row[];  // [warps][E+1]: first the counts, then the running rows
  const int keys = E + 1;
  const OwnedKeys owned = load_owned_keys(totals, prefix, keys);
  for (int i = threadIdx.x; i < kGroupWarps * keys; i += blockDim.x) next_row[i] = 0;
  __syncthreads();
  int32_t* mine = next_row + (threadIdx.x >> 5) * keys;
  const WarpRange range = warp_range(tk, span);
  walk_warp_range(expert, range, E, [&](int64_t, int key) {
    if (key < keys) atomicAdd(&mine[key], 1);
  });
  __syncthreads();
  first_rows(owned, E, next_row, offset, frequency);
  const int lane = threadIdx.x & 31;
  const unsigned lower_lanes = (1u << lane) - 1u;
  walk_warp_range(expert, range, E, [&](int64_t f, int key) {
    const unsigned group = lanes_with_key(key);
    int32_t row = 0;
    if (key < keys) {
      row = mine[key] + __popc(group & lower_lanes);
      const int32_t entry = static_cast<int32_t>(f);  // f < T*K <= 2^31-1
      scatter[row] = entry;
      reverse[entry] = key < E ? row : -1;
      gather[row] = key < E ? entry / K : 0;
    }
    __syncwarp();  // every lane of the group has read next[key] before it moves
    if (key < keys && lane == 31 - __clz(group)) mine[key] = row + 1;
    __syncwarp();
  });
}

// Provided routing, one thread per token (K <= 16): an id outside [-1, E) or one the token already
// listed drops its slot (id -1, score 0) and is flagged; kept slots copy the caller's score. The
// grouping's key of -1 is E (entry_key): empty slots follow every expert, so expert_offset[E] counts
// the kept slots.
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

// The grouping's launch shape: `blocks` blocks of kGroupWarps warps, each warp owning `span` (a
// multiple of 32) consecutive entries: enough blocks to give every warp kMinWarpSteps steps, at
// most kMaxGroupBlocks (then the ranges grow). At T*K = 262144: 256 blocks, 4 steps a warp.
struct GroupingPlan {
  int keys = 0;  // E + 1: the experts and the empty slot
  int blocks = 0;
  int64_t span = 0;
};

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

GroupingPlan plan_grouping(int64_t tk, int E) {
  GroupingPlan g;
  g.keys = E + 1;
  const int64_t blocks =
      std::clamp<int64_t>(ceil_div(tk, int64_t{32} * kMinWarpSteps * kGroupWarps), 1, kMaxGroupBlocks);
  g.span = ceil_div(ceil_div(tk, blocks * kGroupWarps), 32) * 32;
  g.blocks = static_cast<int>(ceil_div(tk, g.span * kGroupWarps));  // the rounding up may free a block
  return g;
}

// Workspace: [counts, then their per-key prefix: (E+1) * blocks int32][totals: E+1 int32].
// Nothing for T*K = 0.
struct RoutingWorkspace {
  GroupingPlan grouping;
  size_t counts_off = 0, totals_off = 0, total = 0;
};

RoutingWorkspace plan_workspace(const RoutingProblem& p) {
  RoutingWorkspace ws;
  const int64_t tk = p.num_tokens * p.top_k;
  if (tk == 0) return ws;
  const GroupingPlan& g = ws.grouping = plan_grouping(tk, p.num_experts);
  ws.counts_off = 0;
  ws.totals_off = detail::align_workspace(sizeof(int32_t) * static_cast<size_t>(g.keys) * g.blocks);
  ws.total = ws.totals_off + detail::align_workspace(sizeof(int32_t) * g.keys);
  return ws;
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
  *bytes = plan_workspace(p).total;
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
  *ws = plan_workspace(p);
  if (workspace_bytes < ws->total)
    return detail::make_status(
        StatusCode::kWorkspaceTooSmall,
        detail::concat(fn, ": workspace_bytes = ", workspace_bytes,
                       " is smaller than routing_workspace_size() = ", ws->total));
  return Status{};
}

// From the per-entry expert ids in o.topk_expert (-1 = empty, grouped after every expert): the
// stable counting sort (count, scan, scatter), expert offsets and frequencies, token offsets.
Status group_entries(const RoutingProblem& p, const RoutingOutputs& o, const RoutingWorkspace& ws,
                     void* workspace, cudaStream_t stream) {
  const int64_t T = p.num_tokens;
  const int E = p.num_experts, K = p.top_k;
  const int64_t tk = T * K;
  if (tk == 0) {
    // No routed rows: every expert is empty; token_offset is the single 0 (T = 0 since K >= 1).
    SMOE_CUDA_RETURN(cudaMemsetAsync(o.expert_frequency, 0, sizeof(int32_t) * E, stream));
    SMOE_CUDA_RETURN(cudaMemsetAsync(o.expert_offset, 0, sizeof(int32_t) * (E + 1), stream));
    if (o.token_offset) SMOE_CUDA_RETURN(cudaMemsetAsync(o.token_offset, 0, sizeof(int32_t), stream));
    return Status{};
  }
  const GroupingPlan& g = ws.grouping;
  char* base = static_cast<char*>(workspace);
  int32_t* counts = reinterpret_cast<int32_t*>(base + ws.counts_off);
  int32_t* totals = reinterpret_cast<int32_t*>(base + ws.totals_off);
  const size_t hist_bytes = sizeof(int32_t) * g.keys;
  count_keys_kernel<<<g.blocks, kGroupThreads, hist_bytes, stream>>>(o.topk_expert, tk, E, g.span, counts,
                                                                      o.token_offset, T, K);
  SMOE_CHECK_LAUNCH("count_keys_kernel");
  prefix_counts_kernel<<<(g.keys + kPrefixWarps - 1) / kPrefixWarps, kPrefixWarps * 32, 0, stream>>>(
      counts, g.keys, g.blocks, totals);
  SMOE_CHECK_LAUNCH("prefix_counts_kernel");
  scatter_entries_kernel<<<g.blocks, kGroupThreads, kGroupWarps * hist_bytes, stream>>>(
      o.topk_expert, tk, E, K, g.span, counts, totals, o.expert_offset, o.expert_frequency, o.scatter_idx,
      o.reverse_scatter_idx, o.gather_idx);
  SMOE_CHECK_LAUNCH("scatter_entries_kernel");
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
  return group_entries(p, o, ws, workspace, stream);
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
  return group_entries(p, o, ws, workspace, stream);
}

}  // namespace smoe
