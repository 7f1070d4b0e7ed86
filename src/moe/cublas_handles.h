// The cuBLAS handles of the layer (one per host thread and device, created by moe_init() or on
// first use outside graph capture: the library's one allocation of its own), bound to the call's
// stream and to a workspace region carved from the caller's workspace; and the router-logits call.
#pragma once

#include <cublas_v2.h>
#include <cuda_runtime_api.h>

#include "smoe/smoe.h"

namespace smoe {
namespace blas {

Status prepare(cudaStream_t stream, void* workspace, cublasHandle_t* h);
Status init_current_device();  // creates this thread's handle for the current device (moe_init)

// Router logits [T][E] fp32 = x W_r^T (bf16 in, fp32 accumulate). Forward, and token rounding's
// backward, which recomputes them with this same call (so the same values) instead of holding them.
Status router_logits(cublasHandle_t h, int64_t T, int d, int E, const bf16* w_router, const bf16* x, float* logits,
                     const char* what);
Status check(cublasStatus_t s, const char* what);

}  // namespace blas
}  // namespace smoe
