// Memory-bound kernels of the GPU layer (see layer_kernels.cu for the derivations).
#pragma once

#include <cstdint>

#include <cuda_runtime_api.h>

#include "smoe/smoe.h"

namespace smoe {
namespace kernels {

// dst[r] = src[idx[r]] for r < rows; rows of d bf16 (d % 8 == 0). Only the CUTLASS dW path uses it.
Status gather_rows(const bf16* src, int d, const int32_t* idx, int64_t rows, bf16* dst, cudaStream_t stream);
// out[t] = sum_k scores[t*K+k] * Y[rev[t*K+k]] (fp32 accumulate, k order).
Status aggregate(const bf16* Y, const float* scores, const int32_t* rev, int K, int d, int64_t T,
                 bf16* out, cudaStream_t stream);
// dS[scatter[r]] = sum_j partial[r][j] (j ascending), r < rows; partial is [rows][tiles].
Status ds_rowsum(const float* partial, int tiles, const int32_t* scatter, int64_t rows, float* dS,
                 cudaStream_t stream);
// dl[t,k] = s_k (dS_k - sum_j s_j dS_j); dlogits_dense [T][E] bf16 (zeros + the K values).
Status router_backward(const float* dS, const float* scores, const int32_t* topk, int K, int E,
                       int64_t T, float* dl, bf16* dlogits_dense, cudaStream_t stream);
// dx[t] = sum_k dXt[rev[t*K+k]] + dl[t,k] * w_router[topk[t*K+k]].
Status dx_sum(const bf16* dXt, const int32_t* rev, const float* dl, const int32_t* topk,
              const bf16* w_router, int K, int d, int64_t T, bf16* dx, cudaStream_t stream);
Status f32_to_bf16(const float* in, bf16* out, int64_t n, cudaStream_t stream);

}  // namespace kernels
}  // namespace smoe
