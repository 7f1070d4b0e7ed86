// cuBLAS handle cache (see cublas_handles.h).
#include "moe/cublas_handles.h"

#include "common/check.h"
#include "moe/memory_plan.h"

namespace smoe {
namespace blas {

namespace {
// capturing: the call is being captured into a CUDA graph, where creating a handle (it allocates)
// is not allowed: then a missing handle is an error that says to call moe_init() first.
Status handle_for_current_device(cublasHandle_t* out, bool capturing) {
  thread_local cublasHandle_t handles[64] = {};
  int dev = 0;
  SMOE_CUDA_RETURN(cudaGetDevice(&dev));
  if (dev < 0 || dev >= 64) return detail::make_status(StatusCode::kInvalidArgument, "moe: device index >= 64");
  if (!handles[dev]) {
    if (capturing)
      return detail::make_status(StatusCode::kInvalidArgument,
                                 detail::concat("moe: the stream is capturing a CUDA graph and this host thread has no "
                                                "cuBLAS handle for device ", dev,
                                                " yet: call smoe::moe_init() on this thread and device before capture"));
    if (cublasCreate(&handles[dev]) != CUBLAS_STATUS_SUCCESS)
      return detail::make_status(StatusCode::kCudaError, "moe: cublasCreate failed");
  }
  *out = handles[dev];
  return Status{};
}
}  // namespace

Status init_current_device() {
  cublasHandle_t h;
  return handle_for_current_device(&h, false);
}

Status check(cublasStatus_t s, const char* what) {
  if (s == CUBLAS_STATUS_SUCCESS) return Status{};
  return detail::make_status(StatusCode::kCudaError, detail::concat(what, ": cuBLAS status ", static_cast<int>(s)));
}

Status router_logits(cublasHandle_t h, int64_t T, int d, int E, const bf16* w_router, const bf16* x, float* logits,
                     const char* what) {
  // Column-major C (E x T) = op(W_r as d x E)^T * (x as d x T).
  const float one = 1.f, zero = 0.f;
  return check(cublasGemmEx(h, CUBLAS_OP_T, CUBLAS_OP_N, E, static_cast<int>(T), d, &one, w_router, CUDA_R_16BF, d, x,
                            CUDA_R_16BF, d, &zero, logits, CUDA_R_32F, E, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
               what);
}

Status prepare(cudaStream_t stream, void* ws, cublasHandle_t* h) {
  cudaStreamCaptureStatus cap = cudaStreamCaptureStatusNone;
  SMOE_CUDA_RETURN(cudaStreamIsCapturing(stream, &cap));
  SMOE_RETURN_IF_ERROR(handle_for_current_device(h, cap != cudaStreamCaptureStatusNone));
  SMOE_RETURN_IF_ERROR(check(cublasSetStream(*h, stream), "cublasSetStream"));
  SMOE_RETURN_IF_ERROR(check(cublasSetWorkspace(*h, ws, plan::kCublasWorkspace), "cublasSetWorkspace"));
  return Status{};
}

}  // namespace blas
}  // namespace smoe
