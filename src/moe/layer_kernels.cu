// Memory-bound kernels of the GPU layer (aggregation, dS row sum, dX); the
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
//   router   dlogits: src/routing/router_backward.cu
//            dX[t] += sum_k dlogit_k W_r[e_k]  (only K non-zeros per token: a sparse sum)
#include <algorithm>
#include <cstdint>

#include <cuda_bf16.h>

#include "common/check.h"
#include "common/grid_stride.h"
#include "moe/layer_kernels.h"

namespace smoe {
namespace kernels {
namespace {

constexpr int kThreads = 256;

union Pack8 {
  uint4 u;
  __nv_bfloat162 h2[4];
};


unsigned grid_for(int64_t n) { return detail::grid_blocks(n, kThreads); }

// Entries of a token are read kEntryBatch at a time: their indices first, then all their 16-byte
// rows in flight together, then the sums in entry order (the same fp32 operations, in the same
// order, as one entry at a time). One entry at a time, each row load waited for its index load and
// the next index load for the sum: K dependent round trips per thread (the aggregation ran at
// ~4.1 TB/s, dx_sum at ~2.9 with its second row per entry; 30B n256, H200, 7c854bf).
constexpr int kEntryBatch = 4;

// O[t][c..c+8) = sum over entries j of t: s[j] * Y[rev[j]][c..c+8), fp32 in entry order.
__global__ void aggregate_kernel(const bf16* __restrict__ Y, const float* __restrict__ scores,
                                 const int32_t* __restrict__ rev, const int32_t* __restrict__ token_offset,
                                 int64_t vec_per_row, int64_t T, bf16* __restrict__ out) {
  const int64_t total = T * vec_per_row;
  const uint4* y4 = reinterpret_cast<const uint4*>(Y);
  for (int64_t i = detail::grid_first(); i < total; i += detail::grid_step()) {
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

// dS[scatter[r]] = sum over j of ds_partial[r][j], j ascending (the dSwiGLU epilogue's per-tile
// partial dot products): one thread per grouped row, fixed order, no atomics.
__global__ void ds_rowsum_kernel(const float* __restrict__ partial, int tiles,
                                 const int32_t* __restrict__ scatter, int64_t rows,
                                 const int32_t* __restrict__ nnz, float* __restrict__ dS,
                                 const int32_t* valid) {
  if (valid != nullptr && *valid == 0) return;
  const int64_t used = *nnz;
  for (int64_t r = detail::grid_first(); r < rows; r += detail::grid_step()) {
    const int32_t entry = scatter[r];
    if (r >= used) {  // no GEMM row: an empty slot of provided routing (or nothing, entry -1)
      if (entry >= 0) dS[entry] = 0.f;
      continue;
    }
    float acc = 0.f;
    for (int j = 0; j < tiles; ++j) acc += partial[r * tiles + j];
    dS[entry] = acc;
  }
}

// dx[t][c..c+8) = sum over entries j of t, in entry order, fp32: dXt[rev[j]][c..c+8) (+ dl[j] *
// W_r[entry_expert[j]][c..c+8) with the top-K router), + dx_router[t][c..c+8) (token rounding);
// entries kEntryBatch at a time as in the aggregation (per entry: dX~ row, then the router term).
// A block owns one 64-column slab of dx (8 lanes, one 16-byte chunk each) and walks the
// tokens 32 at a time, grid-stride along y. With dl, the slab of W_r ([E][64] bf16, E * 128 bytes)
// is staged in shared memory once per block: each entry's router row then comes from shared memory.
// Read from L2 per entry (one 16-byte load of W_r for every 16 bytes of dX~), dx_sum ran at 2.9
// TB/s against the aggregation's 4.0 over the same bytes (30B n256: 1.556 vs 1.152 ms, H200,
// 9dfd927); with the slab in shared memory (tenth session, same call, H200): 30B n256 1.44 -> 1.29
// ms, 120B 0.91 -> 0.73, Qwen3-235B 0.84 -> 0.69, 7B n512 0.149 -> 0.113, Qwen3-Next (E = 512, a
// 64 KB slab, fewer blocks) 0.55 -> 0.52. The arithmetic, and its order, is the same as one thread
// per (token, chunk) had.
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

__global__ void write_stamp_kernel(uint64_t* stamp, uint64_t magic, uint64_t hash, uint64_t bytes) {
  stamp[1] = hash;
  stamp[2] = bytes;
  stamp[3] = 0;
  __threadfence();
  stamp[0] = magic;  // last: a stamp with the magic is complete
}

__global__ void check_saved_kernel(const uint64_t* stamp, uint64_t magic, uint64_t hash, uint64_t bytes,
                                   const int32_t* expert_offset, int E, int32_t* valid,
                                   int32_t* expert_offset_copy, DeviceStatus* status) {
  __shared__ int ok;
  if (threadIdx.x == 0) {
    ok = stamp[0] == magic && stamp[1] == hash && stamp[2] == bytes;
    *valid = ok;
    if (!ok && status != nullptr) atomicOr(&status->flags, static_cast<uint32_t>(kStatusBadSavedState));
  }
  __syncthreads();
  for (int e = threadIdx.x; e <= E; e += blockDim.x) expert_offset_copy[e] = ok ? expert_offset[e] : 0;
}

struct FillSpans {
  uint32_t* p[kMaxFillSpans];
  int64_t words[kMaxFillSpans];
  int n;
};

__global__ void nan_fill_kernel(const int32_t* valid, FillSpans f) {
  if (*valid != 0) return;
  for (int s = 0; s < f.n; ++s)
    for (int64_t i = detail::grid_first(); i < f.words[s]; i += detail::grid_step())
      f.p[s][i] = 0xFFFFFFFFu;
}

__global__ void f32_to_bf16_kernel(const float* __restrict__ in, bf16* __restrict__ out, int64_t n) {
  for (int64_t i = detail::grid_first(); i < n; i += detail::grid_step())
    out[i] = __float2bfloat16_rn(in[i]);
}

}  // namespace

Status clear_saved_stamp(void* stamp, cudaStream_t stream) {
  SMOE_CUDA_RETURN(cudaMemsetAsync(stamp, 0, sizeof(uint64_t) * 4, stream));
  return Status{};
}

Status write_saved_stamp(void* stamp, uint64_t magic, uint64_t shape_hash, uint64_t bytes, cudaStream_t stream) {
  write_stamp_kernel<<<1, 1, 0, stream>>>(static_cast<uint64_t*>(stamp), magic, shape_hash, bytes);
  SMOE_CHECK_LAUNCH("write_stamp_kernel");
  return Status{};
}

Status check_saved(const void* stamp, uint64_t magic, uint64_t shape_hash, uint64_t bytes,
                   const int32_t* expert_offset, int E, int32_t* valid, int32_t* expert_offset_copy,
                   DeviceStatus* status, cudaStream_t stream) {
  check_saved_kernel<<<1, 256, 0, stream>>>(static_cast<const uint64_t*>(stamp), magic, shape_hash, bytes,
                                            expert_offset, E, valid, expert_offset_copy, status);
  SMOE_CHECK_LAUNCH("check_saved_kernel");
  return Status{};
}

Status nan_fill_if_invalid(const int32_t* valid, std::initializer_list<FillSpan> spans, cudaStream_t stream) {
  FillSpans f{};
  int64_t most = 0;
  for (const FillSpan& sp : spans) {
    if (sp.p == nullptr || sp.bytes < 4 || f.n == kMaxFillSpans) continue;
    f.p[f.n] = static_cast<uint32_t*>(sp.p);
    f.words[f.n] = static_cast<int64_t>(sp.bytes / 4);
    most = f.words[f.n] > most ? f.words[f.n] : most;
    ++f.n;
  }
  if (f.n == 0) return Status{};
  // Valid (the usual case): every block reads the flag and returns, so the grid stays small.
  const unsigned blocks = detail::grid_blocks(most, kThreads, detail::kGridCapGated);
  nan_fill_kernel<<<blocks, kThreads, 0, stream>>>(valid, f);
  SMOE_CHECK_LAUNCH("nan_fill_kernel");
  return Status{};
}

Status aggregate(const bf16* Y, const float* scores, const int32_t* rev, const int32_t* token_offset, int d,
                 int64_t T, bf16* out, cudaStream_t stream) {
  const int64_t vpr = d / 8;
  if (T == 0) return Status{};
  aggregate_kernel<<<grid_for(T * vpr), kThreads, 0, stream>>>(Y, scores, rev, token_offset, vpr, T, out);
  SMOE_CHECK_LAUNCH("aggregate_kernel");
  return Status{};
}

Status ds_rowsum(const float* partial, int tiles, const int32_t* scatter, int64_t rows, const int32_t* nnz,
                 float* dS, cudaStream_t stream, const int32_t* valid) {
  if (rows == 0) return Status{};
  ds_rowsum_kernel<<<grid_for(rows), kThreads, 0, stream>>>(partial, tiles, scatter, rows, nnz, dS, valid);
  SMOE_CHECK_LAUNCH("ds_rowsum_kernel");
  return Status{};
}

Status dx_sum(const bf16* dXt, const int32_t* rev, const int32_t* token_offset, const float* dl,
              const int32_t* entry_expert, const bf16* w_router, const float* dx_router, int d, int64_t T,
              int E, int sms, bf16* dx, cudaStream_t stream, const int32_t* valid) {
  if (T == 0) return Status{};
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
    SMOE_CUDA_RETURN(cudaFuncSetAttribute(dx_kernel<true>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                          static_cast<int>(smem)));
    dx_kernel<true><<<grid, kThreads, smem, stream>>>(dXt, rev, token_offset, dl, entry_expert, w_router,
                                                      dx_router, vpr, T, E, dx, valid);
  } else {
    dx_kernel<false><<<grid, kThreads, 0, stream>>>(dXt, rev, token_offset, dl, entry_expert, w_router,
                                                    dx_router, vpr, T, E, dx, valid);
  }
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
