// cuBLAS handle cache (see cublas_handles.h).
#include "moe/cublas_handles.h"

#include "common/check.h"
#include "moe/memory_plan.h"

namespace smoe {
namespace blas {

namespace {
Status handle_for_current_device(cublasHandle_t* out) {
  thread_local cublasHandle_t handles[64] = {};
  int dev = 0;
  SMOE_CUDA_RETURN(cudaGetDevice(&dev));
  if (dev < 0 || dev >= 64) return detail::make_status(StatusCode::kInvalidArgument, "moe: device index >= 64");
  if (!handles[dev]) {
    if (cublasCreate(&handles[dev]) != CUBLAS_STATUS_SUCCESS)
      return detail::make_status(StatusCode::kCudaError, "moe: cublasCreate failed");
  }
  *out = handles[dev];
  return Status{};
}
}  // namespace

Status check(cublasStatus_t s, const char* what) {
  if (s == CUBLAS_STATUS_SUCCESS) return Status{};
  return detail::make_status(StatusCode::kCudaError, detail::concat(what, ": cuBLAS status ", static_cast<int>(s)));
}

Status prepare(cudaStream_t stream, void* ws, cublasHandle_t* h) {
  SMOE_RETURN_IF_ERROR(handle_for_current_device(h));
  SMOE_RETURN_IF_ERROR(check(cublasSetStream(*h, stream), "cublasSetStream"));
  SMOE_RETURN_IF_ERROR(check(cublasSetWorkspace(*h, ws, plan::kCublasWorkspace), "cublasSetWorkspace"));
  return Status{};
}

}  // namespace blas
}  // namespace smoe
