// The gather-sum kernels as they were before the variants of src/moe/gather_sum.cuh (127ea23,
// src/moe/layer_kernels.cu), kept as gather_sum_bench's same-process baseline: one token per
// thread, entries 4 at a time; the aggregation one thread per (token, chunk) over a grid-stride
// range, the dx sum by 64-column slabs with W_r's slab in shared memory.
#pragma once

#include <algorithm>
#include <cstdint>

#include <cuda_bf16.h>

#include "moe/gather_sum.cuh"

namespace legacy {

using smoe::bf16;
using smoe::kernels::Pack8;
constexpr int kThreads = 256;

constexpr int kEntryBatch = 4;

// O[t][c..c+8) = sum over entries j of t: s[j] * Y[rev[j]][c..c+8), fp32 in entry order.
__global__ void aggregate_kernel(const bf16* __restrict__ Y, const float* __restrict__ scores,
                                 const int32_t* __restrict__ rev, const int32_t* __restrict__ token_offset,
                                 int64_t vec_per_row, int64_t T, bf16* __restrict__ out) {
  const int64_t total = T * vec_per_row;
  const uint4* y4 = reinterpret_cast<const uint4*>(Y);
  for (int64_t i = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x); i < total; i += (static_cast<int64_t>(gridDim.x) * blockDim.x)) {
    const int64_t t = i / vec_per_row, c = i - t * vec_per_row;
    float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    const int32_t end = token_offset[t + 1];
    for (int32_t j0 = token_offset[t]; j0 < end; j0 += kEntryBatch) {
      int32_t row[kEntryBatch];
      float s[kEntryBatch];
#pragma unroll
      for (int u = 0; u < kEntryBatch; ++u) {
        const bool in = j0 + u < end;
        row[u] = in ? rev[j0 + u] : -1;  // -1: past the token's entries, or an empty slot
        s[u] = in ? scores[j0 + u] : 0.f;
      }
      Pack8 y[kEntryBatch];
#pragma unroll
      for (int u = 0; u < kEntryBatch; ++u)
        if (row[u] >= 0) y[u].u = __ldg(y4 + static_cast<int64_t>(row[u]) * vec_per_row + c);
#pragma unroll
      for (int u = 0; u < kEntryBatch; ++u) {
        if (row[u] < 0) continue;
#pragma unroll
        for (int q = 0; q < 4; ++q) {
          const float2 v = __bfloat1622float2(y[u].h2[q]);
          acc[2 * q] += s[u] * v.x;
          acc[2 * q + 1] += s[u] * v.y;
        }
      }
    }
    Pack8 o;
#pragma unroll
    for (int q = 0; q < 4; ++q) o.h2[q] = __floats2bfloat162_rn(acc[2 * q], acc[2 * q + 1]);
    reinterpret_cast<uint4*>(out)[i] = o.u;
  }
}

constexpr int kSlabChunks = 8;                         // 16-byte chunks of a slab: 64 columns
constexpr int kSlabTokens = kThreads / kSlabChunks;    // tokens per block pass
template <bool kRouter>
__global__ void __launch_bounds__(kThreads) dx_kernel(
    const bf16* __restrict__ dXt, const int32_t* __restrict__ rev, const int32_t* __restrict__ token_offset,
    const float* __restrict__ dl, const int32_t* __restrict__ entry_expert, const bf16* __restrict__ w_router,
    const float* __restrict__ dx_router, int64_t vec_per_row, int64_t T, int E, bf16* __restrict__ dx,
    const int32_t* valid) {
  if (valid != nullptr && *valid == 0) return;  // the flag is one word: every thread of the block returns
  extern __shared__ uint4 w_slab[];             // [E][kSlabChunks] (kRouter)
  const int lane = static_cast<int>(threadIdx.x) % kSlabChunks;
  const int64_t c = static_cast<int64_t>(blockIdx.x) * kSlabChunks + lane;
  const uint4* d4 = reinterpret_cast<const uint4*>(dXt);
  if constexpr (kRouter) {
    const uint4* w4 = reinterpret_cast<const uint4*>(w_router) + static_cast<int64_t>(blockIdx.x) * kSlabChunks;
    for (int i = static_cast<int>(threadIdx.x); i < E * kSlabChunks; i += kThreads)
      w_slab[i] = __ldg(w4 + static_cast<int64_t>(i / kSlabChunks) * vec_per_row + i % kSlabChunks);
    __syncthreads();
  }
  const int64_t t_step = static_cast<int64_t>(gridDim.y) * kSlabTokens;
  for (int64_t t = static_cast<int64_t>(blockIdx.y) * kSlabTokens + threadIdx.x / kSlabChunks; t < T; t += t_step) {
    float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    const int32_t end = token_offset[t + 1];
    for (int32_t j0 = token_offset[t]; j0 < end; j0 += kEntryBatch) {
      int32_t row[kEntryBatch], e[kEntryBatch];
      float g[kEntryBatch];
#pragma unroll
      for (int u = 0; u < kEntryBatch; ++u) {
        const bool in = j0 + u < end;
        row[u] = in ? rev[j0 + u] : -1;  // -1: past the token's entries, or an empty slot
        e[u] = in && kRouter ? entry_expert[j0 + u] : 0;
        g[u] = in && kRouter ? dl[j0 + u] : 0.f;
      }
      Pack8 v[kEntryBatch];
#pragma unroll
      for (int u = 0; u < kEntryBatch; ++u)
        if (row[u] >= 0) v[u].u = __ldg(d4 + static_cast<int64_t>(row[u]) * vec_per_row + c);
#pragma unroll
      for (int u = 0; u < kEntryBatch; ++u) {
        if (row[u] < 0) continue;
#pragma unroll
        for (int q = 0; q < 4; ++q) {
          const float2 a = __bfloat1622float2(v[u].h2[q]);
          acc[2 * q] += a.x;
          acc[2 * q + 1] += a.y;
        }
        if constexpr (kRouter) {
          Pack8 w;
          w.u = w_slab[e[u] * kSlabChunks + lane];
#pragma unroll
          for (int q = 0; q < 4; ++q) {
            const float2 b = __bfloat1622float2(w.h2[q]);
            acc[2 * q] += g[u] * b.x;
            acc[2 * q + 1] += g[u] * b.y;
          }
        }
      }
    }
    if (dx_router) {
      const float4* r = reinterpret_cast<const float4*>(dx_router + t * vec_per_row * 8 + c * 8);
      const float4 r0 = r[0], r1 = r[1];
      acc[0] += r0.x; acc[1] += r0.y; acc[2] += r0.z; acc[3] += r0.w;
      acc[4] += r1.x; acc[5] += r1.y; acc[6] += r1.z; acc[7] += r1.w;
    }
    Pack8 o;
#pragma unroll
    for (int q = 0; q < 4; ++q) o.h2[q] = __floats2bfloat162_rn(acc[2 * q], acc[2 * q + 1]);
    reinterpret_cast<uint4*>(dx)[t * vec_per_row + c] = o.u;
  }
}

inline cudaError_t dx_sum(const bf16* dXt, const int32_t* rev, const int32_t* token_offset, const float* dl,
              const int32_t* entry_expert, const bf16* w_router, const float* dx_router, int d, int64_t T,
              int E, int sms, bf16* dx, cudaStream_t stream, const int32_t* valid) {
  if (T == 0) return cudaSuccess;
  const int64_t vpr = d / 8;
  const int slabs = d / (8 * kSlabChunks);  // d % 64 == 0 (the layer's shape rule)
  const bool router = dl != nullptr;
  const size_t smem = router ? static_cast<size_t>(E) * kSlabChunks * sizeof(uint4) : 0;
  // Blocks: about two waves of the resident count (shared memory bounds it at E * 128 bytes per
  // block), so that each block's W_r slab serves many tokens: the staging reads E * 128 bytes per
  // block from L2, ~5% of the dX~ bytes at E = 512 with this count.
  const int per_sm = router ? std::max(1, std::min(8, static_cast<int>((227 * 1024) / (smem + 1024)))) : 8;
  const int64_t want = std::max<int64_t>(1, int64_t{2} * sms * per_sm / slabs);
  const int64_t token_blocks = std::min<int64_t>({want, (T + kSlabTokens - 1) / kSlabTokens, 65535});
  const dim3 grid(static_cast<unsigned>(slabs), static_cast<unsigned>(token_blocks));
  if (router) {
    if (cudaError_t e = cudaFuncSetAttribute(dx_kernel<true>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                             static_cast<int>(smem));
        e != cudaSuccess)
      return e;
    dx_kernel<true><<<grid, kThreads, smem, stream>>>(dXt, rev, token_offset, dl, entry_expert, w_router,
                                                      dx_router, vpr, T, E, dx, valid);
  } else {
    dx_kernel<false><<<grid, kThreads, 0, stream>>>(dXt, rev, token_offset, dl, entry_expert, w_router,
                                                    dx_router, vpr, T, E, dx, valid);
  }
  return cudaGetLastError();
}

inline cudaError_t aggregate(const bf16* Y, const float* scores, const int32_t* rev, const int32_t* token_offset, int d,
                             int64_t T, bf16* out, cudaStream_t stream) {
  const int64_t vpr = d / 8;
  if (T == 0) return cudaSuccess;
  int64_t g = (T * vpr + kThreads - 1) / kThreads;
  aggregate_kernel<<<static_cast<unsigned>(std::min<int64_t>(g, 65536)), kThreads, 0, stream>>>(Y, scores, rev,
                                                                                               token_offset, vpr, T, out);
  return cudaGetLastError();
}

}  // namespace legacy
