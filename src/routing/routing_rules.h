// The shape rules every routing entry point shares (top-K, provided, token rounding), with the
// entry point's name in the message.
#pragma once

#include <climits>
#include <cstdint>

#include "common/check.h"
#include "smoe/smoe.h"

namespace smoe {
namespace routing {

inline Status check_routing_shape(const char* fn, int64_t T, int E, int K, DType logits_dtype) {
  using detail::concat;
  using detail::make_status;
  if (E < 1 || E > kMaxExperts)
    return make_status(StatusCode::kInvalidArgument,
                       concat(fn, ": num_experts (E) = ", E, " must be in [1, ", kMaxExperts, "]"));
  if (K < 1 || K > kMaxTopK)
    return make_status(StatusCode::kInvalidArgument,
                       concat(fn, ": top_k (K) = ", K, " must be in [1, ", kMaxTopK, "]"));
  if (K > E)
    return make_status(StatusCode::kInvalidArgument,
                       concat(fn, ": top_k (K) = ", K, " must not exceed num_experts (E) = ", E));
  if (T < 0)
    return make_status(StatusCode::kInvalidArgument, concat(fn, ": num_tokens (T) = ", T, " must be >= 0"));
  int64_t tk = 0;
  if (!detail::checked_product({T, K}, INT32_MAX, &tk))
    return make_status(StatusCode::kInvalidArgument,
                       concat(fn, ": num_tokens * top_k (T*K) with T = ", T, ", K = ", K,
                              " must be <= 2^31-1 (routed rows are int32 indices)"));
  if (logits_dtype != DType::kFloat32 && logits_dtype != DType::kBFloat16)
    return make_status(StatusCode::kInvalidArgument, concat(fn, ": logits_dtype must be kFloat32 or kBFloat16"));
  return Status{};
}

}  // namespace routing
}  // namespace smoe
