// Memory-bound kernels of the GPU layer (see layer_kernels.cu for the derivations).
#pragma once

#include <cstdint>
#include <initializer_list>

#include <cuda_runtime_api.h>

#include "smoe/smoe.h"

namespace smoe {
namespace kernels {

// Backward kernels that read saved indices take `valid` (check_saved's flag; null = always valid)
// and do nothing when it is 0.

// The saved-state stamp (memory_plan.h): cleared at the start of forward, written at its end.
Status clear_saved_stamp(void* stamp, cudaStream_t stream);
Status write_saved_stamp(void* stamp, uint64_t magic, uint64_t shape_hash, uint64_t bytes, cudaStream_t stream);
// *valid = (stamp matches); expert_offset_copy[0..E] = the saved expert_offset, or zeros (then no GEMM
// row exists and no saved index is read); a mismatch sets kStatusBadSavedState in status (if given).
Status check_saved(const void* stamp, uint64_t magic, uint64_t shape_hash, uint64_t bytes,
                   const int32_t* expert_offset, int E, int32_t* valid, int32_t* expert_offset_copy,
                   DeviceStatus* status, cudaStream_t stream);
// When *valid == 0, every 4-byte word of each span = 0xFFFFFFFF (NaN in bf16 and fp32). One launch
// for all the spans (null or empty spans are skipped): on a valid call it reads one int and exits.
struct FillSpan {
  void* p;
  size_t bytes;
};
constexpr int kMaxFillSpans = 5;
Status nan_fill_if_invalid(const int32_t* valid, std::initializer_list<FillSpan> spans, cudaStream_t stream);

// Entries of token t are [token_offset[t], token_offset[t+1]); an entry with rev < 0 is an empty
// slot (provided routing) and adds nothing.
// out[t] = sum over entries j of t: scores[j] * Y[rev[j]] (fp32 accumulate, entry order).
// entries_hint: about how many entries a token has (K); it picks the kernel's variant (tokens,
// entries and 16-byte chunks a thread sums at once: gather_shape.h) and nothing else: any value gives
// the same bits.
Status aggregate(const bf16* Y, const float* scores, const int32_t* rev, const int32_t* token_offset, int d,
                 int64_t T, int entries_hint, int sms, bf16* out, cudaStream_t stream);
// dS[scatter[r]] = sum_j partial[r][j] (j ascending) for grouped rows r < *nnz; rows in [*nnz, rows)
// are unused: their entry (if scatter[r] >= 0, an empty slot) gets dS = 0. partial is [rows][tiles].
Status ds_rowsum(const float* partial, int tiles, const int32_t* scatter, int64_t rows, const int32_t* nnz,
                 float* dS, cudaStream_t stream, const int32_t* valid = nullptr);
// dx[t] = sum over entries j of t: dXt[rev[j]] (+ dl[j] * w_router[entry_expert[j]] when dl is not
// null) (+ dx_router[t] fp32 [T][d] when not null), fp32 in entry order. entries_hint as in aggregate.
Status dx_sum(const bf16* dXt, const int32_t* rev, const int32_t* token_offset, const float* dl,
              const int32_t* entry_expert, const bf16* w_router, const float* dx_router, int d, int64_t T,
              int E, int entries_hint, int sms, bf16* dx, cudaStream_t stream, const int32_t* valid = nullptr);
Status f32_to_bf16(const float* in, bf16* out, int64_t n, cudaStream_t stream);

}  // namespace kernels
}  // namespace smoe
