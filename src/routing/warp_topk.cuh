// One warp's top-K softmax over a row of E <= 512 logits: the routing decision shared by top-K
// routing (routing.cu) and token rounding (token_rounding.cu), so both choose bit-identically.
//   Lane l holds logits l, l+32, ... in registers (at most 16 a lane); K rounds of a warp arg-max
//   under (value desc, index asc) pick the experts; lane k keeps choice k, so the softmax over the
//   K chosen is one warp sum. NaN ranks below every number and, like +-Inf, is reported.
//   kPerLane (1, 2, 4, 8 or 16 logits a lane, per_lane_for(E)) bounds the per-lane loops at
//   compile time: every slot past E is -inf and taken, so a smaller kPerLane >= E/32 chooses the
//   same experts bit for bit and skips the dead slots. With the loops always at 16 (E <= 512), E =
//   128 spent 12 of every 16 compares of each of the K rounds on slots past E: the kernel was issue
//   bound (SM 90% under ncu, 111 us at T 32768, E 128, K 8: 2/3 of the routing stage).
//   Each round's warp arg-max is two hardware reductions (redux.sync) on 32-bit keys of the
//   routing order (routing_key.h): the largest key, then the lowest expert holding it. The
//   five shuffle steps of a (value, index) pair it replaced were 10 dependent shuffles and ~30
//   compares and selects a round; the choices are the same bit for bit. On the H100 the routing
//   stage went x1.04-1.72 over the 11 public configs (bench/results/h100/topk_redux_ab.md).
#pragma once

#include <cstdint>
#include <type_traits>

#include <cuda_bf16.h>

#include "routing/routing_key.h"
#include "smoe/smoe.h"

namespace smoe {
namespace routing {

constexpr int kMaxPerLane = kMaxExperts / 32;  // 16

// Logits per lane for E experts: the smallest power of two >= ceil(E / 32) (1 <= E <= 512).
__host__ __device__ constexpr int per_lane_for(int E) {
  return E <= 32 ? 1 : E <= 64 ? 2 : E <= 128 ? 4 : E <= 256 ? 8 : 16;
}

// Calls f(std::integral_constant<int, kPerLane>{}) with kPerLane = per_lane_for(E): the one place
// that maps E to the kernel instance (routing.cu and token_rounding.cu launch through it).
template <class F>
decltype(auto) with_per_lane(int E, F&& f) {
  switch (per_lane_for(E)) {
    case 1: return f(std::integral_constant<int, 1>{});
    case 2: return f(std::integral_constant<int, 2>{});
    case 4: return f(std::integral_constant<int, 4>{});
    case 8: return f(std::integral_constant<int, 8>{});
    default: return f(std::integral_constant<int, 16>{});
  }
}

__device__ __forceinline__ float load_logit(const float* p) { return __ldg(p); }
__device__ __forceinline__ float load_logit(const bf16* p) { return __bfloat162float(*p); }

template <int kPerLane>
struct WarpTopK {
  static_assert(kPerLane >= 1 && kPerLane <= kMaxPerLane, "1..16 logits a lane");
  uint32_t key[kPerLane];  // routing_key of this lane's logits (NaN -> -inf); kTakenKey past E
  float val;               // lane k < K: the k-th largest logit
  int idx;                 // lane k < K: its expert
  float score;             // lane k < K: softmax over the K chosen
  bool nonfinite;          // this lane saw a NaN / +-Inf logit
  // Logit lane + 32 j (< E) as the routing saw it: NaN -> -inf, -0 -> +0.
  __device__ __forceinline__ float logit(int j) const { return routing_value(key[j]); }
};

// E <= 32 * kPerLane (the caller's instance comes from with_per_lane(E)).
template <int kPerLane, typename TIn>
__device__ __forceinline__ void warp_topk_softmax(const TIn* row, int E, int K, int lane, WarpTopK<kPerLane>* r) {
  r->nonfinite = false;
#pragma unroll
  for (int j = 0; j < kPerLane; ++j) {
    const int e = lane + 32 * j;
    uint32_t key = kTakenKey;
    if (e < E) {
      float x = load_logit(row + e);
      if (!isfinite(x)) {
        r->nonfinite = true;
        if (isnan(x)) x = -INFINITY;  // NaN ranks below every number (and is reported)
      }
      key = routing_key(x);
    }
    r->key[j] = key;
  }
  uint32_t taken = 0;  // bit j: expert lane + 32 j already chosen
  r->val = -INFINITY;
  r->idx = 0;
  for (int k = 0; k < K; ++k) {
    // This lane's best: the largest key not taken, the lowest slot among equals (slots ascend
    // with the expert index, so a strict > keeps the first).
    uint32_t bk = kTakenKey;
    int bj = 0;
#pragma unroll
    for (int j = 0; j < kPerLane; ++j) {
      const uint32_t key = ((taken >> j) & 1u) ? kTakenKey : r->key[j];
      if (key > bk) {
        bk = key;
        bj = j;
      }
    }
    // The warp's: the largest key, then the lowest expert among the lanes holding it. K <= E
    // guarantees a real expert remains (a key above kTakenKey).
    const uint32_t best = __reduce_max_sync(0xffffffffu, bk);
    const unsigned cand = (bk == best) ? static_cast<unsigned>(lane + 32 * bj) : 0xffffffffu;
    const int bi = static_cast<int>(__reduce_min_sync(0xffffffffu, cand));
    if ((bi & 31) == lane) taken |= 1u << (bi >> 5);
    if (lane == k) {
      r->val = routing_value(best);
      r->idx = bi;
    }
  }
  // Softmax over the K chosen: the first choice is the maximum.
  const float mx = __shfl_sync(0xffffffffu, r->val, 0);
  const float ex = (lane < K) ? expf(r->val - mx) : 0.f;
  float sum = ex;
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, off);
  r->score = ex / sum;
}

// The sticky status of a token with a non-finite logit (integer atomics only: order-independent).
__device__ __forceinline__ void record_nonfinite(bool lane_nonfinite, int lane, int64_t t, DeviceStatus* status) {
  if (__any_sync(0xffffffffu, lane_nonfinite) && lane == 0) {
    atomicOr(&status->flags, static_cast<uint32_t>(kStatusNonFiniteLogits));
    atomicAdd(&status->nonfinite_tokens, 1u);
    atomicMin(reinterpret_cast<unsigned long long*>(&status->first_nonfinite_token),
              static_cast<unsigned long long>(t));
  }
}

}  // namespace routing
}  // namespace smoe
