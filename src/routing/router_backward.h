// The router backward on the GPU: dlogits from the entries' dS (src/moe/backward.cu calls it
// between dW2 and dW1). Its forward is routing.cu / token_rounding.cu; its float64 twin is
// src/reference/router_backward_ref.cpp (ref::router_backward_ref and
// ref::token_rounding_router_backward_ref).
#pragma once

#include <cstdint>

#include <cuda_runtime_api.h>

#include "smoe/smoe.h"

namespace smoe {
namespace routing {

// Both take `valid` (the backward's saved-state flag; null = always valid) and do nothing when it is 0.
// Top-K softmax router: dl[t,k] = s_k (dS_k - sum_j s_j dS_j); dlogits_dense [T][E] bf16 (zeros + the K values).
Status router_backward(const float* dS, const float* scores, const int32_t* topk, int K, int E,
                       int64_t T, float* dl, bf16* dlogits_dense, cudaStream_t stream,
                       const int32_t* valid = nullptr);
// Token-rounding router (see ref::token_rounding_router_backward_ref): every element of
// dlogits_dense [T][E] bf16 from the entries' dS, the top-K choice and the recomputed fp32 logits.
Status router_backward_tr(const float* dS, const int32_t* entry_expert, const int32_t* token_offset,
                          const int32_t* topk, const float* topk_score, const float* logits, int K,
                          int E, int64_t T, bf16* dlogits_dense, cudaStream_t stream,
                          const int32_t* valid = nullptr);

}  // namespace routing
}  // namespace smoe
