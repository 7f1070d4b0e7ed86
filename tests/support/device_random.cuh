// Random normal bf16 filled on the device (tests and benchmark): host generation of the 10^10
// weights of the largest configs would take minutes. Counter-based (splitmix64 of seed and index),
// Box-Muller, so any (seed, index) gives the same value on every run.
#pragma once

#include <cstdint>

#include <cuda_bf16.h>

namespace smoe_test {

__device__ __forceinline__ uint64_t splitmix64(uint64_t z) {
  z += 0x9E3779B97F4A7C15ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

__global__ inline void fill_normal_kernel(__nv_bfloat16* p, int64_t n, uint64_t seed, float scale) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const uint64_t r = splitmix64(seed ^ splitmix64(static_cast<uint64_t>(i)));
    const float u1 = ((r >> 40) + 1.0f) * (1.0f / 16777217.0f);
    const float u2 = ((r & 0xFFFFFF) + 0.5f) * (1.0f / 16777216.0f);
    p[i] = __float2bfloat16(scale * sqrtf(-2.f * logf(u1)) * cospif(2.f * u2));
  }
}

}  // namespace smoe_test
