// The gather-sums of the layer, device side: the aggregation (forward) and the dx sum (backward),
// one kernel for both. Host launchers: layer_kernels.cu; bench/drivers/gather_sum_bench.cu times
// every built variant against a copy of the same bytes.
//
// out[t][c] = sum over entries j of token t (j in [token_offset[t], token_offset[t+1]), in entry
// order, fp32) of w_j * src[rev[j]][c] for every 16-byte chunk c (8 bf16) of the row, where
//   aggregation  w_j = scores[j]                   (src = Y, the down-projection's rows)
//   dx sum       w_j = 1, plus dl[j] * W_r[entry_expert[j]][c] with the top-K router, plus
//                dx_router[t][c] (fp32) with token rounding               (src = dX~)
// An entry with rev[j] < 0 (an empty slot of provided routing) adds nothing.
//
// Why the variants: each load of a source row waits for its index (rev[j]), which waits for the
// token's range (token_offset): three dependent round trips to bring 16 bytes per entry and chunk.
// What hides them is the number of independent row loads in flight per SM, so a thread takes U
// tokens x B entries x C chunks of each at once (GatherShape), the ranges and indices loaded once
// for all C chunks. With U = C = 1 and B = 4 (the kernel before the variants), K <= 2 had one or two
// loads in flight per thread and ran at 57-80% of a copy (H100, in the layer); more tokens per
// thread (U) cost 8 fp32 accumulators and an index chain each, more chunks (C) only the accumulators.
// Every variant does the same fp32 operations in the same order per element (entry order; per entry
// the source row, then the router term; dx_router last), so all give the same bits.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include "moe/gather_shape.h"
#include "smoe/smoe.h"

namespace smoe {
namespace kernels {

union Pack8 {
  uint4 u;
  __nv_bfloat162 h2[4];
};

enum class SumKind { kScaled, kPlain, kRouter };

template <SumKind kKind, int U, int B, int C>
__global__ void __launch_bounds__(kGatherThreads)
    gather_sum_kernel(const bf16* __restrict__ src, const int32_t* __restrict__ rev,
                      const int32_t* __restrict__ token_offset, const float* __restrict__ coef,
                      const int32_t* __restrict__ entry_expert, const bf16* __restrict__ w_router,
                      const float* __restrict__ dx_router, int64_t vec_per_row, int64_t T, int E,
                      bf16* __restrict__ out, const int32_t* valid) {
  if (valid != nullptr && *valid == 0) return;  // the flag is one word: every thread of the block returns
  constexpr int kSlab = kSlabLanes * C;
  extern __shared__ uint4 w_slab[];  // [E][kSlab] (kRouter): this slab's columns of W_r
  const uint4* src4 = reinterpret_cast<const uint4*>(src);
  const int lane = static_cast<int>(threadIdx.x) % kSlabLanes;
  const int64_t slab0 = static_cast<int64_t>(blockIdx.x) * kSlab;
  int64_t col[C];
  bool col_ok[C];
#pragma unroll
  for (int q = 0; q < C; ++q) {
    col[q] = slab0 + lane + q * kSlabLanes;
    col_ok[q] = col[q] < vec_per_row;
  }
  if constexpr (kKind == SumKind::kRouter) {
    const uint4* w4 = reinterpret_cast<const uint4*>(w_router);
    for (int i = static_cast<int>(threadIdx.x); i < E * kSlab; i += kGatherThreads) {
      const int64_t cc = slab0 + i % kSlab;
      if (cc < vec_per_row) w_slab[i] = __ldg(w4 + static_cast<int64_t>(i / kSlab) * vec_per_row + cc);
    }
    __syncthreads();
  }
  const int64_t t_step = static_cast<int64_t>(gridDim.y) * kSlabTokens;
  for (int64_t t0 = static_cast<int64_t>(blockIdx.y) * kSlabTokens + threadIdx.x / kSlabLanes; t0 < T;
       t0 += t_step * U) {
    int64_t t[U];
    int32_t beg[U], cnt[U], most = 0;
#pragma unroll
    for (int u = 0; u < U; ++u) {
      t[u] = t0 + u * t_step < T ? t0 + u * t_step : -1;
      beg[u] = t[u] >= 0 ? token_offset[t[u]] : 0;
      cnt[u] = t[u] >= 0 ? token_offset[t[u] + 1] - beg[u] : 0;
      most = max(most, cnt[u]);
    }
    float acc[U][C][8] = {};
    for (int32_t j0 = 0; j0 < most; j0 += B) {
      int32_t row[U][B], e[U][B];
      float g[U][B];
#pragma unroll
      for (int u = 0; u < U; ++u)
#pragma unroll
        for (int b = 0; b < B; ++b) {
          const bool in = j0 + b < cnt[u];
          const int32_t j = beg[u] + j0 + b;
          row[u][b] = in ? rev[j] : -1;  // -1: past the token's entries, or an empty slot
          g[u][b] = in && kKind != SumKind::kPlain ? coef[j] : 0.f;
          e[u][b] = in && kKind == SumKind::kRouter ? entry_expert[j] : 0;
        }
      Pack8 v[U][B][C];
#pragma unroll
      for (int u = 0; u < U; ++u)
#pragma unroll
        for (int b = 0; b < B; ++b)
#pragma unroll
          for (int q = 0; q < C; ++q)
            if (row[u][b] >= 0 && col_ok[q])
              v[u][b][q].u = __ldg(src4 + static_cast<int64_t>(row[u][b]) * vec_per_row + col[q]);
#pragma unroll
      for (int u = 0; u < U; ++u)
#pragma unroll
        for (int b = 0; b < B; ++b) {
          if (row[u][b] < 0) continue;
#pragma unroll
          for (int q = 0; q < C; ++q) {
            if (!col_ok[q]) continue;
#pragma unroll
            for (int h = 0; h < 4; ++h) {
              const float2 a = __bfloat1622float2(v[u][b][q].h2[h]);
              if constexpr (kKind == SumKind::kScaled) {
                acc[u][q][2 * h] += g[u][b] * a.x;
                acc[u][q][2 * h + 1] += g[u][b] * a.y;
              } else {
                acc[u][q][2 * h] += a.x;
                acc[u][q][2 * h + 1] += a.y;
              }
            }
            if constexpr (kKind == SumKind::kRouter) {
              Pack8 w;
              w.u = w_slab[e[u][b] * kSlab + lane + q * kSlabLanes];
#pragma unroll
              for (int h = 0; h < 4; ++h) {
                const float2 r = __bfloat1622float2(w.h2[h]);
                acc[u][q][2 * h] += g[u][b] * r.x;
                acc[u][q][2 * h + 1] += g[u][b] * r.y;
              }
            }
          }
        }
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      if (t[u] < 0) continue;
#pragma unroll
      for (int q = 0; q < C; ++q) {
        if (!col_ok[q]) continue;
        float* a = acc[u][q];
        if (dx_router != nullptr) {
          const float4* r = reinterpret_cast<const float4*>(dx_router + (t[u] * vec_per_row + col[q]) * 8);
          const float4 r0 = r[0], r1 = r[1];
          a[0] += r0.x; a[1] += r0.y; a[2] += r0.z; a[3] += r0.w;
          a[4] += r1.x; a[5] += r1.y; a[6] += r1.z; a[7] += r1.w;
        }
        Pack8 o;
#pragma unroll
        for (int h = 0; h < 4; ++h) o.h2[h] = __floats2bfloat162_rn(a[2 * h], a[2 * h + 1]);
        reinterpret_cast<uint4*>(out)[t[u] * vec_per_row + col[q]] = o.u;
      }
    }
  }
}

// ---- launch (host) ----------------------------------------------------------------------------
// Everything a launch needs besides the kernel.
struct GatherArgs {
  const bf16* src;
  const int32_t* rev;
  const int32_t* token_offset;
  const float* coef;  // scores (aggregation), dl (dx with the router), null (plain dx)
  const int32_t* entry_expert;
  const bf16* w_router;
  const float* dx_router;
  int d;
  int64_t T;
  int E;
  bf16* out;
  const int32_t* valid;
};

// Lets the router variants take up to kGatherMaxSlabBytes of dynamic shared memory, once per kernel
// and device (not per launch: two host threads with different E would race on the attribute). The
// flag is per instantiation: every variant has the same function type, so a flag keyed on that type
// would be shared, and the first variant to set its attribute would make the others skip theirs
// (caught on the H100: 2x2x1 refused at E = 512 after 1x4x1 had run).
template <SumKind kKind, int U, int B, int C>
cudaError_t allow_router_slab() {
  static std::atomic<uint64_t> done{0};  // bit i: device i (< 64) has the attribute set
  int dev = 0;
  cudaError_t e = cudaGetDevice(&dev);
  if (e != cudaSuccess) return e;
  const uint64_t bit = dev < 64 ? uint64_t{1} << dev : 0;
  if (bit != 0 && (done.load(std::memory_order_acquire) & bit)) return cudaSuccess;
  e = cudaFuncSetAttribute(gather_sum_kernel<kKind, U, B, C>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                           static_cast<int>(kGatherMaxSlabBytes));
  if (e == cudaSuccess) done.fetch_or(bit, std::memory_order_acq_rel);
  return e;
}

template <SumKind kKind, int U, int B, int C>
cudaError_t launch_gather_sum_as(const GatherArgs& a, int sms, cudaStream_t stream) {
  if (a.d <= 0 || a.d % 8 != 0 || a.T < 0 || sms < 1 || (kKind == SumKind::kRouter && a.E < 1))
    return cudaErrorInvalidValue;  // whole 16-byte chunks only (the layer's rule is d % 64 == 0)
  if (a.T == 0) return cudaSuccess;  // no token: nothing to write (a grid of 0 blocks would be refused)
  auto* kernel = gather_sum_kernel<kKind, U, B, C>;
  const int64_t vpr = a.d / 8;
  constexpr int kSlab = kSlabLanes * C;
  const int slabs = static_cast<int>((vpr + kSlab - 1) / kSlab);
  const size_t smem = kKind == SumKind::kRouter ? router_slab_bytes(a.E, C) : 0;
  if (smem > kGatherMaxSlabBytes) return cudaErrorInvalidConfiguration;
  // A failed query leaves its error as the runtime's last one: cleared, so that a later launch check
  // elsewhere does not report it under another kernel's name (it is returned here).
  if (smem > 48 * 1024) {
    const cudaError_t e = allow_router_slab<kKind, U, B, C>();
    if (e != cudaSuccess) {
      (void)cudaGetLastError();
      return e;
    }
  }
  // About two waves of the resident blocks (registers and, with the router, the W_r slab bound them),
  // each block walking many tokens: with the router the slab's staging (E * 128 * C bytes per block,
  // from L2) is then ~5% of the source bytes at E = 512.
  int per_sm = 0;
  const cudaError_t oe = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, kGatherThreads, smem);
  if (oe != cudaSuccess) {
    (void)cudaGetLastError();
    return oe;
  }
  if (per_sm < 1) return cudaErrorInvalidConfiguration;  // the slab does not fit shared memory
  const int64_t want = std::max<int64_t>(1, int64_t{2} * sms * per_sm / slabs);
  const int64_t per_block = int64_t{kSlabTokens} * U;
  const int64_t token_blocks = std::min<int64_t>({want, (a.T + per_block - 1) / per_block, 65535});
  const dim3 grid(static_cast<unsigned>(slabs), static_cast<unsigned>(token_blocks));
  kernel<<<grid, kGatherThreads, smem, stream>>>(a.src, a.rev, a.token_offset, a.coef, a.entry_expert, a.w_router,
                                                 a.dx_router, vpr, a.T, a.E, a.out, a.valid);
  return cudaGetLastError();
}

// Launches variant g of the stage: the launch's error, cudaErrorInvalidValue if g is not built,
// cudaErrorInvalidConfiguration if the router slab cannot fit shared memory.
inline cudaError_t launch_gather_sum(GatherStage stage, GatherShape g, const GatherArgs& a, int sms,
                                     cudaStream_t stream) {
#define SMOE_GATHER_CASE(u, b, c)                                                               \
  if (g.tokens == u && g.entries == b && g.chunks == c) {                                      \
    switch (stage) {                                                                           \
      case GatherStage::kAggregate: return launch_gather_sum_as<SumKind::kScaled, u, b, c>(a, sms, stream); \
      case GatherStage::kDx: return launch_gather_sum_as<SumKind::kPlain, u, b, c>(a, sms, stream);       \
      case GatherStage::kDxRouter: return launch_gather_sum_as<SumKind::kRouter, u, b, c>(a, sms, stream); \
    }                                                                                          \
  }
  SMOE_GATHER_SHAPES(SMOE_GATHER_CASE)
#undef SMOE_GATHER_CASE
  return cudaErrorInvalidValue;
}

}  // namespace kernels
}  // namespace smoe
