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
#pragma once

#include <climits>
#include <cstdint>
#include <type_traits>

#include <cuda_bf16.h>

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

// The routing order: larger value first; equal values -> lower expert index first.
__device__ __forceinline__ bool ranks_before(float v, int i, float bv, int bi) {
  return v > bv || (v == bv && i < bi);
}

template <int kPerLane>
struct WarpTopK {
  static_assert(kPerLane >= 1 && kPerLane <= kMaxPerLane, "1..16 logits a lane");
  float v[kPerLane];     // this lane's logits (NaN -> -inf, -inf past E)
  float val;             // lane k < K: the k-th largest logit
  int idx;               // lane k < K: its expert
  float score;           // lane k < K: softmax over the K chosen
  bool nonfinite;        // this lane saw a NaN / +-Inf logit
};

// E <= 32 * kPerLane (the caller's instance comes from with_per_lane(E)).
template <int kPerLane, typename TIn>
__device__ __forceinline__ void warp_topk_softmax(const TIn* row, int E, int K, int lane, WarpTopK<kPerLane>* r) {
  uint32_t taken = 0;  // bit j: expert lane+32j already chosen (or does not exist)
  r->nonfinite = false;
#pragma unroll
  for (int j = 0; j < kPerLane; ++j) {
    const int e = lane + 32 * j;
    float x = -INFINITY;
    if (e < E) {
      x = load_logit(row + e);
      if (!isfinite(x)) {
        r->nonfinite = true;
        if (isnan(x)) x = -INFINITY;  // NaN ranks below every number (and is reported)
      }
    } else {
      taken |= 1u << j;
    }
    r->v[j] = x;
  }
  r->val = -INFINITY;
  r->idx = 0;
  for (int k = 0; k < K; ++k) {
    float bv = -INFINITY;
    int bi = INT_MAX;
#pragma unroll
    for (int j = 0; j < kPerLane; ++j) {
      const int e = lane + 32 * j;
      if (!((taken >> j) & 1u) && ranks_before(r->v[j], e, bv, bi)) {
        bv = r->v[j];
        bi = e;
      }
    }
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) {
      const float ov = __shfl_xor_sync(0xffffffffu, bv, off);
      const int oi = __shfl_xor_sync(0xffffffffu, bi, off);
      if (ranks_before(ov, oi, bv, bi)) {
        bv = ov;
        bi = oi;
      }
    }
    // K <= E guarantees a real expert was found (bi < E).
    if (bi < E && (bi & 31) == lane) taken |= 1u << (bi >> 5);
    if (lane == k) {
      r->val = bv;
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
