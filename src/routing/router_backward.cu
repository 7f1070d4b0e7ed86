// Router backward kernels (see router_backward.h). Deterministic: every output element is written
// by one thread (or lane), sums run in a fixed order, no atomics.
//
// Derivation (top-K softmax over the K chosen, s = scores, dS = dL/ds by entry):
//   dlogit_k = s_k (dS_k - sum_j s_j dS_j) = s_k sum_{j!=k} s_j (dS_k - dS_j) for the K chosen
//   experts (the second form is the one computed), 0 elsewhere.
#include <cmath>
#include <cstdint>

#include <cuda_bf16.h>

#include "common/check.h"
#include "common/grid_stride.h"
#include "routing/router_backward.h"

namespace smoe {
namespace routing {
namespace {

constexpr int kThreads = 256;

unsigned grid_for(int64_t n) { return detail::grid_blocks(n, kThreads); }

// One thread per token: dl[t,k] and the K non-zeros of the dense bf16 dlogits row (pre-zeroed).
__global__ void router_backward_kernel(const float* __restrict__ dS, const float* __restrict__ scores,
                                       const int32_t* __restrict__ topk, int K, int E, int64_t T,
                                       float* __restrict__ dl, bf16* __restrict__ dlogits_dense,
                                       const int32_t* valid) {
  if (valid != nullptr && *valid == 0) return;
  for (int64_t t = detail::grid_first(); t < T; t += detail::grid_step()) {
    // s_k (dS_k - sum_j s_j dS_j) = s_k sum_{j != k} s_j (dS_k - dS_j): no cancellation when
    // one score saturates at 1 (the plain form loses every digit there). O(K^2), K <= 16.
    for (int k = 0; k < K; ++k) {
      const float dk = dS[t * K + k];
      float acc = 0.f;
      for (int j = 0; j < K; ++j)
        if (j != k) acc += scores[t * K + j] * (dk - dS[t * K + j]);
      const float g = scores[t * K + k] * acc;
      dl[t * K + k] = g;
      dlogits_dense[t * E + topk[t * K + k]] = __float2bfloat16_rn(g);
    }
  }
}

// Token-rounding router backward, one warp per token (derivation: ref::token_rounding_router_
// backward_ref). Softmax over E: S_j = exp(l_j - max) / sum. A padded entry p (expert not among the
// token's top-K) adds dS_p S_{e_p} (delta - S_j): dl_j = -S_j G + [j = e_p] dS_p S_{e_p} with
// G = sum_p dS_p S_{e_p}. A kept chosen entry's dS enters the top-K softmax part (dropped chosen
// ones count as dS = 0). Every dl_j is written, in a fixed order: deterministic.
__global__ void router_backward_tr_kernel(const float* __restrict__ dS, const int32_t* __restrict__ entry_expert,
                                          const int32_t* __restrict__ token_offset,
                                          const int32_t* __restrict__ topk, const float* __restrict__ topk_score,
                                          const float* __restrict__ logits, int K, int E, int64_t T,
                                          bf16* __restrict__ dlogits, const int32_t* valid) {
  if (valid != nullptr && *valid == 0) return;
  const int lane = threadIdx.x & 31;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * (blockDim.x >> 5);
  for (int64_t t = blockIdx.x * static_cast<int64_t>(blockDim.x >> 5) + (threadIdx.x >> 5); t < T; t += warps) {
    const float* row = logits + t * E;
    float mx = -INFINITY;
    for (int e = lane; e < E; e += 32) mx = fmaxf(mx, row[e]);
    for (int off = 16; off > 0; off >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, off));
    float sum = 0.f;
    for (int e = lane; e < E; e += 32) sum += expf(row[e] - mx);
    for (int off = 16; off > 0; off >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, off);
    const float inv = 1.f / sum;
    // Lane k < K: the top-K choice k and the dS of its entry (0 if rounding dropped it).
    const int my_e = lane < K ? topk[t * K + lane] : -1;
    const float my_s = lane < K ? topk_score[t * K + lane] : 0.f;
    float my_ds = 0.f;
    float G = 0.f;  // sum over padded entries of dS_p S_{e_p}, same order on every lane
    const int32_t j0 = token_offset[t], j1 = token_offset[t + 1];
    for (int32_t j = j0; j < j1; ++j) {
      const int e = entry_expert[j];
      const unsigned hit = __ballot_sync(0xffffffffu, my_e == e);
      if (hit) {
        if (my_e == e) my_ds = dS[j];
      } else {
        G += dS[j] * (expf(row[e] - mx) * inv);
      }
    }
    // Top-K softmax part for lane k: s_k sum_{j != k} s_j (dS_k - dS_j).
    float topk_part = 0.f;
    for (int k = 0; k < K; ++k) {
      const float sk = __shfl_sync(0xffffffffu, my_s, k), dk = __shfl_sync(0xffffffffu, my_ds, k);
      if (k != lane) topk_part += sk * (my_ds - dk);
    }
    topk_part *= my_s;
    // Dense pass, uniform trip count so the shuffle below has every lane: lane's expert e gets
    // -S_e G, plus dS_p S_e if e is a padded entry, plus the top-K part if e is a top-K choice.
    for (int base = 0; base < E; base += 32) {
      const int e = base + lane;
      int k_e = -1;
      for (int k = 0; k < K; ++k)
        if (topk[t * K + k] == e) k_e = k;
      const float part = __shfl_sync(0xffffffffu, topk_part, k_e >= 0 ? k_e : 0);
      if (e >= E) continue;
      const float S = expf(row[e] - mx) * inv;
      float g = -S * G;
      if (k_e >= 0) {
        g += part;
      } else {
        for (int32_t j = j0; j < j1; ++j)  // the padded entry of e, if any
          if (entry_expert[j] == e) g += dS[j] * S;
      }
      dlogits[t * E + e] = __float2bfloat16_rn(g);
    }
  }
}

}  // namespace

Status router_backward(const float* dS, const float* scores, const int32_t* topk, int K, int E,
                       int64_t T, float* dl, bf16* dlogits_dense, cudaStream_t stream, const int32_t* valid) {
  if (T == 0) return Status{};
  SMOE_CUDA_RETURN(cudaMemsetAsync(dlogits_dense, 0, sizeof(bf16) * T * E, stream));
  router_backward_kernel<<<grid_for(T), kThreads, 0, stream>>>(dS, scores, topk, K, E, T, dl, dlogits_dense,
                                                               valid);
  SMOE_CHECK_LAUNCH("router_backward_kernel");
  return Status{};
}

Status router_backward_tr(const float* dS, const int32_t* entry_expert, const int32_t* token_offset,
                          const int32_t* topk, const float* topk_score, const float* logits, int K,
                          int E, int64_t T, bf16* dlogits_dense, cudaStream_t stream,
                          const int32_t* valid) {
  if (T == 0) return Status{};
  const int64_t warps_per_block = kThreads / 32;
  int64_t blocks = (T + warps_per_block - 1) / warps_per_block;
  if (blocks > 65536) blocks = 65536;
  router_backward_tr_kernel<<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(
      dS, entry_expert, token_offset, topk, topk_score, logits, K, E, T, dlogits_dense, valid);
  SMOE_CHECK_LAUNCH("router_backward_tr_kernel");
  return Status{};
}

}  // namespace routing
}  // namespace smoe
