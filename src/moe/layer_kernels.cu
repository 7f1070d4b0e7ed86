// Memory-bound kernels of the GPU layer: the dS row sum and the saved-state checks here, and the
// launches of the gather-sums (aggregation, dX gather-sum: src/moe/gather_sum.cuh); the gathers,
// SwiGLU and dH/A'/dS live in the engine's GEMM loads and epilogues (src/engine). All deterministic:
// every output element is written by one thread, sums run in a fixed order, no atomics. 16-byte
// vector accesses (8 bf16); element offsets are 64-bit.
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
#include <cstdint>

#include <cuda_bf16.h>

#include "common/check.h"
#include "common/grid_stride.h"
#include "moe/gather_sum.cuh"
#include "moe/layer_kernels.h"

namespace smoe {
namespace kernels {
namespace {

constexpr int kThreads = 256;


unsigned grid_for(int64_t n) { return detail::grid_blocks(n, kThreads); }

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

namespace {
Status gather_sum(GatherStage stage, const GatherArgs& g, int entries_hint, int sms, cudaStream_t stream,
                  const char* what) {
  const std::optional<GatherShape> forced = gather_shape_override();
  const GatherShape pick = gather_shape(stage, entries_hint, g.E);
  cudaError_t e = launch_gather_sum(stage, forced ? *forced : pick, g, sms, stream);
  // A forced router slab too large for E (refused before any launch, no error recorded): the pick.
  if (e == cudaErrorInvalidConfiguration && forced) e = launch_gather_sum(stage, pick, g, sms, stream);
  return detail::cuda_status(e, what);
}
}  // namespace

Status aggregate(const bf16* Y, const float* scores, const int32_t* rev, const int32_t* token_offset, int d,
                 int64_t T, int entries_hint, int sms, bf16* out, cudaStream_t stream) {
  if (T == 0) return Status{};
  const GatherArgs g{Y, rev, token_offset, scores, nullptr, nullptr, nullptr, d, T, 0, out, nullptr};
  return gather_sum(GatherStage::kAggregate, g, entries_hint, sms, stream, "launch of gather_sum_kernel (aggregate)");
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
              int E, int entries_hint, int sms, bf16* dx, cudaStream_t stream, const int32_t* valid) {
  if (T == 0) return Status{};
  const GatherStage stage = dl != nullptr ? GatherStage::kDxRouter : GatherStage::kDx;
  const GatherArgs g{dXt, rev, token_offset, dl, entry_expert, w_router, dx_router, d, T, E, dx, valid};
  return gather_sum(stage, g, entries_hint, sms, stream, "launch of gather_sum_kernel (dx sum)");
}

Status f32_to_bf16(const float* in, bf16* out, int64_t n, cudaStream_t stream) {
  if (n == 0) return Status{};
  f32_to_bf16_kernel<<<grid_for(n), kThreads, 0, stream>>>(in, out, n);
  SMOE_CHECK_LAUNCH("f32_to_bf16_kernel");
  return Status{};
}

}  // namespace kernels
}  // namespace smoe
