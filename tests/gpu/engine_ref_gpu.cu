// Naive fp32 reference twins of the engine's GEMMs (see engine_ref_gpu.h).
#include "gpu/engine_ref_gpu.h"

#include <cuda_bf16.h>

namespace smoe_test {
namespace {

__device__ int expert_of_row(const int32_t* off, int E, int64_t r) {
  int lo = 0, hi = E - 1;  // largest e with off[e] <= r
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (off[mid] <= r) lo = mid; else hi = mid - 1;
  }
  return lo;
}

__global__ void varlen_m_ref_kernel(smoe::engine::VarlenMArgs a, float* D) {
  const int64_t total = a.rows * a.N;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = i / a.N;
    const int c = static_cast<int>(i % a.N);
    const int e = expert_of_row(a.expert_offset, a.num_experts, r);
    const int64_t src = a.gather_idx ? a.gather_idx[r] : r;
    const __nv_bfloat16* arow = a.A + src * a.K;
    float acc = 0.f;
    for (int k = 0; k < a.K; ++k) {
      const __nv_bfloat16 b = a.b_major == smoe::engine::WeightMajor::kNK
                                  ? a.B[(static_cast<int64_t>(e) * a.N + c) * a.K + k]
                                  : a.B[(static_cast<int64_t>(e) * a.K + k) * a.N + c];
      acc += __bfloat162float(arow[k]) * __bfloat162float(b);
    }
    D[i] = acc;
  }
}

__global__ void varlen_k_ref_kernel(smoe::engine::VarlenKArgs a, float* D) {
  const int64_t total = static_cast<int64_t>(a.num_experts) * a.M * a.N;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int e = static_cast<int>(i / (static_cast<int64_t>(a.M) * a.N));
    const int m = static_cast<int>((i / a.N) % a.M);
    const int c = static_cast<int>(i % a.N);
    float acc = 0.f;
    for (int64_t r = a.expert_offset[e]; r < a.expert_offset[e + 1]; ++r) {
      const int64_t sp = a.gather_p ? a.gather_p[r] : r;
      const int64_t sq = a.gather_q ? a.gather_q[r] : r;
      acc += __bfloat162float(a.P[sp * a.ld_p + m]) * __bfloat162float(a.Q[sq * a.ld_q + c]);
    }
    D[i] = acc;
  }
}

}  // namespace

void varlen_m_ref(const smoe::engine::VarlenMArgs& a, float* D, cudaStream_t stream) {
  if (a.rows == 0) return;
  varlen_m_ref_kernel<<<4096, 256, 0, stream>>>(a, D);
}

void varlen_k_ref(const smoe::engine::VarlenKArgs& a, float* D, cudaStream_t stream) {
  varlen_k_ref_kernel<<<4096, 256, 0, stream>>>(a, D);
}

}  // namespace smoe_test
