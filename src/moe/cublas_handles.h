// The cuBLAS handles of the router GEMMs: one per host thread and device, created by moe_init() or
// on first use outside graph capture (the library's one allocation of its own), bound to the call's stream and to a workspace region
// carved from the caller's workspace.
#pragma once

#include <cublas_v2.h>
#include <cuda_runtime_api.h>

#include "smoe/smoe.h"

namespace smoe {
namespace blas {

Status prepare(cudaStream_t stream, void* workspace, cublasHandle_t* h);
Status init_current_device();  // creates this thread's handle for the current device (moe_init)
Status check(cublasStatus_t s, const char* what);

}  // namespace blas
}  // namespace smoe
