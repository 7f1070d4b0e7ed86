// The routing order as one unsigned integer: the top-K warp reductions compare 32-bit keys with the
// hardware's warp max / min (redux.sync) instead of shuffling (value, index) pairs.
//
//   routing_key(x) > routing_key(y)  <=>  x > y     and     routing_key(x) == routing_key(y)  <=>  x == y
// for every float but NaN (the routing maps NaN to -inf first). The map: -0 becomes +0 (they compare
// equal), then the sign bit is flipped for positives and every bit for negatives, so larger floats
// have larger unsigned keys. -inf's key is 0x007FFFFF, so 0 (kTakenKey) ranks below every logit: a
// slot already chosen, or past E. routing_value(routing_key(x)) == x bit for bit (+0 for -0).
// Plain C++ (no CUDA headers) so the CPU tests check the map exhaustively on the special values.
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define SMOE_ROUTING_HD __host__ __device__ __forceinline__
#else
#define SMOE_ROUTING_HD inline
#endif

namespace smoe {
namespace routing {

constexpr uint32_t kTakenKey = 0;

SMOE_ROUTING_HD uint32_t routing_key(float x) {
  x += 0.0f;  // -0 + +0 = +0 under round-to-nearest: one key for the two zeros
  uint32_t u;
  std::memcpy(&u, &x, sizeof u);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

SMOE_ROUTING_HD float routing_value(uint32_t key) {
  const uint32_t u = (key & 0x80000000u) ? (key & 0x7fffffffu) : ~key;
  float x;
  std::memcpy(&x, &u, sizeof x);
  return x;
}

}  // namespace routing
}  // namespace smoe

#undef SMOE_ROUTING_HD
