// Memory-bound kernels of the GPU layer (aggregation, dS row sum, router backward, dX); the
// gathers, SwiGLU and dH/A'/dS live in the engine's GEMM loads and epilogues (src/engine). All deterministic: every output element is written by one thread, sums run in a
// fixed order, no atomics. 16-byte vector accesses (8 bf16); element offsets are 64-bit.
//
// Derivations (row r of expert e, token t = gather[r], score s = scores[scatter[r]]):
//   forward  a = silu(g) * u with (g, u) = (H[r][2j], H[r][2j+1]); O[t] = sum_k s_k Y[row(t,k)]
//   backward dA'[r] = dO[t] W2_e (the GEMM before dh_kernel)
//            dA[r]  = s * dA'[r]                       (O depends on a only through s * Y)
//            dg = dA * u * sig(g) * (1 + g (1 - sig(g))) = dA * u * (sig + silu (1 - sig))
//            du = dA * silu(g)
//            A'[r] = s * a                             (so that dW2_e = dO_e^T A'_e)
//            dS[t,k] = <dO[t], Y[r]> = <dO[t], a W2_e^T> = <dO[t] W2_e, a> = <dA'[r], a>
//   router   dlogit_k = s_k (dS_k - sum_j s_j dS_j) = s_k sum_{j!=k} s_j (dS_k - dS_j) for the K
//            chosen experts (the second form is the one computed), 0 elsewhere
//            dX[t] += sum_k dlogit_k W_r[e_k]  (only K non-zeros per token: a sparse sum)
#include <cstdint>

#include <cuda_bf16.h>

#include "common/check.h"
#include "moe/layer_kernels.h"

namespace smoe {
namespace kernels {
namespace {

constexpr int kThreads = 256;

union Pack8 {
  uint4 u;
  __nv_bfloat162 h2[4];
};


unsigned grid_for(int64_t n) {
  int64_t g = (n + kThreads - 1) / kThreads;
  if (g > 65536) g = 65536;  // grid-stride loops cover the rest
  return static_cast<unsigned>(g < 1 ? 1 : g);
}

// dst[r] = src[idx[r]], 16 bytes per thread (for the CUTLASS weight-gradient path only).
__global__ void gather_rows_kernel(const bf16* __restrict__ src, int64_t vec_per_row,
                                   const int32_t* __restrict__ idx, int64_t rows,
                                   bf16* __restrict__ dst) {
  const uint4* s = reinterpret_cast<const uint4*>(src);
  uint4* o = reinterpret_cast<uint4*>(dst);
  const int64_t total = rows * vec_per_row;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = i / vec_per_row, c = i - r * vec_per_row;
    o[i] = __ldg(s + static_cast<int64_t>(idx[r]) * vec_per_row + c);
  }
}

// O[t][c..c+8) = sum_k s[t,k] * Y[rev[t*K+k]][c..c+8), fp32 in k order.
__global__ void aggregate_kernel(const bf16* __restrict__ Y, const float* __restrict__ scores,
                                 const int32_t* __restrict__ rev, int K, int64_t vec_per_row,
                                 int64_t T, bf16* __restrict__ out) {
  const int64_t total = T * vec_per_row;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t t = i / vec_per_row, c = i - t * vec_per_row;
    float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    for (int k = 0; k < K; ++k) {
      const float s = scores[t * K + k];
      Pack8 y;
      y.u = __ldg(reinterpret_cast<const uint4*>(Y) + static_cast<int64_t>(rev[t * K + k]) * vec_per_row + c);
#pragma unroll
      for (int q = 0; q < 4; ++q) {
        const float2 v = __bfloat1622float2(y.h2[q]);
        acc[2 * q] += s * v.x;
        acc[2 * q + 1] += s * v.y;
      }
    }
    Pack8 o;
#pragma unroll
    for (int q = 0; q < 4; ++q) o.h2[q] = __floats2bfloat162_rn(acc[2 * q], acc[2 * q + 1]);
    reinterpret_cast<uint4*>(out)[i] = o.u;
  }
}

// dS[scatter[r]] = sum over j of ds_partial[r][j], j ascending (the dSwiGLU epilogue's per-tile
// partial dot products): one thread per grouped row, fixed order, no atomics.
__global__ void ds_rowsum_kernel(const float* __restrict__ partial, int tiles,
                                 const int32_t* __restrict__ scatter, int64_t rows, float* __restrict__ dS) {
  for (int64_t r = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; r < rows;
       r += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    float acc = 0.f;
    for (int j = 0; j < tiles; ++j) acc += partial[r * tiles + j];
    dS[scatter[r]] = acc;
  }
}

// One thread per token: dl[t,k] and the K non-zeros of the dense bf16 dlogits row (pre-zeroed).
__global__ void router_backward_kernel(const float* __restrict__ dS, const float* __restrict__ scores,
                                       const int32_t* __restrict__ topk, int K, int E, int64_t T,
                                       float* __restrict__ dl, bf16* __restrict__ dlogits_dense) {
  for (int64_t t = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; t < T;
       t += static_cast<int64_t>(gridDim.x) * blockDim.x) {
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

// dX[t] = sum_k dX~[rev[t*K+k]] + sum_k dl[t,k] W_r[e_k], fp32 in k order.
__global__ void dx_kernel(const bf16* __restrict__ dXt, const int32_t* __restrict__ rev,
                          const float* __restrict__ dl, const int32_t* __restrict__ topk,
                          const bf16* __restrict__ w_router, int K, int64_t vec_per_row, int64_t T,
                          bf16* __restrict__ dx) {
  const int64_t total = T * vec_per_row;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t t = i / vec_per_row, c = i - t * vec_per_row;
    float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    for (int k = 0; k < K; ++k) {
      Pack8 v, w;
      v.u = __ldg(reinterpret_cast<const uint4*>(dXt) + static_cast<int64_t>(rev[t * K + k]) * vec_per_row + c);
      w.u = __ldg(reinterpret_cast<const uint4*>(w_router) + static_cast<int64_t>(topk[t * K + k]) * vec_per_row + c);
      const float g = dl[t * K + k];
#pragma unroll
      for (int q = 0; q < 4; ++q) {
        const float2 a = __bfloat1622float2(v.h2[q]);
        const float2 b = __bfloat1622float2(w.h2[q]);
        acc[2 * q] += a.x + g * b.x;
        acc[2 * q + 1] += a.y + g * b.y;
      }
    }
    Pack8 o;
#pragma unroll
    for (int q = 0; q < 4; ++q) o.h2[q] = __floats2bfloat162_rn(acc[2 * q], acc[2 * q + 1]);
    reinterpret_cast<uint4*>(dx)[i] = o.u;
  }
}

__global__ void f32_to_bf16_kernel(const float* __restrict__ in, bf16* __restrict__ out, int64_t n) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    out[i] = __float2bfloat16_rn(in[i]);
}

}  // namespace

Status gather_rows(const bf16* src, int d, const int32_t* idx, int64_t rows, bf16* dst,
                   cudaStream_t stream) {
  if (rows == 0) return Status{};
  const int64_t vpr = d / 8;
  gather_rows_kernel<<<grid_for(rows * vpr), kThreads, 0, stream>>>(src, vpr, idx, rows, dst);
  SMOE_CHECK_LAUNCH("gather_rows_kernel");
  return Status{};
}

Status aggregate(const bf16* Y, const float* scores, const int32_t* rev, int K, int d, int64_t T,
                 bf16* out, cudaStream_t stream) {
  const int64_t vpr = d / 8;
  if (T == 0) return Status{};
  aggregate_kernel<<<grid_for(T * vpr), kThreads, 0, stream>>>(Y, scores, rev, K, vpr, T, out);
  SMOE_CHECK_LAUNCH("aggregate_kernel");
  return Status{};
}

Status ds_rowsum(const float* partial, int tiles, const int32_t* scatter, int64_t rows, float* dS,
                 cudaStream_t stream) {
  if (rows == 0) return Status{};
  ds_rowsum_kernel<<<grid_for(rows), kThreads, 0, stream>>>(partial, tiles, scatter, rows, dS);
  SMOE_CHECK_LAUNCH("ds_rowsum_kernel");
  return Status{};
}

Status router_backward(const float* dS, const float* scores, const int32_t* topk, int K, int E,
                       int64_t T, float* dl, bf16* dlogits_dense, cudaStream_t stream) {
  if (T == 0) return Status{};
  SMOE_CUDA_RETURN(cudaMemsetAsync(dlogits_dense, 0, sizeof(bf16) * T * E, stream));
  router_backward_kernel<<<grid_for(T), kThreads, 0, stream>>>(dS, scores, topk, K, E, T, dl, dlogits_dense);
  SMOE_CHECK_LAUNCH("router_backward_kernel");
  return Status{};
}

Status dx_sum(const bf16* dXt, const int32_t* rev, const float* dl, const int32_t* topk,
              const bf16* w_router, int K, int d, int64_t T, bf16* dx, cudaStream_t stream) {
  if (T == 0) return Status{};
  const int64_t vpr = d / 8;
  dx_kernel<<<grid_for(T * vpr), kThreads, 0, stream>>>(dXt, rev, dl, topk, w_router, K, vpr, T, dx);
  SMOE_CHECK_LAUNCH("dx_kernel");
  return Status{};
}

Status f32_to_bf16(const float* in, bf16* out, int64_t n, cudaStream_t stream) {
  if (n == 0) return Status{};
  f32_to_bf16_kernel<<<grid_for(n), kThreads, 0, stream>>>(in, out, n);
  SMOE_CHECK_LAUNCH("f32_to_bf16_kernel");
  return Status{};
}

}  // namespace kernels
}  // namespace smoe
